"""Held-out figures of a reward model from its scores: accuracy against the labels and against gold,
calibration, length correlation (pure tensor functions; :func:`rlhfkit.trainers.reward.evaluate_heldout`
scores the pairs and calls them).

- accuracy against the data's labels (a tie counts 1/2), mean margin, correlation of score with response
  length;
- calibration: the model's confidence sigmoid(|r_c - r_r|) against how often its preferred response is the
  chosen one, in bins over [0.5, 1], and the expected calibration error;
- with gold scores (``gold_chosen`` / ``gold_rejected``, written by ``rlhfkit label-pairs`` on a built-in
  task): accuracy against the noiseless gold order, gold ties excluded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
