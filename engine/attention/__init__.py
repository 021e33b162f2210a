"""Attention backends: one interface, a torch reference on every device and
Triton kernels on CUDA."""

from engine.attention.backend import AttentionBackend, TorchAttentionBackend, get_backend
from engine.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_backend"]
