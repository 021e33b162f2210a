"""Runs the sections of a GPU benchmark script: each one timed, its result (or
its traceback, so one failure costs only that section) stored under its name,
and the whole JSON rewritten after every section so a run cut short keeps
what it had."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path


class Sections:
    def __init__(self, results: dict, path: Path, skip: list[str], root: dict | None = None):
        """`root`: the whole JSON, when `results` is a part of it (nested sections)."""
        self.results, self.path, self.skip = results, path, skip
        self.root = results if root is None else root

    def save(self) -> None:
        self.path.write_text(json.dumps(self.root, indent=2, default=str))

    def __call__(self, name: str, fn: Callable[[], object]) -> None:
        if name in self.skip:
            return
        start = time.monotonic()
        try:
            self.results[name] = fn()
        except Exception:
            self.results[name] = {"error": traceback.format_exc()}
            print(self.results[name]["error"], flush=True)
        self.results.setdefault("seconds", {})[name] = time.monotonic() - start
        self.save()
        print(f"-- {name} done in {time.monotonic() - start:.0f} s", flush=True)
