"""The checksum of a KV block's bytes, computed by whoever writes a block and
verified by whoever reads it (workers and the KV store use this one function,
so a block's checksum means the same everywhere)."""

from __future__ import annotations

import hashlib


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """blake2b with an 8-byte digest, read as a little-endian unsigned 64-bit int."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
