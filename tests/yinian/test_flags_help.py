"""Every flag of every command (`yinian ...`) and of every service (`python -m
services.<name>`) says what it does, shows its default where it has one, and
names its unit where it is a quantity whose name does not (a timeout, an
interval); sizes take units (`16GiB`)."""

from __future__ import annotations

import argparse
import importlib

import pytest

from basis.flags import parse_size
from yinian.cli import build_parser

SERVICES = ("gateway", "scheduler", "kvstore", "decode", "prefill", "expert")
QUANTITIES = ("timeout", "interval", "delay", "period")  # a name with no unit in it
UNITS_IN_NAMES = ("seconds", "bytes", "_gb", "_mb", "_ms")
UNIT_WORDS = ("second", "byte", "GiB", "MiB", "minute", " ms")


class _Captured(Exception):
    pass


def service_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser a service's `parse` builds (taken as it is about to parse)."""
    captured = {}

    def grab(self, args=None, namespace=None):
        captured["parser"] = self
        raise _Captured

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", grab)
        with pytest.raises(_Captured):
            importlib.import_module(f"services.{name}.config").parse([])
    return captured["parser"]


def commands(parser: argparse.ArgumentParser, name: str):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from commands(child, f"{name} {sub}")


def problems(name: str, parser: argparse.ArgumentParser) -> list[str]:
    out = []
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = max(action.option_strings, key=len)
        text = formatter._expand_help(action) if action.help else ""
        wrong = []
        if not text or action.help == argparse.SUPPRESS:
            wrong.append("no help")
        has_default = action.default not in (None, False, "", [], argparse.SUPPRESS)
        if has_default and not isinstance(action, argparse._StoreTrueAction):
            if "default" not in text:
                wrong.append(f"its default {action.default!r} is not shown")
        dest = action.dest.lower()
        named = any(unit in dest for unit in UNITS_IN_NAMES)
        if any(dest.endswith(q) for q in QUANTITIES) and not named:
            if not any(word in text for word in UNIT_WORDS):
                wrong.append("no unit")
        if wrong:
            out.append(f"{name} {flag}: {', '.join(wrong)}")
    return out


def test_every_flag_has_help_its_default_and_its_unit(monkeypatch):
    parsers = list(commands(build_parser(), "yinian"))
    parsers += [(f"python -m services.{s}", service_parser(s, monkeypatch)) for s in SERVICES]
    assert len(parsers) >= 12
    found = [p for name, parser in parsers for p in problems(name, parser)]
    assert found == []


def test_sizes_take_units_and_bad_ones_are_refused(monkeypatch):
    assert parse_size("16GiB") == 16 << 30 and parse_size("512M") == 512 << 20
    assert parse_size("4096") == 4096
    kvstore = service_parser("kvstore", monkeypatch)
    args = argparse.ArgumentParser.parse_args(kvstore, ["--memory-tier-bytes", "2GiB"])
    assert args.memory_tier_bytes == 2 << 30
    with pytest.raises(SystemExit):  # argparse's error: a usage line and exit 2
        argparse.ArgumentParser.parse_args(kvstore, ["--memory-tier-bytes", "lots"])
