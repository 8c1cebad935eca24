"""How a configuration field is declared (:func:`option`: default, help text, bounds) and read back: the
resolved types of a section's fields (:func:`field_types`), whether a type is a section, a ``Literal``'s
choices."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any, Literal


def option(
    default: Any,
    help: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> Any:
    """A dataclass field with its help text and optional numeric bounds (checked by
    :func:`rlhfkit.config.load_config`).

    A list default, or a section's dataclass, becomes a ``default_factory`` so instances never share it.
    """
    metadata = {"help": help, "gt": gt, "ge": ge, "lt": lt, "le": le}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    if isinstance(default, type) and dataclasses.is_dataclass(default):  # a section
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


_HINTS: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """The resolved type of each field of the section dataclass ``cls`` (cached)."""
    if cls not in _HINTS:
        import typing

        _HINTS[cls] = typing.get_type_hints(cls, localns=_algos_choices())
    return _HINTS[cls]


def _algos_choices() -> dict[str, Any]:
    """The choice types of the fields whose values name an ``rlhfkit.algos`` registry entry, declared there
    once. Imported when a configuration is first read or described, not with this module: ``algos`` imports
    torch, which ``rlhfkit --help``, argument errors and ``rlhfkit report`` need not wait for."""
    from rlhfkit.algos import (
        AdvantageEstimator,
        DistillLoss,
        ImportanceSamplingLevel,
        KLEstimator,
        KLLossEstimator,
        LossAggregation,
    )

    return {
        "AdvantageEstimator": AdvantageEstimator,
        "DistillLoss": DistillLoss,
        "ImportanceSamplingLevel": ImportanceSamplingLevel,
        "KLEstimator": KLEstimator,
        "KLLossEstimator": KLLossEstimator,
        "LossAggregation": LossAggregation,
    }


def is_section(tp: Any) -> bool:
    """Whether a field's type is a section (a dataclass of fields) rather than a value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def literal_choices(tp: Any) -> tuple | None:
    """The values of a ``Literal[...]`` type (also inside ``Optional``), else None."""
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return args
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if typing.get_origin(arg) is Literal:
                return typing.get_args(arg)
    return None


def is_list(tp: Any) -> bool:
    """Whether a field's type is a list (also inside ``Optional``): ``list[str]``, ``list[float] | None``."""
    import types
    import typing

    if typing.get_origin(tp) is list:
        return True
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and any(
        typing.get_origin(arg) is list for arg in typing.get_args(tp)
    )


def get_dotted(obj: Any, dotted: str) -> Any:
    """The value at ``dotted`` (e.g. ``"online.group_size"``) of a configuration."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_bounds(section: Any, prefix: str, fail, cls: type | None = None) -> None:
    """``fail(key, message)`` for the first number of ``section`` outside the bounds its :func:`option`
    declares, or not finite; ``section`` is a section dataclass, or its plain dict with ``cls``."""
    cls = cls or type(section)
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        value = section.get(f.name) if isinstance(section, dict) else getattr(section, f.name)
        if is_section(hints[f.name]):
            check_bounds(value, prefix + f.name + ".", fail, hints[f.name])
            continue
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            fail(prefix + f.name, f"must be a finite number, got {value}")
        for bound, holds in (
            ("gt", value.__gt__),
            ("ge", value.__ge__),
            ("lt", value.__lt__),
            ("le", value.__le__),
        ):
            limit = f.metadata.get(bound)
            if limit is not None and not holds(limit):
                symbol = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}[bound]
                fail(prefix + f.name, f"must be {symbol} {limit}, got {value}")
