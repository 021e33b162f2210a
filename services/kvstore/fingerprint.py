"""A model fingerprint: what a KV block's bytes mean (model, dtype, block
size, per-layer layout, layers, serialization version). Blocks are stored
and found only under their fingerprint, so a layout change can never hand a
worker bytes it would misread (LMCache's silent corruption after vLLM's
layout change is the failure this prevents)."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass

MAX_TEXT = 256  # characters of model_id, dtype and layout
MAX_BLOCK_SIZE = 1 << 20  # tokens per block
MAX_LAYERS = 10_000


@dataclass(frozen=True, slots=True)
class Fingerprint:
    model_id: str
    dtype: str
    block_size: int
    layout: str
    num_layers: int
    format_version: int = 0

    def __post_init__(self) -> None:
        for name in ("model_id", "dtype", "layout"):
            value = getattr(self, name)
            if not value:
                raise ValueError(f"fingerprint.{name} is required")
            if len(value) > MAX_TEXT:
                raise ValueError(f"fingerprint.{name} is longer than {MAX_TEXT} characters")
        if not 0 < self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"fingerprint.block_size must be in 1..{MAX_BLOCK_SIZE}")
        if not 0 < self.num_layers <= MAX_LAYERS:
            raise ValueError(f"fingerprint.num_layers must be in 1..{MAX_LAYERS}")
        if self.format_version < 0:
            raise ValueError("fingerprint.format_version must be >= 0")

    def canonical(self) -> bytes:
        """The bytes stored in every block's header and compared on every read."""
        return _canonical(self)

    @property
    def id(self) -> str:
        """16 hex digits naming the fingerprint in Redis keys (made once per
        fingerprint: every block of every call names it)."""
        return _id(self)

    @classmethod
    def from_canonical(cls, data: bytes) -> Fingerprint:
        return cls(**json.loads(data))


@functools.lru_cache(maxsize=1024)
def _canonical(fingerprint: Fingerprint) -> bytes:
    return json.dumps(asdict(fingerprint), sort_keys=True, separators=(",", ":")).encode()


@functools.lru_cache(maxsize=1024)
def _id(fingerprint: Fingerprint) -> str:
    return hashlib.blake2b(_canonical(fingerprint), digest_size=8).hexdigest()
