"""The checksum of a KV block's bytes, computed by whoever writes a block and
verified by whoever reads it (workers and the KV store use this one function,
so a block's checksum means the same everywhere).

XXH3-64 runs at memory speed (tens of GB/s on one core) and releases the GIL
on large buffers, so a worker can check megabytes of KV in a thread while its
event loop keeps streaming tokens."""

from __future__ import annotations

import xxhash


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """XXH3 with a 64-bit digest, as an unsigned int."""
    return xxhash.xxh3_64_intdigest(data)
