"""Benchmarks: the load generator behind `yinian bench` (loadgen/), the GPU experiment
scripts (gpu/), and their current raw results (results/)."""
