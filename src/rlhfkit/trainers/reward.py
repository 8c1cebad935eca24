"""Reward model: Bradley-Terry training on preference pairs, held-out evaluation, score normalisation.

The reward model is the SFT model with a scalar head (``AutoModelForSequenceClassification``, one label)
that reads the score at each sequence's last real token (Ouyang et al. 2022, step 2; Ziegler et al. 2019).
Per pair, with scores r_c (chosen) and r_r (rejected), :func:`rlhfkit.algos.bradley_terry_loss` gives

    -log sigmoid(r_c - r_r - m) + center_coef * (r_c + r_r)^2

(Ouyang et al. 2022 eq. 1; margin m of Touvron et al. 2023 eq. 2; centring of Eisenstein et al. 2023),
averaged over the pairs of the whole batch (``aggregate_loss`` with the batch's pair count as normaliser,
so micro-batching and data parallelism do not change the gradient). Details:

- chosen and rejected are scored in ONE forward pass (the collator pads both sides to one length);
- the head starts at N(0, 1/(d_model + 1)) and dropout is off (Huang et al. 2024, "The N+ Implementation
  Details of RLHF with PPO"; both done by :func:`rlhfkit.models.load_scalar_model`);
- margin m: the record's ``margin`` field when it has one, else ``reward.margin``;
- length-bias control (``reward.length_bias_coef`` = c, off by default; Singhal et al. 2023 show reward
  models learn "longer is better"): with the 2n responses of a micro-batch of n pairs, scores r and lengths
  l in tokens, z = (l - mean l) / std l and cov = mean(r * z) (= corr(r, l) * std r), the loss adds
  c * cov^2 * n / N (N the whole batch's pairs). It is squared, so it is smooth and pulls the covariance to
  0 from either side without rewarding a negative one. Under gradient accumulation the covariance is
  estimated per micro-batch: E[cov_micro^2] = cov^2 + Var(cov_micro), so small micro-batches penalise a
  little more than one whole batch would;
- evaluation on held-out pairs every ``train.eval_steps`` (and at step 0): loss, accuracy against the
  data's labels (a tie counts 1/2), mean margin, correlation of score with response length, calibration
  (the model's confidence sigmoid(|r_c - r_r|) against how often its preferred response is the chosen one,
  in bins over [0.5, 1]); when the held-out records carry ``gold_chosen`` / ``gold_rejected`` (written by
  ``rlhfkit label-pairs`` on a built-in task; the trainer knows nothing else of the task), accuracy against
  the noiseless gold order with gold ties excluded, and with ``gold_agreement`` the annotators' Bayes ceiling;
- the best model by held-out accuracy against the labels (never gold: gold is not known in real use;
  ties go to the lower held-out loss) is kept in ``<run>/best/`` and becomes ``final/``;
  ``reward.early_stopping_patience`` stops training after that many evaluations without a better one;
- normalisation (Huang et al. 2024, "reward normalisation"): after training, a gain and a bias are fitted
  on the scores of training responses (up to ``reward.normalize_max_pairs`` pairs, both sides) so that they
  have mean 0 and std 1. The weights in ``final/`` stay raw, so plain ``transformers`` and
  :func:`rlhfkit.models.sequence_scores` give the same raw scores; the gain and bias go into
  ``final/config.json`` as ``rlhfkit_reward_gain`` / ``rlhfkit_reward_bias``, and rlhfkit applies them
  whenever it scores with the model (:mod:`rlhfkit.rollout.scoring`, :func:`normalized_scores`). (Llama's
  score head has no bias, so the bias could not be folded into the weights.)

With ``model.lora_rank`` > 0 (reward and PRM alike) LoRA adapters and the score head train;
``final/`` is the merged model and ``final/adapter/`` the adapter alone, with the normalisation keys in its
``rlhfkit_config.json`` (:mod:`rlhfkit.models.lora`).

``summary.json`` holds the held-out figures of the final model (with its calibration bins);
``heldout_scores.jsonl`` that model's raw score of each held-out pair; ``metrics.jsonl`` the training and
``eval/`` lines.

Where the rest lives: the held-out figures and calibration in :mod:`rlhfkit.trainers.preference_data`; the
batches and held-out pairs (with their gold fields) in :mod:`rlhfkit.trainers.preference_data`; the best
model and early stopping in :mod:`rlhfkit.trainers.best_model`; what a scalar-model run does around its
objective (data, model, the offline loop, summary, ``final/``) in :mod:`rlhfkit.trainers.scalar_run`. The
process reward model (``rlhfkit train prm``) shares all of it: :mod:`rlhfkit.trainers.prm`.

Launch:
    rlhfkit train reward --config reward.yaml                          # one process
    torchrun --standalone --nproc_per_node 2 -m rlhfkit.cli train reward --config reward.yaml   # 2 processes (data parallel)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from rlhfkit.algos import aggregate_loss, bradley_terry_loss
from rlhfkit.config import RunConfig
from rlhfkit.engine.atomic import atomic_write_text
from rlhfkit.models import sequence_scores
from rlhfkit.reporting.runs import HELDOUT_SCORES
from rlhfkit.rollout.scoring import BIAS_KEY, GAIN_KEY, reward_normalization
from rlhfkit.trainers.best_model import BestKeeper, patience_stop
from rlhfkit.trainers.common import micro_batches
from rlhfkit.trainers.offline import Objective
from rlhfkit.trainers.preference_data import HeldOut, PairCollator, heldout_metrics, heldout_pairs
from rlhfkit.trainers.scalar_run import (
    finish_scalar_run,
    fit_keeping_best,
    open_session,
    run_summary,
    scalar_model,
    scoring_batch_size,
    start_run,
)

# ----------------------------------------------------------------------------------------------------------
# The loss


def pair_scores(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of both sides of every pair from ONE forward pass over ``cat([chosen, rejected])``.

    Args:
        batch: ``chosen_input_ids``, ``chosen_attention_mask``, ``rejected_input_ids``,
            ``rejected_attention_mask``, all (B, L).
    Returns:
        (chosen (B,), rejected (B,)) raw scores.
    """
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])  # (2B, L)
    mask = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])  # (2B, L)
    scores = sequence_scores(model, ids, mask)  # (2B,)
    num_pairs = batch["chosen_input_ids"].shape[0]
    return scores[:num_pairs], scores[num_pairs:]


