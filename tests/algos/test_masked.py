"""Masked statistics and aggregate_loss: hand-computed values, reference loops, invariance, and the
gradient of one batch equal to the gradient summed over its micro-batches, in every mode."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfkit.algos import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    explained_variance,
    loss_normalizer,
    masked_mean,
    masked_var,
    masked_whiten,
)

from .strategies import add_junk, batches

NAN = float("nan")


# --- hand-computed -------------------------------------------------------------------------------------
def test_masked_stats_by_hand():
    x = torch.tensor([[1.0, 2.0, NAN], [3.0, NAN, 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_mean(x, m).item() == 3.0
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([1.5, 4.5]))
    # values 1, 2, 3, 6: mean 3, squared deviations 4 + 1 + 0 + 9 = 14; Bessel: 14 / 3
    assert masked_var(x, m).item() == pytest.approx(14 / 3)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(14 / 4)
    w = masked_whiten(x, m, eps=0.0)
    expected = torch.tensor([[-2.0, -1.0, 0.0], [0.0, 0.0, 3.0]]) / math.sqrt(14 / 3)
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(
        masked_whiten(x, m, shift_mean=False, eps=0.0), torch.where(m.bool(), expected + 3.0, 0.0)
    )


def test_masked_stats_degenerate():
    one = torch.tensor([[5.0, NAN]])
    m = torch.tensor([[1, 0]])
    assert masked_var(one, m).item() == 0.0
    assert masked_whiten(one, m).tolist() == [[0.0, 0.0]]  # one valid token: 0, not NaN
    none = torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(torch.full((2, 3), NAN), none).item() == 0.0
    assert masked_var(torch.full((2, 3), NAN), none).item() == 0.0
    assert not masked_whiten(torch.full((2, 3), NAN), none).any()


def test_aggregate_loss_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN]])
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert aggregate_loss(loss, m, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate_loss(loss, m, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert aggregate_loss(loss, m, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 4))
    assert aggregate_loss(loss, m, "seq-mean-token-sum-norm", max_length=10).item() == pytest.approx(10 / 20)
    assert aggregate_loss(loss, m, "token-mean", normalizer=8).item() == pytest.approx(10 / 8)
    assert loss_normalizer(m, "token-mean").item() == 4
    assert loss_normalizer(m, "seq-mean-token-mean").item() == 2
    assert aggregate_loss(torch.full((2, 3), NAN), torch.zeros(2, 3), "token-mean").item() == 0.0


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(torch.zeros(1, 2), torch.ones(1, 2), "mean")


# --- against reference loops ---------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(batch=batches(max_t=30))
def test_masked_stats_match_loops_and_ignore_junk(batch):
    gen, B, T, mask = batch
    x = torch.randn(B, T, generator=gen, dtype=torch.float64)
    vals = [x[b, t].item() for b in range(B) for t in range(T) if mask[b, t]]
    n = len(vals)
    mean = sum(vals) / n if n else 0.0
    var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
    assert masked_mean(x, mask).item() == pytest.approx(mean, abs=1e-12)
    assert masked_var(x, mask).item() == pytest.approx(var, abs=1e-12)
    w = masked_whiten(x, mask)
    for b in range(B):
        for t in range(T):
            expected = (x[b, t].item() - mean) / math.sqrt(var + 1e-8) if mask[b, t] else 0.0
            assert w[b, t].item() == pytest.approx(expected, abs=1e-9)
    rows = [[x[b, t].item() for t in range(T) if mask[b, t]] for b in range(B)]
    n_seq = sum(1 for row in rows if row)
    by_loop = {
        "token-mean": sum(vals) / max(n, 1),
        "seq-mean-token-mean": sum(sum(row) / len(row) for row in rows if row) / max(n_seq, 1),
        "seq-mean-token-sum-norm": sum(vals) / (max(n_seq, 1) * T),
    }
    for mode, expected in by_loop.items():
        assert aggregate_loss(x, mask, mode).item() == pytest.approx(expected, abs=1e-12)
    junk = add_junk(gen, x, mask)
    assert torch.equal(masked_mean(junk, mask), masked_mean(x, mask))
    assert torch.equal(masked_var(junk, mask), masked_var(x, mask))
    assert torch.equal(masked_whiten(junk, mask), w)
    for mode in LOSS_AGGREGATIONS:
        assert torch.equal(aggregate_loss(junk, mask, mode), aggregate_loss(x, mask, mode))


# --- gradient accumulation / data parallelism do not change the gradient --------------------------------
def _per_token_loss(weight: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """A toy differentiable per-token loss (B, T) from features (B, T, 3)."""
    return torch.tanh(features @ weight) ** 2 + features[..., 0] * weight[0]


@settings(max_examples=25, deadline=None)
@given(batch=batches(max_b=8, max_t=12), mode=st.sampled_from(LOSS_AGGREGATIONS), n_micro=st.integers(1, 4))
def test_micro_batches_with_the_whole_batch_normalizer_give_the_same_gradient(batch, mode, n_micro):
    gen, B, T, mask = batch
    features = torch.randn(B, T, 3, generator=gen, dtype=torch.float64)
    weight = torch.randn(3, generator=gen, dtype=torch.float64)

    w_whole = weight.clone().requires_grad_()
    whole = aggregate_loss(_per_token_loss(w_whole, features), mask, mode, max_length=T)
    whole.backward()

    # micro-batches (or processes): each sums its share, all with the whole minibatch's normaliser
    normalizer = loss_normalizer(mask, mode)
    w_micro = weight.clone().requires_grad_()
    total = 0.0
    for rows in torch.arange(B).tensor_split(n_micro):
        part = aggregate_loss(
            _per_token_loss(w_micro, features[rows]), mask[rows], mode, normalizer, max_length=T
        )
        part.backward()  # gradients accumulate in .grad, as under gradient accumulation
        total += part.item()
    assert total == pytest.approx(whole.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(w_micro.grad, w_whole.grad, rtol=1e-12, atol=1e-12)


def test_per_micro_batch_normalizer_would_change_the_gradient():
    """The failure the explicit normaliser prevents: uneven micro-batches, each normalised on its own."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    features = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weight = torch.ones(3, dtype=torch.float64, requires_grad=True)
    aggregate_loss(_per_token_loss(weight, features), mask, "token-mean").backward()
    whole = weight.grad.clone()
    weight.grad = None
    for rows in ([0], [1]):
        (aggregate_loss(_per_token_loss(weight, features[rows]), mask[rows], "token-mean") / 2).backward()
    assert not torch.allclose(weight.grad, whole)


