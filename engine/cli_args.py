"""Engine options as command-line flags (`--max-num-seqs 64`), derived from
EngineConfig so every command that starts an engine takes the same ones."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from engine.config import EngineConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        hint = hints[field.name]
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        if base is bool:
            group.add_argument(
                _flag(field.name),
                dest=f"engine_{field.name}",
                action=argparse.BooleanOptionalAction,
                default=None,
            )
        else:
            group.add_argument(
                _flag(field.name),
                dest=f"engine_{field.name}",
                type=base,
                default=None,
                help=f"default: {field.default}",
            )


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line (only those given)."""
    out = {}
    for field in dataclasses.fields(EngineConfig):
        value = getattr(args, f"engine_{field.name}", None)
        if value is not None:
            out[field.name] = value
    return out


def engine_argv(options: dict) -> list[str]:
    """The flags that reproduce `options`, for starting an engine in another process."""
    argv: list[str] = []
    for name, value in options.items():
        if isinstance(value, bool):
            argv.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
        else:
            argv += [_flag(name), str(value)]
    return argv
