"""URLs as logs and banners may show them: never with their login."""

from __future__ import annotations


def without_login(url: str) -> str:
    """`url` without its user and password (`redis://:secret@host:6379/0` ->
    `redis://host:6379/0`)."""
    head, sep, rest = url.partition("://")
    return f"{head}{sep}{rest.rsplit('@', 1)[-1]}" if sep else url