# --- explained variance ----------------------------------------------------------------------------------
def test_explained_variance_by_hand_and_against_numpy_on_the_valid_tokens():
    values = torch.tensor([[1.0, 2.0, 9.0], [0.0, 4.0, -3.0]])
    returns = torch.tensor([[1.0, 3.0, 0.0], [2.0, 4.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # valid returns 1, 3, 2, 4: var 1.25; residuals 0, 1, 2, 0: mean 0.75, var 0.6875
    assert explained_variance(values, returns, mask).item() == pytest.approx(1 - 0.6875 / 1.25)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        v, r = torch.randn(4, 7, generator=gen), torch.randn(4, 7, generator=gen)
        m = torch.rand(4, 7, generator=gen) > 0.3
        rv, vv = r[m].double().numpy(), v[m].double().numpy()
        expected = 1 - np.var(rv - vv) / np.var(rv)
        got = explained_variance(add_junk(gen, v, m), add_junk(gen, r, m), m)
        assert got.item() == pytest.approx(expected, rel=1e-9)
    # A perfect critic explains everything; the returns' mean explains nothing; constant returns: undefined.
    assert explained_variance(returns, returns, mask).item() == 1.0
    mean = torch.full_like(returns, 2.5)
    assert explained_variance(mean, returns, mask).item() == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(explained_variance(values, torch.ones_like(returns), mask).item())


def test_explained_variance_of_two_shards_with_all_sum_is_that_of_the_whole_batch():
    gen = torch.Generator().manual_seed(4)
    v, r = torch.randn(6, 5, generator=gen), torch.randn(6, 5, generator=gen)
    m = torch.rand(6, 5, generator=gen) > 0.2
    shards = [(v[:3], r[:3], m[:3]), (v[3:], r[3:], m[3:])]
    captured = []

    def all_sum(moments):  # stands in for the all-reduce: the other shard's moments are added
        captured.append(moments)
        return moments + other

    other = torch.zeros(5, dtype=torch.float64)
    explained_variance(*shards[1], all_sum=all_sum)
    other = captured[-1]
    assert explained_variance(*shards[0], all_sum=all_sum).item() == pytest.approx(
        explained_variance(v, r, m).item(), rel=1e-12
    )
