"""Rows with tool-result gaps (multi-turn episodes): the algorithm core treats the tokens between model turns as
if they were not there. Every figure on a gapped row must equal the same figure on the row with its tool tokens
cut out, whatever junk sits in the gaps (huggingface/trl#5144: tool tokens left in the loss; Flash-RL#19:
non-neutral log-probs at masked positions). A mask that let tool tokens in would make the two differ."""

from __future__ import annotations

import torch

from rlhfkit.algos import (
    aggregate_loss,
    compute_gae,
    gae_loop,
    kl_penalty_loss,
    masked_mean,
    ppo_policy_loss,
    shape_rewards,
    value_loss,
)

# 1 = model token, 0 = tool result / template token, trailing 0s = padding. Rows end on a model token.
MASK = torch.tensor(
    [
        [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
    ],
    dtype=torch.bool,
)


def with_junk(x: torch.Tensor, junk: float) -> torch.Tensor:
    return torch.where(MASK, x, torch.full_like(x, junk))


def compact(x: torch.Tensor) -> torch.Tensor:
    """The model tokens of each row, left aligned and zero padded: the row without its gaps."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        kept = x[i][MASK[i]]
        out[i, : len(kept)] = kept
    return out


def compact_mask() -> torch.Tensor:
    return compact(MASK.long()).bool()


def spread(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`compact` onto MASK's positions (0 in the gaps)."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        out[i][MASK[i]] = x[i, : int(MASK[i].sum())]
    return out


def randn(seed: int) -> torch.Tensor:
    return torch.randn(MASK.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_gae_over_a_gapped_row_equals_gae_over_its_model_tokens_alone():
    rewards, values = randn(0), randn(1)
    for gamma, lam in [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)]:
        advantages, returns = compute_gae(with_junk(rewards, 1e6), with_junk(values, -1e6), MASK, gamma, lam)
        ref_adv, ref_ret = gae_loop(compact(rewards), compact(values), compact_mask(), gamma, lam)
        torch.testing.assert_close(advantages.double(), spread(ref_adv), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(returns.double(), spread(ref_ret), atol=1e-5, rtol=1e-5)


def test_the_score_lands_on_the_last_model_token_and_gaps_get_no_kl():
    logprobs, ref_logprobs = -randn(2).abs(), -randn(3).abs()
    scores = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    rewards, kl = shape_rewards(scores, with_junk(logprobs, 50.0), with_junk(ref_logprobs, -50.0), MASK, 0.1)
    ref_rewards, ref_kl = shape_rewards(scores, compact(logprobs), compact(ref_logprobs), compact_mask(), 0.1)
    torch.testing.assert_close(rewards, spread(ref_rewards))
    torch.testing.assert_close(kl, spread(ref_kl))
    assert rewards[0, 10] == ref_rewards[0, 5]  # the row's last model token holds the score
    assert (rewards[~MASK] == 0).all() and (kl[~MASK] == 0).all()


def test_losses_and_gradients_ignore_whatever_is_in_the_gaps():
    old_logprobs, advantages, ref_logprobs = randn(4) * 0.1 - 1, randn(5), randn(6) * 0.1 - 1
    old_values, returns, entropy = randn(7), randn(8), randn(9).abs()

    def figures(logprobs, values, junk, mask, squeeze):
        """(policy loss, value loss, KL loss, mean entropy) with ``junk`` in the gaps when not ``squeeze``d."""
        fill = compact if squeeze else (lambda x: with_junk(x, junk))
        policy, _ = ppo_policy_loss(logprobs, fill(old_logprobs), fill(advantages), 0.2, mask=mask)
        vloss, _ = value_loss(values, fill(old_values), fill(returns), 0.2, mask=mask)
        kl = kl_penalty_loss(logprobs, fill(ref_logprobs), estimator="k3", mask=mask)
        return (
            aggregate_loss(policy, mask, "token-mean"),
            aggregate_loss(vloss, mask, "seq-mean-token-mean"),
            aggregate_loss(kl, mask, "seq-mean-token-sum-norm", max_length=MASK.shape[1]),
            masked_mean(fill(entropy), mask),
        )

    base_logprobs, base_values = old_logprobs + 0.05 * randn(10), old_values + 0.3 * randn(11)
    grads = []
    for junk, squeeze in [(float("nan"), False), (1e4, False), (0.0, True)]:
        prepare = compact if squeeze else (lambda x, j=junk: with_junk(x, j))
        logprobs = prepare(base_logprobs).requires_grad_()
        values = prepare(base_values).requires_grad_()
        out = figures(logprobs, values, junk, compact_mask() if squeeze else MASK, squeeze)
        sum(out[:3]).backward()
        moved = (lambda g: spread(g)) if squeeze else (lambda g: g)
        grads.append(([f.detach() for f in out], moved(logprobs.grad), moved(values.grad)))
    for figures_, glogprobs, gvalues in grads[:2]:
        assert all(torch.isfinite(f) for f in figures_)
        for a, b in zip(figures_, grads[2][0], strict=True):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(glogprobs, grads[2][1])
        torch.testing.assert_close(gvalues, grads[2][2])
        assert (glogprobs[~MASK] == 0).all() and (gvalues[~MASK] == 0).all()
