"""Reading a configuration (defaults < per-kind defaults < YAML file < ``dotted.key=value`` overrides, through
omegaconf) and writing it back (``config.yaml``)."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

from rlhfkit.config.checks import key_failure, validate
from rlhfkit.config.describe import keys
from rlhfkit.config.fields import check_bounds, field_types, is_list, is_section, literal_choices
from rlhfkit.config.legacy import apply_old_keys, pop_old_keys
from rlhfkit.config.run import KIND_DEFAULTS, KIND_FORCED, KIND_SECTIONS, KINDS, RunConfig
from rlhfkit.config.trl_names import trl_defaults_warning, trl_hint
from rlhfkit.errors import ConfigError


def load_config(
    path: str | Path | None,
    overrides: list[str] | tuple[str, ...] = (),
    kind: str = "sft",
    layers: tuple[tuple[str, dict], ...] = (),
) -> RunConfig:
    """Build a :class:`RunConfig`: dataclass defaults < per-kind defaults < YAML file < ``layers`` (``(source,
    nested dict)`` pairs, from Python: :func:`nest_keys`) < ``dotted.key=value``.

    Raises:
        ConfigError: unreadable or invalid YAML, an unknown key, a value of the wrong type or out of range,
            a missing required value, or contradicting settings; the message names the key and where it was
            set (the file, or the command-line override).
    """
    from omegaconf import OmegaConf

    if kind not in KINDS:
        raise ConfigError(f"unknown kind '{kind}'; choose one of {', '.join(KINDS)}")
    stack: list[tuple[str, dict]] = [
        (
            f"the defaults of `train {kind}`",
            _nest({**KIND_DEFAULTS.get(kind, {}), **KIND_FORCED.get(kind, {}), "kind": kind}),
        )
    ]
    if path is not None:
        stack.append((str(path), _read_yaml(path)))
    stack += [(source, values) for source, values in layers]
    for item in overrides:
        stack.append((f"command-line override '{item}'", _parse_override(item)))

    cfg = OmegaConf.structured(_omegaconf_schema(RunConfig))
    set_by: dict[str, str] = {}  # dotted key -> where its value was last set
    old_keys = []  # keys of earlier versions (rlhfkit.config.legacy)
    unknown: list[tuple[str, str, str]] = []  # (source, key, hint): every layer's, reported together
    for source, values in stack:
        old_keys += pop_old_keys(values, source)
        seen, wrong = _check_keys(values, RunConfig, "", source, kind)
        set_by.update(dict.fromkeys(seen, source))
        unknown += [(source, key, hint) for key, hint in wrong]
    if unknown:
        trl_defaults_warning(kind, [key for _, key, _ in unknown], set_by)
        raise unknown_keys_error(unknown)
    for source, values in stack:
        try:
            cfg = OmegaConf.merge(cfg, values)
        except Exception as e:  # omegaconf's ValidationError / ConfigKeyError and friends
            raise _translate(e, source) from None
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # an interpolation ${...} that does not resolve
        raise _translate(e, "the configuration") from None
    check_bounds(plain, "", key_failure(set_by), RunConfig)  # before a section checks itself (RefreshConfig)
    run: RunConfig = _from_plain(RunConfig, plain)
    apply_old_keys(run, old_keys, set_by)
    validate(run, kind, set_by)
    return run


def nest_keys(values: Any, source: str) -> dict:
    """A configuration given from Python as one nested dict, with sections as dicts and/or dotted keys
    (``{"model": {"name_or_path": "m"}, "train.max_steps": 10}``), as the nested dict a YAML file gives;
    ``pathlib.Path`` values become strings and tuples lists. A key set twice (``train.max_steps`` and
    ``train: {max_steps: ...}``) or a key that is not a string is a ConfigError naming ``source``."""
    if not isinstance(values, dict):
        raise ConfigError(
            f"{source}: expected a dict of keys (like 'train' and 'model'), got {type(values).__name__}"
        )
    out: dict = {}

    def put(node: dict, prefix: str, dotted: str, value: Any) -> None:
        full = prefix + dotted
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: '{full}' goes inside a key that holds a value, not a section")
        if isinstance(value, dict):
            inner_node = node.setdefault(leaf, {})
            if not isinstance(inner_node, dict):
                raise ConfigError(f"{source}: '{full}' is set twice (as a dotted key and inside its section)")
            for key, inner in value.items():
                if not isinstance(key, str):
                    raise ConfigError(f"{source}: key {key!r} under '{full}' is not a string")
                put(inner_node, full + ".", key, inner)
            return
        if leaf in node:
            raise ConfigError(f"{source}: '{full}' is set twice (as a dotted key and inside its section)")
        node[leaf] = _plain(value)

    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source}: key {key!r} is not a string")
        put(out, "", key, value)
    return out


def _plain(value: Any) -> Any:
    """``value`` with paths as strings and tuples as lists, as a YAML file would hold it."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def config_from(kind: str, output_dir, overrides: dict[str, Any]) -> RunConfig:
    """A validated RunConfig of ``kind`` writing to ``output_dir``, from a dict of dotted keys: the same path
    as ``rlhfkit train KIND output_dir=... key=value ...`` (how the quickstart and the experiments build
    each stage's configuration)."""
    return load_config(None, [f"output_dir={output_dir}", *(f"{k}={v}" for k, v in overrides.items())], kind)


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The configuration as plain nested dicts, lists and scalars (what ``config.yaml`` holds)."""
    return dataclasses.asdict(cfg)


RUN_INFO_PREFIX = "# run: "


def save_config(cfg: RunConfig, path: str | Path, run_info: dict[str, Any] | None = None) -> None:
    """Write ``cfg`` as YAML that :func:`load_config` reads back to an equal :class:`RunConfig`.

    ``run_info`` (how the run was launched: processes, launcher, threads) goes into a comment line
    ``# run: {json}`` (:func:`read_run_info`), so that the file stays a loadable configuration.
    """
    import json

    import yaml

    path = Path(path)
    header = f"# rlhfkit resolved configuration; rerun with: rlhfkit train {cfg.kind} --config {path.name}\n"
    if run_info:
        header += RUN_INFO_PREFIX + json.dumps(run_info, sort_keys=True) + "\n"
    text = header + yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def read_run_info(path: str | Path) -> dict[str, Any] | None:
    """The run line of a ``config.yaml`` that :func:`save_config` wrote, or None."""
    import json

    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith(RUN_INFO_PREFIX):
            return json.loads(line[len(RUN_INFO_PREFIX) :])
    return None


def _read_yaml(path: str | Path) -> dict:
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        # omegaconf's YAML loader: reads 1e-5 as a number and refuses duplicate keys (PyYAML keeps the last).
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{where}: not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys (like `train:` and `model:`), got a list")
    return data


def _parse_override(item: str) -> dict:
    from omegaconf import OmegaConf

    key, sep, _ = item.partition("=")
    if not sep or not all(part.isidentifier() for part in key.split(".")):
        raise ConfigError(
            f"command-line override '{item}': expected dotted.key=value, e.g. train.learning_rate=1e-5"
        )
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except Exception as e:
        raise ConfigError(f"command-line override '{item}': {str(e).splitlines()[0]}") from None


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _check_keys(
    values: dict, cls: type, prefix: str, source: str, kind: str
) -> tuple[list[str], list[tuple[str, str]]]:
    """The dotted keys ``values`` sets, and its unknown keys as ``(key, hint)`` (the hint suggests the right
    key). A bare value where a list is expected (``online.reward_functions=rewards.py:fn``) becomes a
    one-element list here."""
    hints = field_types(cls)
    seen, unknown = [], []
    for name, value in values.items():
        key = prefix + str(name)
        if name not in hints:
            unknown.append((key, _unknown_key_hint(str(name), prefix, hints, kind)))
            continue
        if is_section(hints[name]):
            if value is None:  # `online:` with every key commented out
                values[name] = value = {}
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{source}: '{key}' is a section; expected a mapping of its keys, got {value!r}"
                )
            more, wrong = _check_keys(value, hints[name], key + ".", source, kind)
            seen += more
            unknown += wrong
        else:
            if isinstance(value, str | int | float) and not isinstance(value, bool) and is_list(hints[name]):
                values[name] = [value]
            seen.append(key)
    return seen, unknown


def unknown_keys_error(unknown: list[tuple[str, str, str]]) -> ConfigError:
    """One ConfigError for every unknown key of every layer ``(source, key, hint)``, so that a configuration
    written for another library (TRL's names) is answered in one run, not one key at a time."""
    if len(unknown) == 1:
        source, key, hint = unknown[0]
        return ConfigError(f"{source}: unknown key '{key}'{hint}")
    by_source: dict[str, list[str]] = {}
    for number, (source, key, hint) in enumerate(unknown, 1):
        by_source.setdefault(source, []).append(f"({number}) '{key}'{hint}")
    listed = [f"{source}: {'; '.join(items)}" for source, items in by_source.items()]
    return ConfigError(f"{len(unknown)} unknown keys, all listed here: " + "; ".join(listed))


def _unknown_key_hint(name: str, prefix: str, hints: dict[str, Any], kind: str) -> str:
    """What an unknown key ``prefix + name`` most likely means, in this order: a TRL name (its rlhfkit key,
    :mod:`rlhfkit.config.trl_names`), a key of that name in another section that ``kind`` reads (a bare
    ``learning_rate`` at the top level), a close spelling here, else the keys known here."""
    trl = trl_hint(name, kind)
    if trl is not None:
        key, note = trl
        if key is None:
            return f" (TRL's '{name}' has no rlhfkit key: {note})"
        if key != prefix + name:
            return f" (TRL's '{name}' is '{key}' in rlhfkit{': ' + note if note else ''})"
    read = KIND_SECTIONS[kind]
    elsewhere = [k.name for k in keys() if k.name.rsplit(".", 1)[-1] == name and k.name.split(".")[0] in read]
    if elsewhere:
        return f" (did you mean {' or '.join(repr(k) for k in elsewhere)}?)"
    close = difflib.get_close_matches(name, list(hints), n=1)
    if close:
        return f" (did you mean '{prefix}{close[0]}'?)"
    return f"; known keys here: {', '.join(hints)}"


def _translate(e: Exception, source: str) -> ConfigError:
    key = getattr(e, "full_key", None)
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    return ConfigError(f"{source}: {key}: {message}" if key else f"{source}: {message}")


_SCHEMAS: dict[type, type] = {}


def _omegaconf_schema(cls: type) -> type:
    """A copy of the dataclass ``cls`` (and of its sections) with ``Literal[...]`` fields typed ``str``, which
    every omegaconf version takes; :func:`rlhfkit.config.checks.validate` checks the choices afterwards."""
    import typing

    if cls in _SCHEMAS:
        return _SCHEMAS[cls]
    hints, fields = field_types(cls), []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if is_section(tp):
            section = _omegaconf_schema(tp)
            fields.append((f.name, section, field(default_factory=section)))
            continue
        choices = literal_choices(tp)
        if choices is not None:
            tp = str if typing.get_origin(tp) is Literal else str | None
        default = (
            field(default_factory=f.default_factory)
            if f.default is dataclasses.MISSING
            else field(default=f.default)
        )
        fields.append((f.name, tp, default))
    _SCHEMAS[cls] = dataclasses.make_dataclass(cls.__name__, fields)
    return _SCHEMAS[cls]


def _from_plain(cls: type, values: dict) -> Any:
    """``cls`` (a section dataclass) built from the plain nested dict omegaconf gives back."""
    hints = field_types(cls)
    return cls(
        **{
            name: _from_plain(hints[name], value) if is_section(hints[name]) else value
            for name, value in values.items()
        }
    )
