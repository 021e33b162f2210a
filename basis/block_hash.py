"""Chained content hashes of KV blocks.

A block's hash covers its parent's hash, the tenant namespace and its own
token ids, so equal hashes mean equal prefixes within one namespace. The
hashes are stable across processes and machines: workers, the scheduler,
the gateway and the KV store all compute the same value for the same prefix.
"""

from __future__ import annotations

import functools
import hashlib
import struct

# The namespace of prefixes an operator marks as shared by every tenant (system
# prompts): a prompt's leading blocks that lie wholly inside such a prefix are
# hashed here, the rest under the tenant's own namespace.
PUBLIC_NAMESPACE = "__public__"


def hash_block_tokens(parent_hash: int | None, token_ids, namespace: str = "") -> int:
    """A 64-bit hash of (parent block hash, namespace, this block's tokens)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent_hash or 0).to_bytes(8, "little"))
    h.update(namespace.encode())
    h.update(b"\x00")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def block_namespace(index: int, block_size: int, namespace: str, public_tokens: int) -> str:
    """The namespace of block `index`: public while it lies within the public prefix."""
    return PUBLIC_NAMESPACE if (index + 1) * block_size <= public_tokens else namespace


def hash_prompt_blocks(
    token_ids, block_size: int, namespace: str = "", public_tokens: int = 0
) -> list[int]:
    """Hashes of every full block of a token sequence, chained from the first; the
    blocks within its first `public_tokens` tokens are in the public namespace.
    (The same values as hash_block_tokens block by block, with the ids packed once.)"""
    count = len(token_ids) // block_size
    if count == 0:
        return []
    width = 8 * block_size
    packed = struct.pack(f"<{count * block_size}q", *token_ids[: count * block_size])
    names = (PUBLIC_NAMESPACE.encode() + b"\x00", namespace.encode() + b"\x00")
    public_blocks = public_tokens // block_size
    blake2b, parent, hashes = hashlib.blake2b, bytes(8), []
    for i in range(count):
        name = names[0] if i < public_blocks else names[1]
        block = packed[i * width : (i + 1) * width]
        parent = blake2b(parent + name + block, digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


@functools.lru_cache(maxsize=32)
def _memo(tokens: tuple, block_size: int, namespace: str, public_tokens: int) -> tuple[int, ...]:
    return tuple(hash_prompt_blocks(tokens, block_size, namespace, public_tokens))


def cached_prompt_blocks(
    token_ids, block_size: int, namespace: str = "", public_tokens: int = 0
) -> list[int]:
    """hash_prompt_blocks, remembered for the last few prompts: a worker hashes one
    prompt in several places (its shared-tier lookup, the engine's prefix search, the
    write-through), and making the key (a tuple of the ids, compared whole on a hit)
    costs a fraction of hashing them."""
    count = len(token_ids) // block_size
    key = tuple(token_ids[: count * block_size])
    return list(_memo(key, block_size, namespace, public_tokens))
