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

The process reward model (``rlhfkit train prm``, :func:`train_prm`) shares the loop, the best model and
early stopping: binary cross-entropy of each step's correctness, read at the step's last token
(Lightman et al. 2023), averaged over the whole batch's steps; held-out step and solution accuracy.

Launch (``prm`` for a process reward model):
    rlhfkit train reward --config reward.yaml                          # one process
    torchrun --standalone --nproc_per_node 2 -m rlhfkit.cli train reward --config reward.yaml   # 2 processes (data parallel)
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rlhfkit.algos import aggregate_loss, bradley_terry_loss
from rlhfkit.data import Examples, PreferenceCollator, TokenLimits, prepare_examples, prepare_run_data
from rlhfkit.engine import sharded
from rlhfkit.engine.accel import make_accelerator
from rlhfkit.engine.run import RunDir, open_run
from rlhfkit.engine.seed import seed_everything
from rlhfkit.errors import ConfigError
from rlhfkit.models import load_scalar_model, prepare_trained, save_hf_folder, sequence_scores, token_scores
from rlhfkit.report import write_report
from rlhfkit.reporting.runs import HELDOUT_SCORES
from rlhfkit.rollout.scoring import BIAS_KEY, GAIN_KEY, reward_normalization
from rlhfkit.trainers.loop import Objective, micro_batches, run_tokenizer, train_offline

GOLD_FIELDS = ("gold_chosen", "gold_rejected")
GOLD_TIE = 1e-9  # gold scores closer than this are a tie (as rlhfkit.tasks.annotators)
CALIBRATION_BINS = 5  # confidence bins of width 0.1 over [0.5, 1]


# ----------------------------------------------------------------------------------------------------------
# Batches and the loss


class PairCollator:
    """Tokenised pairs -> a :class:`rlhfkit.data.PreferenceCollator` batch plus ``margin`` (B,) float (the
    record's own, else ``default_margin``) and ``chosen_length`` / ``rejected_length`` (B,) long (response
    tokens, EOS included)."""

    def __init__(self, pad_token_id: int, default_margin: float = 0.0):
        self.pairs = PreferenceCollator(pad_token_id)
        self.default_margin = float(default_margin)

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.pairs(examples)
        batch["margin"] = torch.tensor(
            [ex.get("margin", self.default_margin) for ex in examples], dtype=torch.float32
        )
        for side in ("chosen", "rejected"):
            batch[f"{side}_length"] = torch.tensor([len(ex[f"{side}_ids"]) for ex in examples])
        return batch


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
    n = batch["chosen_input_ids"].shape[0]
    return scores[:n], scores[n:]


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
        c, r = pair_scores(model, batch)
        chosen[list(chunk)], rejected[list(chunk)] = c.float().cpu(), r.float().cpu()
    return chosen, rejected


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two (N,) tensors; NaN when either is constant."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = float(x.norm() * y.norm())
    return float((x * y).sum()) / denominator if denominator > 0 else float("nan")


def calibration(diff: torch.Tensor, num_bins: int = CALIBRATION_BINS) -> tuple[float, list[dict]]:
    """Confidence against observed agreement with the labels.

    The model prefers the response it scores higher, with confidence c = sigmoid(|r_c - r_r|) in [0.5, 1];
    it is right when that response is the chosen one (1/2 for a tie). Pairs are binned by c into
    ``num_bins`` equal bins over [0.5, 1].

    Args:
        diff: (n,) r_chosen - r_rejected.
    Returns:
        (expected calibration error sum_k n_k / n * |mean c_k - mean right_k|,
         bins [{"low", "high", "count", "confidence", "observed"}] with null means in empty bins).
    """
    diff = diff.double()
    confidence = torch.sigmoid(diff.abs())  # (n,)
    right = (diff > 0).double() + 0.5 * (diff == 0).double()  # (n,)
    index = ((confidence - 0.5) * 2 * num_bins).long().clamp(0, num_bins - 1)  # (n,)
    ece, bins = 0.0, []
    for k in range(num_bins):
        members = index == k
        count = int(members.sum())
        low, high = 0.5 + 0.5 * k / num_bins, 0.5 + 0.5 * (k + 1) / num_bins
        if count == 0:
            bins.append({"low": low, "high": high, "count": 0, "confidence": None, "observed": None})
            continue
        conf, observed = float(confidence[members].mean()), float(right[members].mean())
        ece += count / len(diff) * abs(conf - observed)
        bins.append({"low": low, "high": high, "count": count, "confidence": conf, "observed": observed})
    return ece, bins


