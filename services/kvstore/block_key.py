"""The mesh's block key: what tags every block the KV store writes to Redis
(block_format.py), so that whoever can write to Redis but lacks the key cannot
plant a block any store will read.

Every KV store of a mesh must hold the same key (they read each other's
blocks), and a restarted store must keep it (or the blocks in Redis read as
misses): `yinian up` makes one per mesh and hands it to its stores as
`YINIAN_BLOCK_KEY`; elsewhere give it as `--block-key-file` or that variable
(64 hex digits; a deployment's secret). A store given none makes a random key
and says so: safe, but what it wrote is lost to the next store process.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

logger = logging.getLogger(__name__)
ENV = "YINIAN_BLOCK_KEY"
KEY_BYTES = 32


def random_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def new_key() -> str:
    """A fresh key, as the hex text `YINIAN_BLOCK_KEY` and key files hold."""
    return secrets.token_hex(KEY_BYTES)


def parse_key(text: str, where: str) -> bytes:
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{where}: the block key must be {2 * KEY_BYTES} hex digits") from None
    if len(key) != KEY_BYTES:
        raise ValueError(
            f"{where}: the block key must be {2 * KEY_BYTES} hex digits, not {len(text)}"
        )
    return key


def load_key(path: str = "") -> bytes:
    """The key from `path` (a file of hex), else `YINIAN_BLOCK_KEY`, else a random one."""
    if path:
        return parse_key(Path(path).read_text(), path)
    if os.environ.get(ENV):
        return parse_key(os.environ[ENV], ENV)
    logger.warning("no block key (--block-key-file or %s): a random one; blocks this store "
                   "writes to Redis will not verify for the next store process", ENV)  # fmt: skip
    return random_key()
