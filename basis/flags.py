"""Command-line flags derived from a config dataclass, so that a setting's
default, type, help and environment variable are written once, on its field.

    @dataclass(slots=True)
    class SchedulerConfig:
        port: int = setting(50052, "gRPC port", env="YINIAN_SCHEDULER_PORT")

    config = parse_config(SchedulerConfig, argv, "yinian PD scheduler")

A field `foo_bar` is the flag `--foo-bar`; its environment variable is
`YINIAN_FOO_BAR` unless the field names another (`env=""`: none). Booleans
take `--x/--no-x`, lists a comma-separated value, and a field named `*_bytes`
a size: bytes, or with a unit (`512MiB`, `16GiB`; KiB, MiB, GiB, TiB, or
K, M, G, T, all powers of 1024). Validation stays in the
dataclass's `__post_init__`, which the parsed values go through.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any

ENV_PREFIX = "YINIAN_"


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows each option's default, where it has one and the text does not
    say it already (flags made from config fields carry theirs)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "default" not in text
            and "%(default)" not in text
            and default not in (None, False, "", [], argparse.SUPPRESS)
        ):
            text += " (default: %(default)s)"
        return text


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    env: str | None = None,
    choices=None,
    factory=None,
):
    """A config field with its flag's help text, environment variable and choices."""
    metadata = {"help": help, "env": env, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def not_a_flag(factory):
    """A config field filled by the code that parses the flags, not by a flag."""
    return dataclasses.field(default_factory=factory, metadata={"flag": False})


def flag_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag", True)]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(hint) -> tuple[type, bool]:
    """(the value type, whether None is allowed) of `int | None`, `list[str]`, ..."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return _base_type(rest[0])[0], True
    return hint, False


_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from `4096`, `512MiB`, `16GiB`, `1.5G` (every unit a power of 1024)."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _UNITS.get(value[-1:], 1) if value else 1
    number = value[:-1] if scale != 1 else value
    try:
        size = float(number) * scale
    except ValueError:
        raise ValueError(f"not a size: {text!r} (bytes, or e.g. 512MiB, 16GiB)") from None
    if size < 0 or size != int(size):
        raise ValueError(f"not a size: {text!r} (a whole, non-negative number of bytes)")
    return int(size)


def _is_list(kind) -> bool:
    return typing.get_origin(kind) is list


def _convert(kind, text: str):
    if _is_list(kind):
        item = typing.get_args(kind)[0]
        return [item(part.strip()) for part in text.split(",") if part.strip()]
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {text!r}")
    return kind(text)


def env_name(field: dataclasses.Field) -> str | None:
    env = field.metadata.get("env")
    if env is None:
        return ENV_PREFIX + field.name.upper()
    return env or None


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def add_flags(
    parser: argparse.ArgumentParser,
    cls,
    *,
    title: str | None = None,
    dest_prefix: str = "",
    only_given: bool = False,
    use_env: bool = True,
) -> None:
    """Adds one flag per field of `cls`. With `only_given`, a flag not on the
    command line parses as None (so callers pass on only what was given)."""
    target = parser.add_argument_group(title) if title else parser
    hints = typing.get_type_hints(cls)
    for field in flag_fields(cls):
        kind, _ = _base_type(hints[field.name])
        env = env_name(field) if use_env else None
        default = _default(field)
        from_env = os.environ.get(env) if env else None
        if from_env is not None:
            sized = kind is int and field.name.endswith("_bytes")
            default = parse_size(from_env) if sized else _convert(kind, from_env)
        help_text = field.metadata.get("help", "")
        shown = default if default is not dataclasses.MISSING else None
        if _is_list(kind) and shown:
            shown = ",".join(map(str, shown))
        notes = [] if shown in (None, dataclasses.MISSING) else [f"default: {shown}"]
        if env:
            notes.append(f"env {env}")
        kwargs: dict[str, Any] = {
            "dest": dest_prefix + field.name,
            "help": f"{help_text} ({'; '.join(notes)})" if notes else help_text,
        }
        if only_given:
            kwargs["default"] = None
        elif default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind is int and field.name.endswith("_bytes"):
            kwargs["type"] = parse_size
            kwargs["help"] += " (a size: bytes, or e.g. 512MiB, 16GiB)"
        else:
            kwargs["type"] = (lambda k: lambda text: _convert(k, text))(kind)
            kwargs["metavar"] = field.name.upper()
            if field.metadata.get("choices"):
                kwargs["choices"] = field.metadata["choices"]
        target.add_argument(flag_name(field.name), **kwargs)


def given_options(cls, args: argparse.Namespace, dest_prefix: str = "") -> dict:
    """The fields of `cls` whose flags were given (with `only_given` flags)."""
    out = {}
    for field in flag_fields(cls):
        value = getattr(args, dest_prefix + field.name, None)
        if value is not None:
            out[field.name] = value
    return out


def from_args(cls, args: argparse.Namespace, dest_prefix: str = "", **extra):
    """Builds `cls` from parsed flags (plus `extra` fields not taken from flags)."""
    values = {
        f.name: getattr(args, dest_prefix + f.name)
        for f in flag_fields(cls)
        if f.name not in extra and hasattr(args, dest_prefix + f.name)
    }
    return cls(**values, **extra)


def parse_config(cls, argv: list[str] | None, description: str, extend=None, extra=None):
    """Parses `argv` into `cls`; a value `__post_init__` rejects is a usage error.
    `extend(parser)` adds flags of its own; `extra(args)` returns the fields they fill."""
    parser = argparse.ArgumentParser(description=description, formatter_class=DefaultsFormatter)
    add_flags(parser, cls)
    if extend is not None:
        extend(parser)
    args = parser.parse_args(argv)
    try:
        return from_args(cls, args, **(extra(args) if extra is not None else {}))
    except ValueError as exc:
        parser.error(str(exc))


def to_argv(options: dict) -> list[str]:
    """The flags that reproduce `options`, for starting the same settings in another
    process."""
    argv: list[str] = []
    for name, value in options.items():
        if isinstance(value, bool):
            argv.append(flag_name(name) if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            argv += [flag_name(name), ",".join(map(str, value))]
        else:
            argv += [flag_name(name), str(value)]
    return argv