def heldout_metrics(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    chosen_length: torch.Tensor,
    rejected_length: torch.Tensor,
    margin: torch.Tensor,
    gold_chosen: torch.Tensor | None = None,
    gold_rejected: torch.Tensor | None = None,
) -> tuple[dict[str, float], list[dict]]:
    """The held-out figures of a reward model (see the module docstring).

    Args:
        chosen, rejected: (n,) raw scores.
        chosen_length, rejected_length: (n,) response lengths in tokens.
        margin: (n,) the margins the loss uses.
        gold_chosen, gold_rejected: (n,) gold scores, or None.
    Returns:
        (metrics: loss, accuracy, margin, score_mean, score_std, length_correlation, calibration_error and,
        with gold, gold_accuracy and gold_pairs (non-tied pairs); calibration bins).
    """
    diff = (chosen - rejected).double()  # (n,)
    scores = torch.cat([chosen, rejected]).double()  # (2n,)
    lengths = torch.cat([chosen_length, rejected_length]).double()  # (2n,)
    ece, bins = calibration(diff)
    metrics = {
        "loss": float(-F.logsigmoid(diff - margin.double()).mean()),
        "accuracy": float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean()),
        "margin": float(diff.mean()),
        "score_mean": float(scores.mean()),
        "score_std": float(scores.std(unbiased=False)),
        "length_correlation": pearson(scores, lengths),
        "calibration_error": ece,
    }
    if gold_chosen is not None and gold_rejected is not None:
        gold_diff = (gold_chosen - gold_rejected).double()  # (n,)
        untied = gold_diff.abs() > GOLD_TIE
        agree = (torch.sign(diff) == torch.sign(gold_diff)).double() + 0.5 * (diff == 0).double()
        metrics["gold_accuracy"] = float(agree[untied].mean()) if bool(untied.any()) else float("nan")
        metrics["gold_pairs"] = int(untied.sum())
    return metrics, bins


@dataclass
class HeldOut:
    """Tokenised held-out pairs and what is known about them beyond the labels.

    Attributes:
        examples: tokenised pairs.
        gold: (gold_chosen (n,), gold_rejected (n,)) when every record has both fields, else None.
        bayes_ceiling: mean ``gold_agreement`` over the non-tied pairs when the records carry it, else None.
        gold_length_correlation: correlation of gold score with response length, for comparison.
    """

    examples: list[dict]
    gold: tuple[torch.Tensor, torch.Tensor] | None = None
    bayes_ceiling: float | None = None
    gold_length_correlation: float | None = None


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


def _number(records, index: int, name: str, allow_null: bool = False) -> float | None:
    value = records[index].get(name)
    if value is None and allow_null:
        return None
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        got = (
            "missing" if name not in records[index] else type(value).__name__ if value is not None else "null"
        )
        raise records.error(index, f"expected a number, got {got}", field=name)
    return float(value)


def load_heldout(source: str, tokenizer, limits: TokenLimits) -> HeldOut:
    """Read, validate and tokenise held-out pairs (:func:`heldout_pairs`)."""
    return heldout_pairs(prepare_examples(source, "preferences", tokenizer, limits))


