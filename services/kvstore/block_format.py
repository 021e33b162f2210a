"""How one block is laid out in a Redis value, and the checks every read makes.

    fixed header   magic "YNKV", format version, block hash, parent hash,
                   payload length, payload checksum, fingerprint length,
                   tenant length
    fingerprint    its canonical bytes (services/kvstore/fingerprint.py)
    tenant         UTF-8
    header check   XXH3-64 of everything above (covers the parent hash,
                   which no other check would catch)
    payload        the block's bytes
    tag            keyed BLAKE3 (the mesh's block key, `block_key.py`) of
                   everything above, 16 bytes

A read that finds anything but the fingerprint, tenant, hash and length it
asked for, a payload whose checksum differs, or (checked last) a tag its key did
not make, raises `BlockCorrupt`: the value is never returned. Checksums catch damage;
the tag catches forgery: whoever can write to Redis but lacks the key cannot
make a value that reads back (rewriting a block and recomputing its checksums
is not enough).
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

import blake3

from services.common.kv_checksum import block_checksum

MAGIC = b"YNKV"
FORMAT_VERSION = 3  # 3: the keyed tag (2: XXH3-64 checksums, 1: blake2b)
TAG_BYTES = 16
_FIXED = struct.Struct("<4sHQQQQHH")
_CHECK = struct.Struct("<Q")


class BlockCorrupt(Exception):
    """A stored value that failed verification; `reason` names the check."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Block:
    block_hash: int
    parent_hash: int
    checksum: int
    payload: bytes


def _tag(key: bytes, *parts) -> bytes:
    mac = blake3.blake3(key=key)
    for part in parts:
        mac.update(part)
    return mac.digest(TAG_BYTES)


def encode(
    fingerprint: bytes,
    tenant: str,
    block_hash: int,
    parent_hash: int,
    checksum: int,
    payload,
    *,
    key: bytes,
) -> bytes:
    tenant_bytes = tenant.encode()
    header = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        block_hash,
        parent_hash,
        len(payload),
        checksum,
        len(fingerprint),
        len(tenant_bytes),
    )
    header += fingerprint + tenant_bytes
    head = header + _CHECK.pack(block_checksum(header))
    return b"".join((head, payload, _tag(key, head, payload)))


def decode(value: bytes, *, fingerprint: bytes, tenant: str, block_hash: int, key: bytes) -> Block:
    """The verified block in `value`, which must be `block_hash` of `tenant`
    under `fingerprint`, tagged with `key`; raises BlockCorrupt otherwise."""
    if len(value) < _FIXED.size + TAG_BYTES:
        raise BlockCorrupt("truncated", f"{len(value)} bytes, shorter than a header")
    magic, version, stored_hash, parent, length, checksum, fp_len, tenant_len = _FIXED.unpack_from(
        value
    )
    if magic != MAGIC:
        raise BlockCorrupt("magic")
    if version != FORMAT_VERSION:
        raise BlockCorrupt("version", f"format {version}, expected {FORMAT_VERSION}")
    header_end = _FIXED.size + fp_len + tenant_len
    if len(value) < header_end + _CHECK.size + TAG_BYTES:
        raise BlockCorrupt("truncated", "in the header")
    (header_check,) = _CHECK.unpack_from(value, header_end)
    if block_checksum(memoryview(value)[:header_end]) != header_check:
        raise BlockCorrupt("header", "header checksum mismatch")
    if value[_FIXED.size : _FIXED.size + fp_len] != fingerprint:
        raise BlockCorrupt("fingerprint", "written under another model fingerprint")
    if value[_FIXED.size + fp_len : header_end] != tenant.encode():
        raise BlockCorrupt("tenant", "written for another tenant")
    if stored_hash != block_hash:
        raise BlockCorrupt("hash", f"holds {stored_hash:016x}")
    payload = value[header_end + _CHECK.size : -TAG_BYTES]
    if len(payload) != length:
        raise BlockCorrupt("truncated", f"payload {len(payload)} of {length} bytes")
    if block_checksum(payload) != checksum:
        raise BlockCorrupt("checksum", "payload checksum mismatch")
    # last: a value that passes every check above but not this one was forged
    if not hmac.compare_digest(_tag(key, memoryview(value)[:-TAG_BYTES]), value[-TAG_BYTES:]):
        raise BlockCorrupt("tag", "not tagged with this mesh's block key")
    return Block(stored_hash, parent, checksum, payload)
