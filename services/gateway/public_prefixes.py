"""Prefixes an operator marks as shared by every tenant (system prompts): a
prompt that starts with one has the blocks within it cached in the public
namespace, so every tenant reuses them; everything after stays the tenant's.

The file is a JSON list; each entry is a text (`"You are ..."`, tokenized as a
completion prompt is), `{"messages": [...]}` (rendered with the chat template,
without the generation prompt, as a chat request's leading messages are), or
`{"token_ids": [...]}`.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_public_prefixes(path: str | None, tokenizer, check_token_ids) -> list[list[int]]:
    if not path:
        return []
    entries = json.loads(Path(path).read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of prefixes")
    prefixes = []
    for entry in entries:
        if isinstance(entry, str):
            ids = tokenizer.encode(entry)
        elif isinstance(entry, dict) and "messages" in entry:
            ids = tokenizer.encode_chat(entry["messages"], add_generation_prompt=False)
        elif isinstance(entry, dict) and "token_ids" in entry:
            ids = list(entry["token_ids"])
            check_token_ids(ids)
        else:
            raise ValueError(f"{path}: a prefix is a text, {{messages}} or {{token_ids}}")
        if ids:
            prefixes.append(ids)
    return prefixes


def public_tokens(prompt_ids: list[int], prefixes: list[list[int]]) -> int:
    """The length of the longest public prefix the prompt starts with (0: none)."""
    best = 0
    for prefix in prefixes:
        if len(prefix) > best and prompt_ids[: len(prefix)] == prefix:
            best = len(prefix)
    return best