def heldout_pairs(examples: Examples) -> HeldOut:
    """Tokenised held-out pairs with their optional gold fields.

    ``gold_chosen`` / ``gold_rejected`` must be in every record or in none (a DataError names the first
    record without them); ``gold_agreement`` is a number, or null for a gold tie.
    """
    records = examples.records
    held = HeldOut(list(examples))
    if not any(r.get(f) is not None for r in records for f in GOLD_FIELDS):
        return held
    for i, record in enumerate(records):
        for f in GOLD_FIELDS:
            if record.get(f) is None:
                raise records.error(
                    i,
                    "is missing, but other records have gold scores; give both gold fields "
                    "in every record or in none",
                    field=f,
                )
    gold = [[_number(records, i, f) for i in range(len(records))] for f in GOLD_FIELDS]
    held.gold = (torch.tensor(gold[0], dtype=torch.float64), torch.tensor(gold[1], dtype=torch.float64))
    lengths = torch.tensor([len(e[f"{side}_ids"]) for side in ("chosen", "rejected") for e in examples])
    held.gold_length_correlation = pearson(torch.cat(held.gold), lengths)
    if all("gold_agreement" in r for r in records):
        agreement = [_number(records, i, "gold_agreement", allow_null=True) for i in range(len(records))]
        known = [a for a in agreement if a is not None]
        held.bayes_ceiling = sum(known) / len(known) if known else None
    return held


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
            tmp = self.folder / "model.safetensors.tmp"
            if whole is None:
                save_model(model, str(tmp))
            else:
                save_file({k: v.detach().cpu().contiguous() for k, v in whole.items()}, str(tmp))
            os.replace(tmp, self.folder / "model.safetensors")
            _write_json(self.folder / "best.json", self.best)
        return True

    def restore(self, model: torch.nn.Module) -> None:
        """Load the best weights into ``model``."""
        from safetensors.torch import load_model

        load_model(model, str(self.folder / "model.safetensors"), device=str(next(model.parameters()).device))

    @property
    def step(self) -> int | None:
        return None if self.best is None else int(self.best["step"])


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, allow_nan=True))
    os.replace(tmp, path)


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
    cfg,
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
    r = cfg.reward
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
            center_coef=r.center_coef,
            length_bias_coef=r.length_bias_coef,
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


def patience_stop(cfg, keeper: BestKeeper):
    """``should_stop(step)``: True once ``reward.early_stopping_patience`` evaluations in a row have not beaten
    the best (counted from the best evaluation's step, so it needs no state of its own across a resume)."""
    patience, every = cfg.reward.early_stopping_patience, cfg.train.eval_steps

    def should_stop(step: int) -> bool:
        return patience is not None and keeper.step is not None and step - keeper.step >= patience * every

    return should_stop


def scoring_batch_size(cfg) -> int:
    """Pairs per forward pass when only scoring (evaluation, normalisation): 4 training micro-batches, as
    no activations are kept for a backward pass."""
    return 4 * (cfg.train.micro_batch_size or cfg.train.batch_size)


def _check(cfg) -> None:
    if not (cfg.data.eval_file or cfg.data.eval_split) and cfg.reward.early_stopping_patience is not None:
        raise ConfigError(
            "reward.early_stopping_patience: early stopping watches the held-out accuracy, so it "
            "needs data.eval_file (or data.eval_split)"
        )


@dataclass
class _Session:
    """What every scalar-model run opens: processes, the run folder, the tokenizer, the length limits."""

    accelerator: Any
    run: RunDir | None
    tokenizer: Any
    limits: TokenLimits
    save_dtype: str = "float32"


def _open(cfg, kind: str) -> tuple[_Session, Examples, Examples | None]:
    """Processes, tokenizer and all data of the run (bad data stops here, before the run folder is written)."""
    _check(cfg)
    seed_everything(cfg.seed)
    accelerator = make_accelerator(sharding=True)
    tokenizer = run_tokenizer(cfg)
    limits = TokenLimits(cfg.data.max_prompt_length, cfg.data.max_length, cfg.data.truncation)
    examples, heldout = prepare_run_data(cfg.data, kind, tokenizer, limits, accelerator)
    return _Session(accelerator, None, tokenizer, limits, cfg.model.save_dtype), examples, heldout


def _start_run(cfg, session: _Session, resume: bool, overwrite: bool) -> RunDir:
    session.run = open_run(cfg, session.accelerator, resume, overwrite)
    return session.run


def _scalar_model(cfg, session: _Session) -> torch.nn.Module:
    """The backbone with a fresh scalar head (N+ init, :func:`rlhfkit.models.load_scalar_model`), dropout off."""
    model = load_scalar_model(
        cfg.model.name_or_path,
        trust_remote_code=cfg.model.trust_remote_code,
        dtype=cfg.model.dtype,
        tokenizer=session.tokenizer,
        dropout=not cfg.model.disable_dropout,
    )
    return prepare_trained(model, cfg.model).to(session.accelerator.device)  # LoRA / gradient checkpointing


