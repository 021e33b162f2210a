"""The one runner of every GPU experiment script.

`script_parser` gives each script the same flags: `--out PATH` (the JSON file),
`--skip NAME ...` and `--device cuda|cpu` (cpu: the script's dry run on a tiny
preset). `Sections` runs the script's sections: each one timed, its result (or
its traceback, so one failure costs only that section) stored under its name,
or `{"skipped": reason}` when the command line skips it or this run lacks the
hardware it needs; the whole JSON is rewritten after every section, so a run
cut short keeps what it had. `seconds` lists every section called.

Resources that several sections use (an engine, a mesh) are made on first use
by `Sections.resource`: a failure to make one is re-raised in every section
that needs it, and whatever was made is closed when the runner ends.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A GPU script's parser, with the flags every script shares."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--skip", nargs="*", default=[], metavar="NAME", help="sections to skip")
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"),
        help="cpu: a dry run of the script on a tiny preset at tiny sizes",
    )  # fmt: skip
    return parser


class Resource(Generic[T]):
    """Made once, on first call; its failure is remembered and raised again."""

    def __init__(self, make: Callable[[], T], close: Callable[[T], object]):
        self._make, self._close = make, close
        self._value: T | None = None
        self._error: BaseException | None = None

    def __call__(self) -> T:
        if self._error is not None:
            raise RuntimeError("could not be made earlier in this run") from self._error
        if self._value is None:
            try:
                self._value = self._make()
            except BaseException as exc:
                self._error = exc
                raise
        return self._value

    def close(self) -> None:
        if self._value is not None:
            value, self._value = self._value, None
            self._close(value)


class Sections:
    """`with Sections(args, script=...) as section: section("name", fn)`."""

    def __init__(self, args: argparse.Namespace, **header):
        self.path = Path(args.out)
        self.skip = set(args.skip)
        self.device = args.device
        self.results: dict = {"device": self.device, **header, "seconds": {}}
        self._resources: list[Resource] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-")
        self.tmp = Path(self._tmp.name)  # model folders and other scratch, removed at the end

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def __enter__(self) -> Sections:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.save()
        return self

    def __exit__(self, *exc) -> None:
        try:
            for resource in reversed(self._resources):
                resource.close()
        finally:
            self.save()
            self._tmp.cleanup()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.results, indent=2, default=str))

    def resource(self, make: Callable[[], T], close: Callable[[T], object]) -> Resource[T]:
        resource = Resource(make, close)
        self._resources.append(resource)
        return resource

    def missing(self, needs: str | None, gpus: int) -> str | None:
        """Why a section that needs `needs` on `gpus` GPUs cannot run here, or None."""
        if needs is None:
            return None
        if not self.cuda:
            return f"needs {needs}; this is a dry run on the cpu"
        import torch

        if torch.cuda.device_count() < gpus:
            return f"needs {needs}; this machine has {torch.cuda.device_count()} GPU(s)"
        return None

    def __call__(
        self, name: str, fn: Callable[[], object], needs: str | None = None, gpus: int = 1
    ):
        """Runs one section; returns its result, or None when it failed or was skipped.
        `needs`: the CUDA feature the section's work cannot do without (skipped on cpu)."""
        start = time.monotonic()
        reason = "skipped on the command line" if name in self.skip else self.missing(needs, gpus)
        value = None
        if reason is not None:
            self.results[name] = {"skipped": reason}
            print(f"-- {name} skipped: {reason}", flush=True)
        else:
            try:
                value = self.results[name] = fn()
            except Exception:
                self.results[name] = {"error": traceback.format_exc()}
                print(self.results[name]["error"], flush=True)
            print(f"-- {name} done in {time.monotonic() - start:.1f} s", flush=True)
        self.results["seconds"][name] = time.monotonic() - start
        self.save()
        return value


def outcome(entry) -> str:
    """How one section's entry in a written JSON ended: "ok", "error" or "skipped"."""
    if isinstance(entry, dict) and set(entry) == {"error"}:
        return "error"
    if isinstance(entry, dict) and set(entry) == {"skipped"}:
        return "skipped"
    return "ok"
