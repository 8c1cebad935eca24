"""Collators: lists of tokenised examples -> padded tensors with the masks the trainers need.

Masks are built from lengths, never by comparing ids with the pad id, so everything stays right
when the pad token equals EOS (huggingface/trl#1623, pytorch/torchtune#949), and nothing depends
on the values stored at padded positions.

- SFT and preference and PRM batches are right padded; the read-outs in :mod:`rlhfkit.models`
  are padding independent, so the side does not change any score.
- Prompt batches for generation are LEFT padded, so that every prompt ends in the last column
  and the response starts at the same column for all rows.

Shapes: ``B`` batch, ``L`` padded length, ``P`` padded prompt length, ``S`` most steps in a row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IGNORE_INDEX = -100  # labels that cross-entropy skips (the transformers convention)


def pad_sequences(
    rows: Sequence[Sequence[int]], pad_value: int, side: str = "right", pad_to_multiple_of: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad integer lists to one length.

    Args:
        rows: B lists of ints.
        pad_value: the value written at padded positions.
        side: ``"right"`` or ``"left"``.
        pad_to_multiple_of: round the length up to a multiple of this.
    Returns:
        values (B, L) long and mask (B, L) long (1 on real entries).
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got '{side}'")
    length = max((len(row) for row in rows), default=0)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    values = torch.full((len(rows), length), pad_value, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        start = 0 if side == "right" else length - len(row)
        values[i, start : start + len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[i, start : start + len(row)] = 1
    return values, mask


class _Collator:
    """Holds the pad id (any int: masks never compare with it) and the length rounding."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of


class SFTCollator(_Collator):
    """``{"prompt_ids", "completion_ids"}`` examples -> a right-padded SFT batch.

    Returns a dict with ``input_ids`` (B, L), ``attention_mask`` (B, L) and ``labels`` (B, L): the
    completion's token ids (EOS included) and -100 on the prompt, on the completion positions of
    ``completion_skip`` (a multi-turn conversation's tool results and user turns) and on the padding. ``labels`` is
    aligned with ``input_ids`` (transformers convention: the loss shifts by one inside the model, or
    compare ``logits[:, :-1]`` with ``labels[:, 1:]``).
    """

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        rows = [ex["prompt_ids"] + ex["completion_ids"] for ex in examples]
        input_ids, attention_mask = pad_sequences(rows, self.pad_token_id, "right", self.pad_to_multiple_of)
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        for i, ex in enumerate(examples):
            labels[i, : len(ex["prompt_ids"])] = IGNORE_INDEX
            skip = [len(ex["prompt_ids"]) + j for j in ex.get("completion_skip", ())]  # untrained turns
            labels[i, skip] = IGNORE_INDEX
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PreferenceCollator(_Collator):
    """``{"prompt_ids", "chosen_ids", "rejected_ids"}`` examples -> right-padded pairs of one length.

    Returns ``chosen_input_ids``, ``chosen_attention_mask``, ``rejected_input_ids``,
    ``rejected_attention_mask`` (all (B, L), the same L for both sides, so a trainer can score
    ``torch.cat([chosen, rejected])`` in one forward) and ``margin`` (B,) when every example has one.
    """

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        rows = [ex["prompt_ids"] + ex["chosen_ids"] for ex in examples]
        rows += [ex["prompt_ids"] + ex["rejected_ids"] for ex in examples]
        ids, mask = pad_sequences(rows, self.pad_token_id, "right", self.pad_to_multiple_of)
        n = len(examples)
        batch = {
            "chosen_input_ids": ids[:n],
            "chosen_attention_mask": mask[:n],
            "rejected_input_ids": ids[n:],
            "rejected_attention_mask": mask[n:],
        }
        if examples and all("margin" in ex for ex in examples):
            batch["margin"] = torch.tensor([ex["margin"] for ex in examples], dtype=torch.float32)
        return batch


class PromptCollator(_Collator):
    """``{"prompt_ids", "record"}`` examples -> LEFT-padded prompts for generation.

    Returns ``input_ids`` (B, P), ``attention_mask`` (B, P), and ``records`` (the B validated
    records, for reward functions that need the prompt text or extra fields such as an answer).
    """

    def __call__(self, examples: Sequence[dict]) -> dict:
        ids, mask = pad_sequences(
            [ex["prompt_ids"] for ex in examples], self.pad_token_id, "left", self.pad_to_multiple_of
        )
        return {"input_ids": ids, "attention_mask": mask, "records": [ex.get("record") for ex in examples]}


class PRMCollator(_Collator):
    """``{"prompt_ids", "completion_ids", "step_ends", "labels"}`` examples -> a process-supervision batch.

    Returns ``input_ids`` (B, L) and ``attention_mask`` (B, L), right padded; ``step_positions``
    (B, S) long, the column of each step's last token (0 where ``step_mask`` is False);
    ``step_labels`` (B, S) float, 1.0 for a correct step; ``step_mask`` (B, S) bool.
    """

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        rows = [ex["prompt_ids"] + ex["completion_ids"] for ex in examples]
        input_ids, attention_mask = pad_sequences(rows, self.pad_token_id, "right", self.pad_to_multiple_of)
        positions = [[len(ex["prompt_ids"]) + end for end in ex["step_ends"]] for ex in examples]
        step_positions, step_mask = pad_sequences(positions, 0, "right")
        step_labels, _ = pad_sequences(
            [[int(label) for label in ex["labels"]] for ex in examples], 0, "right"
        )
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "step_positions": step_positions,
            "step_labels": step_labels.float(),
            "step_mask": step_mask.bool(),
        }