def _fit(
    cfg,
    session: _Session,
    model,
    examples,
    objective: Objective,
    keeper: BestKeeper,
    heldout: bool,
    counters: dict[str, float],
) -> tuple[dict[str, Any], torch.nn.Module]:
    """Step-0 evaluation, the shared offline loop, then the best model back in place (eval mode)."""
    run, accelerator = session.run, session.accelerator
    if heldout and run.resume_checkpoint is None:  # the untrained model's held-out figures, as step 0
        model.eval()
        with torch.no_grad():
            run.metrics.log(0, {f"eval/{k}": v for k, v in objective.evaluate(model, 0).items()})
        counters["eval_seconds"] = 0.0  # before the loop's clock starts
    result = train_offline(cfg, run, model, examples, objective, accelerator)
    model = accelerator.unwrap_model(result["model"])  # whole again after sharded training
    model.eval()
    accelerator.wait_for_everyone()
    if heldout and cfg.reward.keep_best and keeper.best is not None:
        if accelerator.is_main_process:
            for line in keep_best_warnings(keeper, cfg.train.eval_steps, result["step"]):
                print(f"rlhfkit: warning: {line}", file=sys.stderr)
        keeper.restore(model)
    return result, model


def keep_best_warnings(keeper: BestKeeper, eval_steps: int, last_step: int) -> list[str]:
    """What a user should know about the model ``reward.keep_best`` ships: that the best came at the first
    trained evaluation (later training only made it worse), or that the untrained model scored better."""
    out, best = [], keeper.best
    first = min(eval_steps, last_step)
    if best["step"] == first and last_step > first:
        out.append(
            f"reward.keep_best: the best held-out accuracy came at the first evaluation (step {first}) and "
            f"none of the later ones up to step {last_step} beat it, so final/ is step {first}'s model; "
            "a lower train.learning_rate, more data or more frequent train.eval_steps may help"
        )
    if keeper.untrained is not None and BestKeeper.better(keeper.untrained, best["eval"]):
        out.append(
            f"reward.keep_best: the untrained model's held-out accuracy ({keeper.untrained['accuracy']:.4g}) "
            f"is above the best trained one's ({best['eval']['accuracy']:.4g}, step {best['step']}); "
            "final/ is the trained model, but training did not help"
        )
    return out


def train(cfg, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Train a Bradley-Terry reward model as configured; write ``final/`` and ``summary.json``; return the
    summary."""
    # 1. data: read, validate and tokenise everything before a model is built (bad input stops here).
    session, examples, heldout_examples = _open(cfg, "preferences")
    heldout = heldout_pairs(heldout_examples) if heldout_examples is not None else None
    run, accelerator = _start_run(cfg, session, resume, overwrite), session.accelerator

    # 2. model, loss, evaluation, best model.
    model = _scalar_model(cfg, session)
    collate = PairCollator(session.tokenizer.pad_token_id, cfg.reward.margin)
    keeper = BestKeeper(
        run.path / "best",
        keep_existing=run.resume_checkpoint is not None,
        main_process=accelerator.is_main_process,
    )
    counters, latest = {"tokens": 0.0, "eval_seconds": 0.0}, {"step": None}
    objective = reward_objective(cfg, collate, heldout, keeper, accelerator.device, counters, latest)

    # 3. Bradley-Terry training, evaluation every eval_steps, early stopping; final = best.
    result, model = _fit(cfg, session, model, examples, objective, keeper, heldout is not None, counters)
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

    summary = _summary(
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
    _finish(session, model, summary)
    return summary


def write_heldout_scores(
    path: Path, model, collate: PairCollator, heldout: HeldOut, batch_size: int, device
) -> None:
    """The final model's raw scores of each held-out pair, one JSON object per line (``chosen``, ``rejected``,
    and ``gold_chosen`` / ``gold_rejected`` when known), for the report's score histograms."""
    chosen, rejected = score_examples(model, collate, heldout.examples, batch_size, device)
    gold = [g.tolist() for g in heldout.gold] if heldout.gold is not None else None
    lines = []
    for i, (c, r) in enumerate(zip(chosen.tolist(), rejected.tolist(), strict=True)):
        row = {"chosen": c, "rejected": r}
        if gold is not None:
            row.update(gold_chosen=gold[0][i], gold_rejected=gold[1][i])
        lines.append(json.dumps(row, allow_nan=False) + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, path)


