"""Chained content hashes of KV blocks.

A block's hash covers its parent's hash, the tenant namespace and its own
token ids, so equal hashes mean equal prefixes within one namespace. The
hashes are stable across processes and machines: workers, the scheduler,
the gateway and the KV store all compute the same value for the same prefix.
"""

from __future__ import annotations

import hashlib
import struct


def hash_block_tokens(parent_hash: int | None, token_ids, namespace: str = "") -> int:
    """A 64-bit hash of (parent block hash, namespace, this block's tokens)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent_hash or 0).to_bytes(8, "little"))
    h.update(namespace.encode())
    h.update(b"\x00")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def hash_prompt_blocks(token_ids, block_size: int, namespace: str = "") -> list[int]:
    """Hashes of every full block of a token sequence, chained from the first."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], namespace)
        hashes.append(parent)
    return hashes
