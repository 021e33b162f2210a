"""Engine options as command-line flags (`--max-num-seqs 64`), derived from
EngineConfig so every command that starts an engine takes the same ones."""

from __future__ import annotations

import argparse

from basis.flags import add_flags, given_options, to_argv
from engine.config import EngineConfig

_DEST = "engine_"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_flags(
        parser,
        EngineConfig,
        title="engine options",
        dest_prefix=_DEST,
        only_given=True,
        use_env=False,
    )


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line (only those given)."""
    return given_options(EngineConfig, args, _DEST)


def options_from_flags(argv: list[str]) -> dict:
    """The engine options that flags give (`["--piece-graphs"]`); an unknown flag
    exits with argparse's error."""
    parser = argparse.ArgumentParser(prog="engine flags", add_help=False)
    add_engine_args(parser)
    return engine_options(parser.parse_args(argv))


def engine_argv(options: dict) -> list[str]:
    """The flags that reproduce `options`, for starting an engine in another process."""
    return to_argv(options)
