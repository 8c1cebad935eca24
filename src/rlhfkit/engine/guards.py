"""Numerical guards: a run whose loss, gradient norm, rewards or values stop being finite stops loudly.

A trainer builds one :class:`FiniteGuard` and calls :meth:`FiniteGuard.check` once per step with the step's
numbers (Python floats, or tensors that are checked where they are). The check costs at most one host
synchronisation per step: each quantity's "any non-finite?" is reduced on its device, the flags are packed
into one small tensor, summed over processes in one all-reduce (several processes) and read back once.
Every process therefore takes the same decision at the same step. The same all-reduce carries the
"a signal asked to stop" flag of :mod:`rlhfkit.engine.signals`, so a stop is also agreed by every process.

A non-finite quantity either stops the run (:class:`rlhfkit.errors.NonFiniteError`, naming the step, the
quantity and the newest checkpoint, which is left as it is) or, with ``train.skip_nonfinite_steps: N``,
skips the step (no optimizer step) up to N times in the whole run; the count is logged as
``guard/skipped_steps`` and checkpointed. Checkpoints and ``final/`` are never written from non-finite
weights (:func:`rlhfkit.engine.finite.check_finite_weights`, called by the checkpoint and model-saving code).
"""

from __future__ import annotations

import math
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlhfkit.engine import signals
from rlhfkit.errors import NonFiniteError


class FiniteGuard:
    """Checks a step's numbers; see the module docstring.

    Args:
        accelerator: the run's accelerator (its device and process count).
        skip_budget: ``train.skip_nonfinite_steps``: how many non-finite steps may be skipped in the run.
        checkpoints_dir: the run's checkpoints folder, named in the stop message with its newest checkpoint.
        unit: what a step is called in messages ("step", or "rollout" for the online trainers).
    Attributes:
        skipped: steps skipped so far (restored from a checkpoint with :meth:`load_state_dict`).
        stop_signal: set by :meth:`check` when a signal asked any process to stop (its number).
    """

    def __init__(
        self,
        accelerator,
        skip_budget: int = 0,
        checkpoints_dir: str | Path | None = None,
        unit: str = "step",
    ):
        self.accelerator = accelerator
        self.skip_budget = int(skip_budget or 0)
        self.checkpoints_dir = checkpoints_dir
        self.unit = unit
        self.skipped = 0
        self.stop_signal: int | None = None

    def check(
        self, step: int, quantities: Mapping[str, torch.Tensor | float | None], *, can_skip: bool = True
    ) -> bool:
        """Whether step ``step`` must be skipped (some quantity is not finite and the budget allows it).

        Args:
            quantities: name -> a number or a tensor (None: not checked); names are those a user reads in
                the message ("loss", "gradient norm", "reward", ...).
            can_skip: False where the step's effect cannot be undone any more (the weights already moved):
                a non-finite quantity then always stops the run.
        Raises:
            NonFiniteError: a non-finite quantity and no skip left (or ``can_skip`` False).
        """
        device = self.accelerator.device
        names = [name for name, value in quantities.items() if value is not None]
        flags = [_nonfinite_flag(quantities[name], device) for name in names]
        mine = signals.requested()
        flags.append(torch.tensor(float(mine == signal.SIGINT), dtype=torch.float64, device=device))
        flags.append(torch.tensor(float(mine == signal.SIGTERM), dtype=torch.float64, device=device))
        packed = torch.stack(flags)
        if self.accelerator.num_processes > 1:
            from rlhfkit.engine.accel import all_sum

            packed = all_sum(self.accelerator, packed)
        values = packed.tolist()  # the one host synchronisation
        *bad_flags, sigint, sigterm = values
        if sigint > 0 or sigterm > 0:
            self.stop_signal = int(signal.SIGINT if sigint > 0 else signal.SIGTERM)
        bad = [name for name, flag in zip(names, bad_flags, strict=True) if flag > 0]
        if not bad:
            return False
        if can_skip and self.skipped < self.skip_budget:
            self.skipped += 1
            if self.accelerator.is_main_process:
                print(
                    f"rlhfkit: warning: {self.unit} {step}: non-finite {', '.join(bad)}; skipped "
                    f"(train.skip_nonfinite_steps: {self.skipped} of {self.skip_budget} used)",
                    file=sys.stderr,
                    flush=True,
                )
            return True
        raise NonFiniteError(self.message(step, bad, can_skip))

    def check_agreed(self, step: int, numbers: Mapping[str, float | None]) -> None:
        """Stop on a non-finite number among ``numbers``, which every process already holds alike (e.g. the
        step's all-reduced losses and gradient norms): no synchronisation at all. Used after the weights
        moved, so it never skips.

        Raises:
            NonFiniteError: naming the step and the numbers.
        """
        bad = [name for name, value in numbers.items() if value is not None and not math.isfinite(value)]
        if bad:
            raise NonFiniteError(self.message(step, bad, can_skip=False))

    def message(self, step: int, bad: list[str], can_skip: bool = True) -> str:
        newest = None
        if self.checkpoints_dir is not None:
            from rlhfkit.engine.checkpoint import latest_checkpoint

            newest = latest_checkpoint(self.checkpoints_dir)
        kept = (
            f"the newest checkpoint, {newest}, is left as it is (--resume continues from it)"
            if newest is not None
            else "no checkpoint was written yet"
        )
        if bad == ["reward-model score"]:
            advice = "the reward model (online.reward_model) scores responses as NaN or infinite: check its weights"
        elif not can_skip:
            advice = "lower train.learning_rate or check the data"
        elif self.skip_budget:
            advice = f"all {self.skip_budget} skips of train.skip_nonfinite_steps are used"
        else:
            advice = (
                "lower train.learning_rate or check the data, or set train.skip_nonfinite_steps=N to skip "
                "up to N such steps"
            )
        return (
            f"{self.unit} {step}: non-finite {', '.join(bad)}; the run stopped and wrote nothing from it "
            f"(no checkpoint, no final/); {kept}; {advice}"
        )

    def metrics(self) -> dict[str, int]:
        """``guard/skipped_steps`` when skipping is allowed (nothing otherwise)."""
        return {"guard/skipped_steps": self.skipped} if self.skip_budget else {}

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        self.skipped = int((state or {}).get("skipped", 0))

    def stop_if_asked(self, step: int) -> None:
        """After step ``step`` is checkpointed: raise the signal's :class:`rlhfkit.errors.RunStopped` if a
        stop was agreed at this step's check."""
        if self.stop_signal is not None:
            raise signals.stopped(self.stop_signal, step)


def _nonfinite_flag(value: torch.Tensor | float, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if not value.is_floating_point():
            return torch.zeros((), dtype=torch.float64, device=device)
        return (~torch.isfinite(value)).any().to(device=device, dtype=torch.float64)
    return torch.tensor(0.0 if math.isfinite(float(value)) else 1.0, dtype=torch.float64, device=device)
