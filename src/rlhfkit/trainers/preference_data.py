"""Preference data on the trainer side: the batches of the reward model's loss and the held-out pairs with
what is known about them beyond the labels (gold scores, the annotators' agreement).

Reading, validating and tokenising records is the data layer's (:func:`rlhfkit.data.prepare_examples`);
this module adds the reward trainer's per-pair fields (margin, response lengths) and checks the optional
gold fields of held-out records, naming the record and the field when one is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfkit.data import Examples, PreferenceCollator, TokenLimits, prepare_examples
from rlhfkit.trainers.reward_metrics import pearson

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
