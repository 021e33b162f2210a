"""Operators of the engine: a pure-torch reference for each, and Triton
kernels that replace them on CUDA. `kernels.ops` is the one place the engine
calls; it picks the implementation for the tensor's device."""
