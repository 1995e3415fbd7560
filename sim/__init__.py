"""The simulator backend: the same actors and policies, with steps and swaps that take the time a
profile predicts instead of running a model. Under `trio.testing.MockClock(autojump_threshold=0)`
this is a discrete-event simulator (DESIGN.md, "Time, and the simulator that is the same code")."""
