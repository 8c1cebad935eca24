"""Process reward model (``rlhfkit train prm``, :func:`train`): binary cross-entropy of each step's
correctness, read at the step's last token (Lightman et al. 2023, "Let's Verify Step by Step"), averaged over
the whole batch's steps; held-out step and solution accuracy. It shares the reward model's run (the
backbone with a scalar head, the offline loop, the best model and early stopping: :mod:`rlhfkit.trainers.scalar_run`).

Launch:
    rlhfkit train prm --config prm.yaml
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from rlhfkit.algos import aggregate_loss
from rlhfkit.config import RunConfig
from rlhfkit.data import PRMCollator
from rlhfkit.models import token_scores
from rlhfkit.trainers.best_model import BestKeeper, patience_stop
from rlhfkit.trainers.common import micro_batches
from rlhfkit.trainers.offline import Objective
from rlhfkit.trainers.scalar_run import (
    finish_scalar_run,
    fit_keeping_best,
    open_session,
    run_summary,
    scalar_model,
    scoring_batch_size,
    start_run,
)


def step_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The head's output at the last token of every step (a logit of P(step is correct)).

    Args:
        batch: a :class:`rlhfkit.data.PRMCollator` batch: ``input_ids``, ``attention_mask`` (B, L),
            ``step_positions`` (B, S).
    Returns:
        (B, S); meaningless where ``step_mask`` is False.
    """
    scores = token_scores(model, batch["input_ids"], batch["attention_mask"])  # (B, L)
    return scores.gather(1, batch["step_positions"])  # (B, S)


def step_loss(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, normalizer: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Binary cross-entropy per step, averaged over the whole batch's steps (Lightman et al. 2023, "Let's
    Verify Step by Step": a PRM predicts each step's correctness at the step's last token).

    Args:
        logits, labels, mask: (B, S) step logits, 1.0 for a correct step, True on real steps.
        normalizer: the number of steps in the whole batch.
    Returns:
        (scalar loss, stats already multiplied by this micro-batch's share of the steps).
    """
    bce = F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none")  # (B, S)
    loss = aggregate_loss(bce, mask, "token-mean", normalizer)
    right = ((logits > 0).float() == labels).float()  # (B, S)
    return loss, {"accuracy": float((right * mask).sum()) / normalizer}


def prm_metrics(logits: list[torch.Tensor], labels: list[torch.Tensor]) -> dict[str, float]:
    """Held-out figures of a PRM from per-solution step logits and labels (lists of (S_i,) tensors): mean
    step loss, step accuracy, and solution accuracy (a solution is judged correct when every step's
    P(correct) > 1/2; it is correct when every label is)."""
    flat_logits, flat_labels = torch.cat(logits).double(), torch.cat(labels).double()
    loss = F.binary_cross_entropy_with_logits(flat_logits, flat_labels)
    step_right = ((flat_logits > 0).double() == flat_labels).double()
    solutions = [
        bool((solution_logits > 0).all()) == bool(solution_labels.bool().all())
        for solution_logits, solution_labels in zip(logits, labels, strict=True)
    ]
    return {
        "loss": float(loss),
        "accuracy": float(step_right.mean()),
        "solution_accuracy": sum(solutions) / len(solutions),
        "correct_step_rate": float(flat_labels.mean()),
    }


@torch.no_grad()
def evaluate_prm(model, collate, examples: list[dict], batch_size: int, device) -> dict[str, float]:
    """:func:`prm_metrics` of ``model`` on tokenised process-supervision examples."""
    logits, labels = [], []
    for chunk in micro_batches(examples, batch_size):
        batch = {k: v.to(device) for k, v in collate(list(chunk)).items()}
        chunk_logits = step_logits(model, batch).float().cpu()  # (b, S)
        for i, example in enumerate(chunk):
            logits.append(chunk_logits[i, : len(example["labels"])])
            labels.append(torch.tensor([float(label) for label in example["labels"]]))
    return prm_metrics(logits, labels)


def prm_objective(
    cfg: RunConfig,
    collate,
    heldout: list[dict] | None,
    keeper: BestKeeper,
    device,
    counters: dict[str, float],
) -> Objective:
    """Loss, evaluation and early stopping of a process-reward-model run."""
    eval_batch = scoring_batch_size(cfg)

    def loss(model, batch, normalizer):
        counters["tokens"] += float(batch["attention_mask"].sum())
        return step_loss(step_logits(model, batch), batch["step_labels"], batch["step_mask"], normalizer)

    def evaluate(model, step):
        if not heldout:
            return {}
        start = time.perf_counter()
        metrics = evaluate_prm(model, collate, heldout, eval_batch, device)
        keeper.update(model, step, metrics)
        counters["eval_seconds"] += time.perf_counter() - start
        return metrics

    return Objective(
        collate=collate,
        loss=loss,
        normalizer=lambda exs: float(sum(len(e["labels"]) for e in exs)),
        evaluate=evaluate,
        should_stop=patience_stop(cfg, keeper),
    )


def train(cfg: RunConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Train a process reward model on ``{"prompt", "steps", "labels"}`` records: binary cross-entropy on
    each step's correctness, read at the step's last token (the separator after it). The saved model's
    token scores are logits of P(step correct); no normalisation is fitted (reward.normalize is ignored)."""
    session, examples, heldout = open_session(cfg, "prm")
    run, accelerator = start_run(cfg, session, resume, overwrite), session.accelerator
    model = scalar_model(cfg, session)
    collate = PRMCollator(session.tokenizer.pad_token_id)
    keeper = BestKeeper(
        run.path / "best",
        keep_existing=run.resume_checkpoint is not None,
        main_process=accelerator.is_main_process,
    )
    counters = {"tokens": 0.0, "eval_seconds": 0.0}
    objective = prm_objective(cfg, collate, heldout, keeper, accelerator.device, counters)
    result, model = fit_keeping_best(
        cfg, session, model, examples, objective, keeper, bool(heldout), counters
    )
    final_eval = (
        evaluate_prm(model, collate, heldout, scoring_batch_size(cfg), accelerator.device) if heldout else {}
    )
    summary = run_summary(
        cfg,
        "prm",
        "solutions",
        result,
        len(examples),
        len(heldout or []),
        keeper,
        final_eval,
        counters,
        accelerator,
    )
    finish_scalar_run(session, model, summary)
    return summary
