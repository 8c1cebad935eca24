"""The best model of a scalar-model run (reward model, PRM) by held-out figures, kept on disk so that it
survives a resume, and the early stopping that watches it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rlhfkit.config import RunConfig
from rlhfkit.engine import sharded
from rlhfkit.engine.atomic import atomic_write, atomic_write_text


class BestKeeper:
    """Keeps the weights of the best evaluation in ``<run>/best/`` (``model.safetensors``, then ``best.json``
    written last as the marker), so that they survive a resume.

    Best = higher held-out ``accuracy``; equal accuracy: lower ``loss``. Only trained models compete: the
    step-0 evaluation (the untrained model) is kept in ``untrained`` for comparison, never as the best, so
    that ``final/`` is never silently the model before training. A resumed run recomputes the
    same evaluations as the interrupted one (bit-identical resume), so a ``best.json`` from after the
    resume point is kept: the same evaluation cannot beat it.
    """

    def __init__(self, folder: Path, keep_existing: bool, main_process: bool = True):
        self.folder, self.main_process = Path(folder), main_process
        self.best: dict[str, Any] | None = None
        self.untrained: dict[str, float] | None = None
        marker = self.folder / "best.json"
        if keep_existing and marker.is_file():
            self.best = json.loads(marker.read_text())
        elif main_process and marker.is_file():
            marker.unlink()

    @staticmethod
    def better(new: dict[str, float], old: dict[str, float] | None) -> bool:
        if old is None:
            return True
        return (new["accuracy"], -new["loss"]) > (old["accuracy"], -old["loss"])

    def update(self, model: torch.nn.Module, step: int, metrics: dict[str, float], extra: Any = None) -> bool:
        """Record ``metrics`` of ``step``; save the model (and ``extra``, e.g. calibration bins) when they are
        the best so far (never for step 0, the untrained model)."""
        if step == 0:
            self.untrained = dict(metrics)
            return False
        if not self.better(metrics, None if self.best is None else self.best["eval"]):
            return False
        self.best = {"step": step, "eval": metrics, "extra": extra}
        # a sharded model's whole weights: gathered by every process (a collective), written by the main one
        whole = sharded.full_state_dict(model) if sharded.is_sharded(model) else None
        if self.main_process:
            from safetensors.torch import save_file, save_model

            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / "best.json").unlink(missing_ok=True)
            if whole is None:
                atomic_write(self.folder / "model.safetensors", lambda tmp: save_model(model, str(tmp)))
            else:
                cpu = {k: v.detach().cpu().contiguous() for k, v in whole.items()}
                atomic_write(self.folder / "model.safetensors", lambda tmp: save_file(cpu, str(tmp)))
            atomic_write_text(self.folder / "best.json", json.dumps(self.best, indent=2, allow_nan=True))
        return True

    def restore(self, model: torch.nn.Module) -> None:
        """Load the best weights into ``model``."""
        from safetensors.torch import load_model

        load_model(model, str(self.folder / "model.safetensors"), device=str(next(model.parameters()).device))

    @property
    def step(self) -> int | None:
        return None if self.best is None else int(self.best["step"])


def keep_best_warnings(keeper: BestKeeper, eval_steps: int, last_step: int) -> list[str]:
    """What a user should know about the model ``reward.keep_best`` ships: that the best came at the first
    trained evaluation (later training only made it worse), or that the untrained model scored better."""
    warnings, best = [], keeper.best
    first = min(eval_steps, last_step)
    if best["step"] == first and last_step > first:
        warnings.append(
            f"reward.keep_best: the best held-out accuracy came at the first evaluation (step {first}) and "
            f"none of the later ones up to step {last_step} beat it, so final/ is step {first}'s model; "
            "a lower train.learning_rate, more data or more frequent train.eval_steps may help"
        )
    if keeper.untrained is not None and BestKeeper.better(keeper.untrained, best["eval"]):
        warnings.append(
            f"reward.keep_best: the untrained model's held-out accuracy ({keeper.untrained['accuracy']:.4g}) "
            f"is above the best trained one's ({best['eval']['accuracy']:.4g}, step {best['step']}); "
            "final/ is the trained model, but training did not help"
        )
    return warnings


def patience_stop(cfg: RunConfig, keeper: BestKeeper):
    """``should_stop(step)``: True once ``reward.early_stopping_patience`` evaluations in a row have not beaten
    the best (counted from the best evaluation's step, so it needs no state of its own across a resume)."""
    patience, every = cfg.reward.early_stopping_patience, cfg.train.eval_steps

    def should_stop(step: int) -> bool:
        return patience is not None and keeper.step is not None and step - keeper.step >= patience * every

    return should_stop
