"""The configuration keys as ``rlhfkit train --help`` lists them, from the fields' own help text."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from rlhfkit.config.fields import field_types, is_section
from rlhfkit.config.run import RunConfig


def config_help(cls: type = RunConfig, prefix: str = "") -> str:
    """One entry per key: ``dotted.key (type, default: value)`` and its help text, for ``--help``."""
    lines = []
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if is_section(hints[f.name]):
            lines.append(f"{key}:  {f.metadata['help']}")
            lines.append(config_help(hints[f.name], key + "."))
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        lines.append(f"  {key} ({_type_name(hints[f.name])}, default: {_show(default)})")
        lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)


def _type_name(tp: Any) -> str:
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner) + (" or none" if len(inner) < len(args) else "")
    if origin is list:
        return f"list of {_type_name(args[0])}"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
