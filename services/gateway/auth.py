"""API keys mapped to tenants. Keys come from a file (one `key [tenant]` per
line, or a JSON object {key: tenant}) and/or YINIAN_API_KEYS
("key1:tenant1,key2:tenant2"); the file is read again on SIGHUP. The tenant
names the prefix-cache namespace, so tenants never share cached blocks.

Keys are held and compared only as SHA-256 digests (in constant time), and
never logged, traced or used to name a tenant: a key
without a tenant gets one named after its digest."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
from pathlib import Path

from services.common.errors import Unauthenticated

logger = logging.getLogger(__name__)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def anonymous_tenant(key: str) -> str:
    return "key-" + digest(key).hex()[:12]


def load_keys(path: str | None = None, env: str | None = None) -> dict[str, str]:
    keys: dict[str, str] = {}
    if path:
        text = Path(path).read_text()
        if text.lstrip().startswith("{"):
            keys.update({str(k): str(v) for k, v in json.loads(text).items()})
        else:
            for line in text.splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                key, _, tenant = line.partition(" ")
                keys[key] = tenant.strip() or anonymous_tenant(key)
    env = os.environ.get("YINIAN_API_KEYS", "") if env is None else env
    for item in filter(None, (s.strip() for s in env.split(","))):
        key, _, tenant = item.partition(":")
        keys[key] = tenant or anonymous_tenant(key)
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Authenticator:
    def __init__(self, keys: dict[str, str], path: str | None = None):
        self.path = path  # read again by reload()
        self._tenants = {digest(k): t for k, t in keys.items()}

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def reload(self) -> None:
        """Reads the key file again (SIGHUP); a broken file keeps the keys in force."""
        try:
            keys = load_keys(self.path)
        except (OSError, ValueError) as exc:
            logger.error("API keys not reloaded: %s", type(exc).__name__)
            return
        if self._tenants and not keys:  # an emptied (or half-written) file
            logger.error("API keys not reloaded: the file has no keys, and an empty "
                         "file would turn authentication off")  # fmt: skip
            return
        self._tenants = {digest(k): t for k, t in keys.items()}
        logger.warning("API keys reloaded: %d keys", len(keys))

    def tenant(self, authorization: str | None) -> str:
        """The tenant of a request's `Authorization: Bearer <key>` header."""
        if not self._tenants:
            return ""
        if not authorization:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
        # Every known digest is compared, in constant time, with no early exit: the
        # time taken says nothing of which key (if any) matched.
        presented, tenant = digest(key.strip()), None
        for known, owner in self._tenants.items():
            if hmac.compare_digest(known, presented):
                tenant = owner
        if tenant is None:
            raise Unauthenticated("invalid API key")
        return tenant


def check_listen_address(host: str, auth: Authenticator, allow_unauthenticated: bool) -> None:
    if not auth.enabled and not is_loopback(host) and not allow_unauthenticated:
        raise SystemExit(
            f"refusing to listen on {host} without API keys; give --api-keys (or "
            "YINIAN_API_KEYS), or pass --allow-unauthenticated"
        )
