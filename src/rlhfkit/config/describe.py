"""The configuration keys described from the fields' own help text: ``rlhfkit train KIND --help``
(:func:`config_help`) and ``rlhfkit config init KIND`` (:func:`init_yaml`), each with KIND's sections and
KIND's own defaults (:func:`kind_default`); the Markdown reference is :mod:`rlhfkit.config.reference`."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Iterator
from typing import Any, Literal

from rlhfkit.config.fields import field_types, is_section
from rlhfkit.config.run import KIND_DEFAULTS, KIND_FORCED, KIND_SECTIONS, ONLINE_KINDS, RunConfig

# Set by the command itself, never in a file: left out of the per-kind listings.
_SET_BY_COMMAND = ("kind",)


@dataclasses.dataclass(frozen=True)
class Key:
    """One configuration key: its dotted name, its field and the field's resolved type."""

    name: str
    field: dataclasses.Field
    type: Any

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default is dataclasses.MISSING else f.default


def sections(kind: str | None = None) -> list[tuple[str, str]]:
    """``(section name, help)`` of the sections ``kind`` reads (every section when ``kind`` is None)."""
    hints = field_types(RunConfig)
    return [
        (f.name, f.metadata["help"])
        for f in dataclasses.fields(RunConfig)
        if is_section(hints[f.name]) and (kind is None or f.name in KIND_SECTIONS[kind])
    ]


def keys(cls: type = RunConfig, prefix: str = "") -> Iterator[Key]:
    """Every leaf key of ``cls`` in declaration order, dotted from ``prefix``."""
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        if is_section(hints[f.name]):
            yield from keys(hints[f.name], prefix + f.name + ".")
        else:
            yield Key(prefix + f.name, f, hints[f.name])


def top_level_keys(kind: str | None = None) -> list[Key]:
    """The keys outside every section (output_dir, seed; ``kind`` too when ``kind`` is None)."""
    hints = field_types(RunConfig)
    return [
        Key(f.name, f, hints[f.name])
        for f in dataclasses.fields(RunConfig)
        if not is_section(hints[f.name]) and (kind is None or f.name not in _SET_BY_COMMAND)
    ]


def section_keys(section: str) -> list[Key]:
    return list(keys(field_types(RunConfig)[section], section + "."))


def kind_default(key: Key | str, kind: str) -> Any:
    """The default of ``key`` under ``rlhfkit train kind`` (the field's, unless the kind sets its own)."""
    name = key if isinstance(key, str) else key.name
    for table in (KIND_FORCED, KIND_DEFAULTS):
        if name in table.get(kind, {}):
            return table[kind][name]
    if isinstance(key, str):
        key = next(k for k in keys() if k.name == name)
    return key.default


def required_keys(kind: str) -> list[str]:
    """What a run of ``kind`` must be given (:func:`rlhfkit.config.checks.validate` refuses it without)."""
    needed = ["output_dir", "model.name_or_path", "data.train_file"]
    if kind in ONLINE_KINDS:
        needed.append("online.reward_model or online.reward_functions")
    return needed


def config_help(cls: type = RunConfig, prefix: str = "", kind: str | None = None) -> str:
    """One entry per key, ``dotted.key (type, default: value)`` and its help text, for ``--help``: the keys
    ``kind`` reads with its defaults, or every key with the fields' defaults when ``kind`` is None."""
    if kind is not None:
        lines = [_help_entry(k, kind_default(k, kind)) for k in top_level_keys(kind)]
        for name, help in sections(kind):
            lines.append(f"{name}:  {help}")
            lines += [_help_entry(k, kind_default(k, kind)) for k in section_keys(name)]
        return "\n".join(lines)
    lines = []
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if is_section(hints[f.name]):
            lines.append(f"{key}:  {f.metadata['help']}")
            lines.append(config_help(hints[f.name], key + "."))
            continue
        entry = Key(key, f, hints[f.name])
        lines.append(_help_entry(entry, entry.default))
    return "\n".join(lines)


def _help_entry(key: Key, default: Any) -> str:
    return f"  {key.name} ({type_name(key.type)}, default: {_show(default)})\n      {key.help}"


def init_yaml(kind: str) -> str:
    """A commented YAML file of every key ``kind`` reads, at ``kind``'s defaults (``rlhfkit config init``):
    fill in the required keys and it loads as it is."""
    import yaml

    def entry(key: Key, indent: str) -> list[str]:
        leaf = key.name.rsplit(".", 1)[-1]
        value = yaml.safe_dump(
            {leaf: kind_default(key, kind)}, default_flow_style=True, width=10**6, sort_keys=False
        ).strip()[1:-1]  # one line, in flow style: "name: value"
        comment = textwrap.wrap(key.help, 100 - len(indent) - 2)
        return [f"{indent}# {line}" for line in comment] + [f"{indent}{value}"]

    lines = [
        f"# rlhfkit train {kind}: every key it reads, at its defaults (written by `rlhfkit config init {kind}`).",
        f"# Required: {', '.join(required_keys(kind))}.",
        f"# Check it without training: rlhfkit config show {kind} --config FILE [dotted.key=value ...]",
        "",
    ]
    for key in top_level_keys(kind):
        lines += entry(key, "")
    for name, help in sections(kind):
        lines += ["", f"# {help}", f"{name}:"]
        for key in section_keys(name):
            lines += entry(key, "  ")
    return "\n".join(lines) + "\n"


def type_name(tp: Any) -> str:
    """A field's type as the help and the reference write it: ``int``, ``k1|k2|k3``, ``float or none``."""
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in inner) + (" or none" if len(inner) < len(args) else "")
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