def final_figures(
    cfg, model, collate, heldout: HeldOut, keeper: BestKeeper, latest: dict[str, Any], step: int, device
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


def _summary(
    cfg,
    kind: str,
    unit: str,
    result,
    num_train: int,
    num_eval: int,
    keeper: BestKeeper,
    final_eval: dict,
    counters: dict[str, float],
    accelerator,
) -> dict[str, Any]:
    """summary.json: the final model's held-out figures, and the training throughput (held-out evaluations
    excluded; this session's steps when resumed)."""
    train_seconds = max(result["wall_seconds"] - counters["eval_seconds"], 1e-9)
    tokens = counters["tokens"]
    if accelerator.num_processes > 1:  # every process counted its own slice of each batch
        tokens = float(accelerator.reduce(torch.tensor([tokens], device=accelerator.device), reduction="sum"))
    return {
        "kind": kind,
        "steps": result["step"],
        "early_stopped": result["step"] < cfg.train.max_steps,
        "final_step": keeper.step
        if num_eval and cfg.reward.keep_best and keeper.step is not None
        else result["step"],
        f"train_{unit}": num_train,
        f"eval_{unit}": num_eval,
        "train_loss": result["loss"],
        **{f"heldout_{k}": v for k, v in final_eval.items()},
        "wall_seconds": result["wall_seconds"],
        "eval_seconds": counters["eval_seconds"],
        f"{unit}_per_second": (result["examples_per_second"] or 0.0) * result["wall_seconds"] / train_seconds,
        "tokens_per_second": tokens / train_seconds,  # real (non-padding) tokens through forward + backward
    }


def _finish(session: _Session, model, summary: dict[str, Any]) -> None:
    if session.accelerator.is_main_process:
        save_hf_folder(model, session.tokenizer, session.run.final_dir, dtype=session.save_dtype)
        session.run.write_summary(summary)
    session.run.close()
    if session.accelerator.is_main_process:
        write_report(session.run.path)


# ----------------------------------------------------------------------------------------------------------
# Process reward model


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
    solutions = [bool((lg > 0).all()) == bool(lb.bool().all()) for lg, lb in zip(logits, labels, strict=True)]
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
        out = step_logits(model, batch).float().cpu()  # (b, S)
        for i, ex in enumerate(chunk):
            logits.append(out[i, : len(ex["labels"])])
            labels.append(torch.tensor([float(v) for v in ex["labels"]]))
    return prm_metrics(logits, labels)


def prm_objective(
    cfg, collate, heldout: list[dict] | None, keeper: BestKeeper, device, counters: dict[str, float]
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


def train_prm(cfg, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Train a process reward model on ``{"prompt", "steps", "labels"}`` records: binary cross-entropy on
    each step's correctness, read at the step's last token (the separator after it). The saved model's
    token scores are logits of P(step correct); no normalisation is fitted (reward.normalize is ignored)."""
    from rlhfkit.data import PRMCollator

    session, examples, heldout = _open(cfg, "prm")
    run, accelerator = _start_run(cfg, session, resume, overwrite), session.accelerator
    model = _scalar_model(cfg, session)
    collate = PRMCollator(session.tokenizer.pad_token_id)
    keeper = BestKeeper(
        run.path / "best",
        keep_existing=run.resume_checkpoint is not None,
        main_process=accelerator.is_main_process,
    )
    counters = {"tokens": 0.0, "eval_seconds": 0.0}
    objective = prm_objective(cfg, collate, heldout, keeper, accelerator.device, counters)
    result, model = _fit(cfg, session, model, examples, objective, keeper, bool(heldout), counters)
    final_eval = (
        evaluate_prm(model, collate, heldout, scoring_batch_size(cfg), accelerator.device) if heldout else {}
    )
    summary = _summary(
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
    _finish(session, model, summary)
    return summary
