"""The offline training loop shared by SFT and reward-model training.

Both are "minimise a loss over a fixed dataset": what differs is how a batch is collated, how its loss is
computed and what evaluation reports. This module owns the rest, once:

- the data order: a stateless function of (seed, step), so resuming needs only the step
  (no sampler state to save: docs/known-bugs.md, 11; huggingface/accelerate#2016);
- micro-batching and gradient accumulation, with the loss normalised by the *whole* batch
  (``normalizer``), so micro-batch and process counts do not change the gradient
  (docs/known-bugs.md, 10; docs/design.md, "The algorithm core");
- gradient clipping, the optimizer and schedule, metrics, evaluation, checkpoints, resume, ``final/``.

A trainer passes a :class:`Objective`. Launch: one process with ``rlhfkit train ...``; several with
``torchrun --nproc_per_node N -m rlhfkit.cli train ...`` (:mod:`rlhfkit.engine.accel`). Process r of W takes
the examples at positions r, r + W, r + 2W, ... of every batch (the batch itself does not depend on W), and
the normaliser counts the whole batch, so W processes compute the gradient that one process computes on the
same global batch, up to float rounding; a checkpoint resumes under another W from the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit.config import RunConfig
from rlhfkit.config.checks import check_process_count
from rlhfkit.engine import sharded
from rlhfkit.engine.accel import all_sum, dp_scale
from rlhfkit.engine.checkpoint import load_checkpoint, save_checkpoint
from rlhfkit.engine.folder import RunDir, logged_at
from rlhfkit.engine.guards import FiniteGuard
from rlhfkit.engine.optim import optimizer_and_scheduler
from rlhfkit.models.precision import carry_precision
from rlhfkit.trainers.common import batch_indices, micro_batches


@dataclass
class Objective:
    """What a trainer supplies to :func:`train_offline`.

    Attributes:
        collate: a list of examples -> a dict of tensors (one micro-batch).
        loss: (model, micro-batch, normalizer) -> (scalar loss, stats). The loss is already divided by
            ``normalizer`` (the whole batch's unit count, via ``rlhfkit.algos.aggregate_loss``), so the
            loop only sums micro-batches and processes; stats are normalised the same way.
        normalizer: a list of examples (the whole batch, all processes) -> the number of units the loss
            averages over (tokens for SFT, pairs for a reward model).
        evaluate: (model, step) -> metrics to log (prefixed ``eval/`` by the caller), or None.
        should_stop: (step) -> True to end training after this step (early stopping), or None; asked after
            every evaluation. The step is logged and checkpointed before the loop ends.
    """

    collate: Callable[[list[Any]], dict[str, torch.Tensor]]
    loss: Callable[[torch.nn.Module, dict[str, torch.Tensor], float], tuple[torch.Tensor, dict[str, float]]]
    normalizer: Callable[[list[Any]], float]
    evaluate: Callable[[torch.nn.Module, int], dict[str, float]] | None = None
    should_stop: Callable[[int], bool] | None = None


def train_offline(
    cfg: RunConfig,
    run: RunDir,
    model: torch.nn.Module,
    examples: Sequence[Any],
    objective: Objective,
    accelerator,
    *,
    on_save: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Train ``model`` on ``examples`` for ``cfg.train.max_steps`` optimizer steps.

    Args:
        cfg: the run's :class:`rlhfkit.config.RunConfig` (``train`` and ``data.shuffle`` are read).
        run: the opened run folder (metrics, checkpoints, resume point).
        model: the model, already on ``accelerator.device``.
        examples: tokenised training examples (any objects ``objective.collate`` understands).
        objective: see :class:`Objective`.
        accelerator: an ``accelerate.Accelerator``.
        on_save: called after every checkpoint (e.g. to keep the best model).
    Returns:
        ``{"model": the trained model (a sharded one gathered whole on every process: use it, not
        ``model``, afterwards), "step": the last step trained (below max_steps after an early stop), "loss", "eval": last
        evaluation metrics, "wall_seconds", "examples_per_second"}``.
    """
    train = cfg.train
    world, rank = accelerator.num_processes, accelerator.process_index
    check_process_count(cfg, world)
    local_batch = train.batch_size // world
    micro = train.micro_batch_size or local_batch
    sharding = sharded.sharding_mode(cfg)
    if sharding != "none":  # FSDP2: each process holds a shard (rlhfkit.engine.sharded)
        model = sharded.shard_model(model, sharding)
    optimizer, scheduler = optimizer_and_scheduler(model, train)
    if sharding == "none":
        model, optimizer = accelerator.prepare(model, optimizer)

    state: dict[str, Any] = {"step": 0}
    if run.resume_checkpoint is not None and sharding != "none":
        state = sharded.load_checkpoint(run.resume_checkpoint, model, optimizer, scheduler)
    elif run.resume_checkpoint is not None:
        state = load_checkpoint(
            run.resume_checkpoint,
            {"model": accelerator.unwrap_model(model)},
            {"model": optimizer},
            {"model": scheduler},
        )
    last_eval: dict[str, float] = dict(state.get("last_eval", {}))
    guard = FiniteGuard(accelerator, train.skip_nonfinite_steps, run.checkpoints_dir)
    guard.load_state_dict(state.get("guard"))
    start_time, seen = time.perf_counter(), 0
    loss_value = logged_at(run.path, state["step"]).get("loss")  # reported when nothing is left to train
    loss_value = float("nan") if loss_value is None else loss_value
    last_step = state["step"]
    model.train()
    for step in run.progress(
        range(state["step"] + 1, train.max_steps + 1), total=train.max_steps, desc="train"
    ):
        step_start = time.perf_counter()
        indices = batch_indices(len(examples), train.batch_size, step, cfg.seed, cfg.data.shuffle)
        batch = [examples[i] for i in indices]
        norm = max(float(objective.normalizer(batch)), 1.0)
        mine = batch[rank::world]
        chunks = micro_batches(mine, micro)
        totals: dict[str, float] = {}
        loss_sum = 0.0
        for k, chunk in enumerate(chunks):
            inputs = {name: v.to(accelerator.device) for name, v in objective.collate(list(chunk)).items()}
            # No gradient all-reduce until the last micro-batch of the step.
            last = k == len(chunks) - 1 or world == 1 or sharding != "none"
            sync = nullcontext() if last else accelerator.no_sync(model)
            with sync:
                loss, stats = objective.loss(model, inputs, norm)
                accelerator.backward(loss * dp_scale(accelerator))
            loss_sum += float(loss.detach())
            for name, value in stats.items():
                totals[name] = totals.get(name, 0.0) + float(value)
        grad_norm = None
        if train.max_grad_norm is not None and sharding != "none":
            grad_norm = sharded.clip_grad_norm(model, train.max_grad_norm)
        elif train.max_grad_norm is not None:
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), train.max_grad_norm))
        lr = optimizer.param_groups[0]["lr"]
        # A non-finite loss or gradient norm stops the run here (or skips the step), on every process.
        if not guard.check(step, {"loss": loss_sum, "gradient norm": grad_norm}):
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        seen += len(batch)
        # The step's loss and statistics, summed over processes in one all-reduce (each process's parts are
        # already divided by the whole batch's normaliser). Every process sees the same numbers.
        names = sorted(totals)  # the same order on every process
        summed = all_sum(accelerator, [loss_sum, *(totals[n] for n in names)]).tolist()
        loss_value = summed[0]

        metrics: dict[str, Any] = {
            "loss": loss_value,
            "learning_rate": lr,
            "time/step_seconds": time.perf_counter() - step_start,
        }
        metrics.update(zip(names, summed[1:], strict=True))
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        metrics.update(guard.metrics())
        stop = False
        if objective.evaluate is not None and (step % train.eval_steps == 0 or step == train.max_steps):
            model.eval()
            with torch.no_grad():
                last_eval = objective.evaluate(accelerator.unwrap_model(model), step)
            model.train()
            metrics.update({f"eval/{k}": v for k, v in last_eval.items()})
            stop = objective.should_stop is not None and bool(objective.should_stop(step))
        if step % train.log_steps == 0 or step == train.max_steps or "eval/loss" in metrics:
            run.metrics.log(step, metrics)
        save = step % train.save_steps == 0 or step == train.max_steps or stop or guard.stop_signal
        if save and sharding != "none":  # every process writes its shards
            sharded.save_checkpoint(
                run.checkpoints_dir,
                step,
                model,
                optimizer,
                scheduler,
                {"last_eval": last_eval, "guard": guard.state_dict()},
                main_process=accelerator.is_main_process,
                keep_last=train.keep_last_checkpoints,
            )
            if on_save is not None:
                on_save(step)
        elif save:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                save_checkpoint(
                    run.checkpoints_dir,
                    step,
                    {"model": accelerator.unwrap_model(model)},
                    {"model": optimizer},
                    {"model": scheduler},
                    {"last_eval": last_eval, "guard": guard.state_dict()},
                    keep_last=train.keep_last_checkpoints,
                )
            if on_save is not None:
                on_save(step)
        guard.stop_if_asked(step)  # SIGTERM / SIGINT: this step is checkpointed; exit 128 + signal
        last_step = step
        if stop:
            break
    elapsed = time.perf_counter() - start_time
    return {
        # gathered whole with the model's precision set-up: evaluation and normalisation compute as in training
        "model": carry_precision(model, sharded.unshard(model)) if sharding != "none" else model,
        "step": last_step,
        "loss": loss_value,
        "eval": last_eval,
        "wall_seconds": elapsed,
        "examples_per_second": seen / elapsed if elapsed > 0 else None,
    }
