"""Benchmarks: GPU scripts whose raw output lands in bench/results/, and the load generator."""
