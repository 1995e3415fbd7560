"""Mechanisms of a cluster of instances: pipeline plans (which layers a stage holds, how a step
is cut into microbatches, when each stage runs each microbatch) and dispatch state. Plain
synchronous code with no I/O; the coordinator actor and the pipeline runners use it."""
