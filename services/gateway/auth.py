"""API keys mapped to tenants. Keys come from a file (one `key [tenant]` per
line, or a JSON object {key: tenant}) and/or YINIAN_API_KEYS
("key1:tenant1,key2:tenant2"). The tenant names the prefix-cache namespace,
so tenants never share cached blocks."""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from pathlib import Path

from services.common.errors import Unauthenticated


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
                keys[key] = tenant.strip() or key[:8]
    env = os.environ.get("YINIAN_API_KEYS", "") if env is None else env
    for item in filter(None, (s.strip() for s in env.split(","))):
        key, _, tenant = item.partition(":")
        keys[key] = tenant or key[:8]
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Authenticator:
    def __init__(self, keys: dict[str, str]):
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def tenant(self, authorization: str | None) -> str:
        """The tenant of a request's `Authorization: Bearer <key>` header."""
        if not self.keys:
            return ""
        if not authorization:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
        for known, tenant in self.keys.items():
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return tenant
        raise Unauthenticated("invalid API key")


def check_listen_address(host: str, auth: Authenticator, allow_unauthenticated: bool) -> None:
    if not auth.enabled and not is_loopback(host) and not allow_unauthenticated:
        raise SystemExit(
            f"refusing to listen on {host} without API keys; give --api-keys (or "
            "YINIAN_API_KEYS), or pass --allow-unauthenticated"
        )
