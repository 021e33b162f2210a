"""Benchmarks: the load generator behind `yinian bench` (loadgen/), the GPU experiment
scripts (gpu/), and their current raw results (results/)."""

import basis.grpc_fork  # noqa: F401  (before any gRPC import)
