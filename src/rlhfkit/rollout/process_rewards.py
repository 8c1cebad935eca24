"""A process reward model (``rlhfkit train prm``) as a dense reward in online RL (``online.process_reward_model``).

A PRM is trained to read P(step correct) at the last token of every step, each step followed by the step
separator (``"\\n"``, :class:`rlhfkit.data.TokenLimits`), as Lightman et al. 2023 ("Let's Verify Step by Step")
read it. On a sampled response the same convention marks the step ends: every response token whose text
ends with the separator (the separator token itself, or a token it was merged into). There the PRM's score
becomes a reward, ``P(correct) - 1`` in (-1, 0] (a confident right step costs nothing, a confident wrong one
-1), and nothing elsewhere. The reward is never positive on purpose: with ``2 * P - 1`` (a bonus for a
right-looking step) PPO learns to write extra lines the PRM has never seen and calls right (``\n\n\n``,
``8=8``), the step count and the PRM reward climb while exact match collapses (measured on the arithmetic
task: 0.29 -> 0.01 greedy exact match in 40 rollouts). Capping each step reward at 0 is the "Clip"
mechanism of Gao et al. 2024 ("On Designing Effective RL Reward at Training Time for LLM Reasoning"), which
removes the gain from adding steps.

Which reward lands where (stage 3 of the online loop, one call to ``shape_rewards``' dense form):

- the outcome score (reward model and/or reward functions, after the missing-EOS rule and clipping): on the
  response's last trained token, as without a PRM; with no outcome scorer (the PRM alone, as Math-Shepherd's
  step-by-step PPO uses one) the outcome is 0 and the step rewards are the whole reward;
- the PRM's step rewards: on each step-end token of the response (a step that the response cuts off
  without its separator earns nothing);
- ``-kl_coef * kl_t``: on every trained token (unless ``online.kl_in_loss``).

Critic-free estimators sum a response's rewards (outcome supervision of the whole sum); GAE credits each
step's reward to the tokens before it (Wang et al. 2023, Math-Shepherd, use a PRM so in PPO).

Shapes: ``B`` responses, ``P`` prompt columns, ``T`` response columns, ``V`` vocabulary.
"""

from __future__ import annotations

import torch

from rlhfkit.algos.kl import last_valid_index
from rlhfkit.models import token_scores


def step_end_table(tokenizer, separator: str) -> torch.Tensor:
    """``(V,)`` bool: True for the ids whose text ends with ``separator`` (special tokens never)."""
    if not separator:
        raise ValueError("the step separator must not be empty")
    special = set(tokenizer.all_special_ids)
    size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    table = torch.zeros(size, dtype=torch.bool)
    for token_id in range(size):
        if token_id not in special and tokenizer.decode([token_id]).endswith(separator):
            table[token_id] = True
    return table


def step_ends(response_ids: torch.Tensor, mask: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool: the step-end tokens of the responses (``table`` from :func:`step_end_table`), only where
    ``mask``; junk ids at masked positions are never looked up."""
    ids = response_ids.masked_fill(~mask.bool(), 0).clamp(0, len(table) - 1)
    return table.to(ids.device)[ids] & mask.bool()


@torch.no_grad()
def process_rewards(
    prm: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    ends: torch.Tensor,
) -> torch.Tensor:
    """The PRM's step rewards ``sigmoid(logit) - 1`` at ``ends``, 0 elsewhere.

    Args:
        prm: a scalar model from ``rlhfkit train prm`` (its token scores are logits of P(step correct)).
        input_ids, attention_mask: ``(B, P + W)`` left-padded prompts then the responses (right padded,
            ``W`` <= ``T`` columns).
        response_start: ``P``, the column of the first response token.
        ends: ``(B, T)`` bool step ends (:func:`step_ends`).
    Returns:
        ``(B, T)`` float32.
    """
    width = input_ids.shape[1] - response_start
    logits = token_scores(prm, input_ids, attention_mask)[:, response_start:].float()  # (B, W)
    out = torch.zeros(ends.shape, dtype=torch.float32, device=ends.device)
    out[:, :width] = torch.where(ends[:, :width], torch.sigmoid(logits) - 1.0, 0.0)
    return out


def outcome_and_steps(scores: torch.Tensor, dense: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)``: ``dense`` plus each row's outcome ``scores`` ``(B,)`` on its last valid token (a row with
    no valid token gets nothing): the input of ``shape_rewards``' dense form."""
    out = dense.clone()
    last = last_valid_index(mask)  # (B,)
    has = last >= 0
    rows = torch.arange(len(last), device=mask.device)[has]
    return out.index_put((rows, last[has]), scores[has].to(out.dtype), accumulate=True)
