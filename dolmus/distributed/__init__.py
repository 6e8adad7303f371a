"""Tensor parallelism: which rank a process is, and the collectives its layers call."""
