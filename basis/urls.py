"""URLs as logs and banners may show them (never with their login), and as a
deployment gives them (a password from a secret of its own, apart from the URL)."""

from __future__ import annotations

import os
from urllib.parse import quote

NATS_PASSWORD_ENV = "YINIAN_NATS_PASSWORD"  # deployments: the NATS login `yinian`'s password
REDIS_PASSWORD_ENV = "YINIAN_REDIS_PASSWORD"  # deployments: Redis's `requirepass`
NATS_USER = "yinian"


def without_login(url: str) -> str:
    """`url` without its user and password (`redis://:secret@host:6379/0` ->
    `redis://host:6379/0`)."""
    head, sep, rest = url.partition("://")
    return f"{head}{sep}{rest.rsplit('@', 1)[-1]}" if sep else url


def with_login(url: str, password_env: str, user: str = "") -> str:
    """`url` with the password the environment variable `password_env` holds (and
    `user`), unless that is unset or empty or `url` names a login of its own."""
    password = os.environ.get(password_env, "")
    head, sep, rest = url.partition("://")
    if not password or not sep or "@" in rest.split("/", 1)[0]:
        return url
    return f"{head}://{quote(user, safe='')}:{quote(password, safe='')}@{rest}"
