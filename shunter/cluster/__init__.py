"""Several instances behind one coordinator: each instance is one Engine in its own process
(local processes, or Ray actors across machines), or an in-process engine (the simulator)."""