def length_covariance(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """cov(r, z) = mean(r * z) with z the lengths standardised over the set (population std).

    Args:
        scores: (N,) rewards.
        lengths: (N,) response lengths.
    Returns:
        a scalar, differentiable in ``scores``; 0 when every length is the same.
    """
    lengths = lengths.to(scores.dtype)
    centred = lengths - lengths.mean()  # (N,)
    std = centred.pow(2).mean().sqrt()
    if float(std) < 1e-6:
        return scores.sum() * 0.0
    return (scores * (centred / std)).mean()


def pair_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None,
    normalizer: float,
    *,
    center_coef: float = 0.0,
    length_bias_coef: float = 0.0,
    chosen_length: torch.Tensor | None = None,
    rejected_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The reward-model loss of one micro-batch of n pairs, divided by the whole batch's pair count N.

    ``sum_i BT_i / N + length_bias_coef * cov^2 * n / N`` (module docstring); summing it over the
    micro-batches of a step gives the step's loss.

    Args:
        chosen, rejected: (n,) scores.
        margin: (n,) or None.
        normalizer: N.
        center_coef, length_bias_coef: as in ``RewardConfig``.
        chosen_length, rejected_length: (n,) response lengths (needed when ``length_bias_coef`` > 0).
    Returns:
        (scalar loss, stats already multiplied by n / N so that the loop's sum over micro-batches is the
        step's mean).
    """
    per_pair, bt = bradley_terry_loss(chosen, rejected, margin, center_coef)  # (n,)
    loss = aggregate_loss(per_pair[:, None], torch.ones_like(per_pair[:, None]), "token-mean", normalizer)
    share = per_pair.shape[0] / normalizer
    stats = {
        "loss/bradley_terry": float(loss.detach()),
        "accuracy": float(bt["accuracy"]) * share,
        "margin": float(bt["margin"]) * share,
        "score/chosen": float(bt["chosen"]) * share,
        "score/rejected": float(bt["rejected"]) * share,
    }
    if length_bias_coef:
        if chosen_length is None or rejected_length is None:
            raise ValueError("length_bias_coef > 0 needs chosen_length and rejected_length")
        cov = length_covariance(torch.cat([chosen, rejected]), torch.cat([chosen_length, rejected_length]))
        penalty = length_bias_coef * cov.pow(2) * share
        loss = loss + penalty
        stats["loss/length_bias"] = float(penalty.detach())
        stats["length_covariance"] = float(cov.detach()) * share
    return loss, stats


# ----------------------------------------------------------------------------------------------------------
# Held-out evaluation


@torch.no_grad()
def score_examples(
    model, collate, examples: list[dict], batch_size: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw scores of both sides of ``examples`` (in micro-batches sorted by length, to pad little).

    Returns:
        (chosen (n,), rejected (n,)) float32 on the CPU, in the order of ``examples``.
    """
    order = sorted(
        range(len(examples)),
        key=lambda i: (
            len(examples[i]["prompt_ids"])
            + max(len(examples[i]["chosen_ids"]), len(examples[i]["rejected_ids"]))
        ),
    )
    chosen, rejected = torch.empty(len(examples)), torch.empty(len(examples))
    for chunk in micro_batches(order, batch_size):
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in chunk]).items()}
        chunk_chosen, chunk_rejected = pair_scores(model, batch)
        chosen[list(chunk)], rejected[list(chunk)] = chunk_chosen.float().cpu(), chunk_rejected.float().cpu()
    return chosen, rejected


