"""Preference data on the trainer side: the batches of the reward model's loss and the held-out pairs with
what is known about them beyond the labels (gold scores, the annotators' agreement).

Reading, validating and tokenising records is the data layer's (:func:`rlhfkit.data.prepare_examples`);
this module adds the reward trainer's per-pair fields (margin, response lengths) and checks the optional
gold fields of held-out records, naming the record and the field when one is wrong.

The held-out figures of a reward model from its scores (pure tensor functions;
:func:`rlhfkit.trainers.reward.evaluate_heldout` scores the pairs and calls them):

- accuracy against the data's labels (a tie counts 1/2), mean margin, correlation of score with response
  length;
- calibration: the model's confidence sigmoid(|r_c - r_r|) against how often its preferred response is the
  chosen one, in bins over [0.5, 1], and the expected calibration error;
- with gold scores (``gold_chosen`` / ``gold_rejected``, written by ``rlhfkit label-pairs`` on a built-in
  task): accuracy against the noiseless gold order, gold ties excluded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhfkit.data import Examples, PreferenceCollator, TokenLimits, prepare_examples

GOLD_TIE = 1e-9  # gold scores closer than this are a tie (as rlhfkit.tasks.annotators)
CALIBRATION_BINS = 5  # confidence bins of width 0.1 over [0.5, 1]


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


GOLD_FIELDS = ("gold_chosen", "gold_rejected")


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
