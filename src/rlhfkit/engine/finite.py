"""Finiteness checks: which tensors hold a NaN or an infinity, a tensor with its padding zeroed for such a check,
and the refusal to save a model whose weights are not finite (the checkpoint and model-saving code call
:func:`check_finite_weights`). The per-step guard built on them is :mod:`rlhfkit.engine.guards`."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from rlhfkit.errors import NonFiniteError


def masked(values: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """``values`` with 0 where ``mask`` is False (padding may hold anything), without a host sync."""
    if values is None:
        return None
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def nonfinite_tensors(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors that hold a NaN or an infinity (one host sync)."""
    names = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not names:
        return []
    flags = torch.stack([(~torch.isfinite(tensors[n].detach())).any().cpu() for n in names])
    return [n for n, flag in zip(names, flags.tolist(), strict=True) if flag]


def check_finite_weights(model: torch.nn.Module, where: str) -> None:
    """Refuse to save ``model`` when a weight (or a float in its config, e.g. a reward model's normalisation)
    is not finite: :class:`rlhfkit.errors.NonFiniteError` naming the first few."""
    bad = nonfinite_tensors(dict(model.state_dict()))
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in vars(config).items():
            if isinstance(value, float) and not math.isfinite(value):
                bad.append(f"config.{key}")
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NonFiniteError(
            f"{where}: not written, because the model's {shown} hold non-finite values (the run "
            "diverged); lower train.learning_rate or check the data"
        )
