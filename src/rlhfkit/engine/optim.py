"""Optimizers and learning-rate schedules built from a :class:`rlhfkit.config.TrainConfig`.

AdamW with decoupled weight decay (Loshchilov & Hutter 2019) on every trainable parameter, except that
biases and normalisation weights get no weight decay (the usual GPT-2 / transformers convention). The
schedule is a linear warm-up followed by constant, linear or cosine decay to 0 at ``max_steps``; it is a
``LambdaLR``, so its state is two integers and round-trips through the checkpoint engine's JSON.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def build_optimizer(
    params: Iterable[tuple[str, torch.nn.Parameter]],
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over ``named_parameters()`` that require grad; no decay on biases and 1-D (norm) weights."""
    decay, no_decay = [], []
    for name, p in params:
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    # The fused kernel (one pass over each tensor; ~3x faster than the per-tensor loop on CPU) where torch
    # has it for these parameters, else the per-tensor loop. Both compute each element from that element
    # alone, so the result does not depend on how parameters are grouped or sharded and resumed runs stay
    # bit-identical; the grouped `foreach` kernels are not used. Sharded (DTensor) parameters take the loop.
    if not any(type(p.data).__name__ == "DTensor" for p in decay + no_decay):
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        except (RuntimeError, ValueError, TypeError):  # a device or dtype without the fused kernel
            pass
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


def lr_lambda(schedule: str, warmup_steps: int, max_steps: int):
    """The multiplier of the peak learning rate at a given step (0-based count of optimizer steps taken)."""

    def f(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"unknown lr schedule {schedule!r}")

    return f


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, max_steps: int):
    """A ``LambdaLR`` with :func:`lr_lambda`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(schedule, warmup_steps, max_steps))


def optimizer_and_scheduler(model: torch.nn.Module, train_cfg, lr: float | None = None):
    """AdamW + schedule for ``model`` from a TrainConfig (``lr`` overrides ``train_cfg.learning_rate``)."""
    opt = build_optimizer(
        model.named_parameters(),
        lr=train_cfg.learning_rate if lr is None else lr,
        weight_decay=train_cfg.weight_decay,
        betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
        eps=train_cfg.adam_eps,
    )
    sched = build_scheduler(opt, train_cfg.lr_schedule, train_cfg.warmup_steps, train_cfg.max_steps)
    return opt, sched