def evaluate_heldout(
    model, collate: PairCollator, heldout: HeldOut, batch_size: int, device
) -> tuple[dict[str, float], list[dict]]:
    """:func:`heldout_metrics` of ``model`` on ``heldout`` (scored in micro-batches of ``batch_size``)."""
    chosen, rejected = score_examples(model, collate, heldout.examples, batch_size, device)
    lengths = [
        torch.tensor([len(e[f"{side}_ids"]) for e in heldout.examples]) for side in ("chosen", "rejected")
    ]
    margin = torch.tensor([e.get("margin", collate.default_margin) for e in heldout.examples])
    return heldout_metrics(chosen, rejected, *lengths, margin, *(heldout.gold or (None, None)))


# ----------------------------------------------------------------------------------------------------------
# Normalisation


def normalized_scores(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """``gain * sequence_scores + bias`` with the model's stored normalisation (what
    :class:`rlhfkit.rollout.scoring.Scorer` gives PPO).

    Args:
        input_ids, attention_mask: (B, L), either padding side.
    Returns:
        (B,).
    """
    gain, bias = reward_normalization(model)
    return sequence_scores(model, input_ids, attention_mask) * gain + bias


def fit_normalization(scores: torch.Tensor) -> tuple[float, float]:
    """Gain and bias that map ``scores`` (N,) to mean 0 and (population) std 1; gain 1 if they are constant."""
    scores = scores.double()
    mean, std = float(scores.mean()), float(scores.std(unbiased=False))
    gain = 1.0 / std if std > 1e-8 else 1.0
    return gain, -mean * gain


# ----------------------------------------------------------------------------------------------------------
# The trainer


def reward_objective(
    cfg: RunConfig,
    collate: PairCollator,
    heldout: HeldOut | None,
    keeper: BestKeeper,
    device,
    counters: dict[str, float],
    latest: dict[str, Any],
) -> Objective:
    """The loss, evaluation and early stopping of a reward-model run (``counters`` collects tokens and
    evaluation time for the throughput figures; ``latest`` receives the last evaluation, with its calibration
    bins)."""
    settings = cfg.reward
    eval_batch = scoring_batch_size(cfg)

    def loss(model, batch, normalizer):
        chosen, rejected = pair_scores(model, batch)
        counters["tokens"] += float(
            batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum()
        )
        return pair_loss(
            chosen,
            rejected,
            batch["margin"],
            normalizer,
            center_coef=settings.center_coef,
            length_bias_coef=settings.length_bias_coef,
            chosen_length=batch["chosen_length"],
            rejected_length=batch["rejected_length"],
        )

    def evaluate(model, step):
        if heldout is None:
            return {}
        start = time.perf_counter()
        metrics, bins = evaluate_heldout(model, collate, heldout, eval_batch, device)
        keeper.update(model, step, metrics, bins)
        latest.update(step=step, eval=metrics, extra=bins)
        counters["eval_seconds"] += time.perf_counter() - start
        return metrics

    return Objective(
        collate=collate, loss=loss, normalizer=len, evaluate=evaluate, should_stop=patience_stop(cfg, keeper)
    )


def train(cfg: RunConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Train a Bradley-Terry reward model as configured; write ``final/`` and ``summary.json``; return the
    summary."""
    # 1. data: read, validate and tokenise everything before a model is built (bad input stops here).
    session, examples, heldout_examples = open_session(cfg, "preferences")
    heldout = heldout_pairs(heldout_examples) if heldout_examples is not None else None
    run, accelerator = start_run(cfg, session, resume, overwrite), session.accelerator

    # 2. model, loss, evaluation, best model.
    model = scalar_model(cfg, session)
    collate = PairCollator(session.tokenizer.pad_token_id, cfg.reward.margin)
    keeper = BestKeeper(
        run.path / "best",
        keep_existing=run.resume_checkpoint is not None,
        main_process=accelerator.is_main_process,
    )
    counters, latest = {"tokens": 0.0, "eval_seconds": 0.0}, {"step": None}
    objective = reward_objective(cfg, collate, heldout, keeper, accelerator.device, counters, latest)

    # 3. Bradley-Terry training, evaluation every eval_steps, early stopping; final = best.
    result, model = fit_keeping_best(
        cfg, session, model, examples, objective, keeper, heldout is not None, counters
    )
    final_eval, bins = {}, []
    if heldout is not None:  # the final model's figures, with its calibration bins
        final_eval, bins = final_figures(
            cfg, model, collate, heldout, keeper, latest, result["step"], accelerator.device
        )

    # 4. normalisation on training responses; save final/ (raw weights + gain/bias in config.json).
    gain, bias, fitted = 1.0, 0.0, 0
    if cfg.reward.normalize:
        gain, bias, fitted = fit_on_training_responses(model, collate, examples, cfg, accelerator.device)
    setattr(model.config, GAIN_KEY, gain)
    setattr(model.config, BIAS_KEY, bias)

    summary = run_summary(
        cfg,
        "reward",
        "pairs",
        result,
        len(examples),
        len(heldout.examples) if heldout else 0,
        keeper,
        final_eval,
        counters,
        accelerator,
    )
    if heldout is not None:
        summary.update(
            {
                "bayes_ceiling": heldout.bayes_ceiling,
                "heldout_gold_length_correlation": heldout.gold_length_correlation,
                "calibration_bins": bins,
            }
        )
    summary["normalization"] = {
        "gain": gain,
        "bias": bias,
        "fit_responses": fitted,
        "config_keys": [GAIN_KEY, BIAS_KEY],
    }
    if heldout is not None and accelerator.is_main_process:
        write_heldout_scores(
            run.path / HELDOUT_SCORES, model, collate, heldout, scoring_batch_size(cfg), accelerator.device
        )
    finish_scalar_run(session, model, summary)
    return summary


def write_heldout_scores(
    path: Path, model, collate: PairCollator, heldout: HeldOut, batch_size: int, device
) -> None:
    """The final model's raw scores of each held-out pair, one JSON object per line (``chosen``, ``rejected``,
    and ``gold_chosen`` / ``gold_rejected`` when known), for the report's score histograms."""
    chosen, rejected = score_examples(model, collate, heldout.examples, batch_size, device)
    gold = [g.tolist() for g in heldout.gold] if heldout.gold is not None else None
    lines = []
    for i, (chosen_score, rejected_score) in enumerate(zip(chosen.tolist(), rejected.tolist(), strict=True)):
        row = {"chosen": chosen_score, "rejected": rejected_score}
        if gold is not None:
            row.update(gold_chosen=gold[0][i], gold_rejected=gold[1][i])
        lines.append(json.dumps(row, allow_nan=False) + "\n")
    atomic_write_text(path, "".join(lines))


def final_figures(
    cfg: RunConfig,
    model,
    collate,
    heldout: HeldOut,
    keeper: BestKeeper,
    latest: dict[str, Any],
    step: int,
    device,
) -> tuple[dict[str, float], list[dict]]:
    """The held-out figures of the final model: those of the evaluation it comes from (the best one, or the
    last step's), else (a resumed run with nothing left to train) evaluated again."""
    done = keeper.best if cfg.reward.keep_best and keeper.best is not None else latest
    if (
        done.get("step") is not None
        and done.get("extra") is not None
        and (done is keeper.best or done["step"] == step)
    ):
        return done["eval"], done["extra"]
    return evaluate_heldout(model, collate, heldout, scoring_batch_size(cfg), device)


def fit_on_training_responses(
    model, collate: PairCollator, examples: list[dict], cfg, device
) -> tuple[float, float, int]:
    """(gain, bias, responses used) fitted on both responses of up to ``reward.normalize_max_pairs``
    training pairs drawn with the run's seed."""
    gen = torch.Generator().manual_seed(cfg.seed)
    picked = torch.randperm(len(examples), generator=gen)[: cfg.reward.normalize_max_pairs].tolist()
    fit = [examples[i] for i in sorted(picked)]
    chosen, rejected = score_examples(model, collate, fit, scoring_batch_size(cfg), device)
    gain, bias = fit_normalization(torch.cat([chosen, rejected]))
    return gain, bias, 2 * len(fit)
