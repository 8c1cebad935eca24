"""compute_gae: hand-computed tensors, the reference loop on random inputs, invariance, edge cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfkit.algos import compute_gae, discounted_cumsum, gae_loop

from .strategies import add_junk, batches

NAN, INF = float("nan"), float("inf")


def close(actual, expected, rel=1e-5):
    """Within rel * (1 + |expected|) everywhere (docs/design.md, "The algorithm core": the accuracy bound)."""
    err = (actual.double() - expected.double()).abs()
    assert bool((err <= rel * (1 + expected.double().abs())).all()), f"max error {err.max().item()}"


# --- tier 1: hand-computed -----------------------------------------------------------------------------
# r = [1, 0, 2], V = [0.5, 1, -1], gamma = lam = 0.5 (so gamma * lam = 0.25):
#   delta_2 = 2 - (-1) = 3                 A_2 = 3
#   delta_1 = 0 + 0.5 * (-1) - 1 = -1.5    A_1 = -1.5 + 0.25 * 3 = -0.75
#   delta_0 = 1 + 0.5 * 1 - 0.5 = 1        A_0 = 1 + 0.25 * (-0.75) = 0.8125
HAND_R, HAND_V = [1.0, 0.0, 2.0], [0.5, 1.0, -1.0]
HAND_A, HAND_RET = [0.8125, -0.75, 3.0], [1.3125, 0.25, 2.0]


def test_hand_computed_full_row():
    adv, ret = compute_gae(torch.tensor([HAND_R]), torch.tensor([HAND_V]), torch.ones(1, 3), 0.5, 0.5)
    assert torch.equal(adv, torch.tensor([HAND_A]))
    assert torch.equal(ret, torch.tensor([HAND_RET]))


def test_reference_loop_hand_computed_with_a_hole():
    """gae_loop, the definition the scan is held to, gives the hand-computed numbers and skips a hole."""
    m = torch.tensor([[1, 0, 1, 1]])
    r, v = torch.tensor([[1.0, NAN, 0.0, 2.0]]), torch.tensor([[0.5, INF, 1.0, -1.0]])
    adv, ret = gae_loop(r, v, m, 0.5, 0.5)
    assert adv.dtype == ret.dtype == torch.float64
    assert torch.equal(adv, torch.tensor([[HAND_A[0], 0.0, *HAND_A[1:]]], dtype=torch.float64))
    assert torch.equal(ret, torch.tensor([[HAND_RET[0], 0.0, *HAND_RET[1:]]], dtype=torch.float64))


@pytest.mark.parametrize(
    "mask",
    [[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 0, 1], [0, 1, 1, 0, 1]],
    ids=["left-pad", "right-pad", "holes", "pad-and-hole"],
)
def test_hand_computed_any_layout(mask):
    """The same three valid steps give the same numbers wherever they sit, masked slots read as junk."""
    m = torch.tensor([mask])
    where = m[0].nonzero().flatten()
    r = torch.full((1, 5), NAN)
    v = torch.full((1, 5), INF)
    r[0, where], v[0, where] = torch.tensor(HAND_R), torch.tensor(HAND_V)
    adv, ret = compute_gae(r, v, m, 0.5, 0.5)
    expected_adv, expected_ret = torch.zeros(1, 5), torch.zeros(1, 5)
    expected_adv[0, where], expected_ret[0, where] = torch.tensor(HAND_A), torch.tensor(HAND_RET)
    assert torch.equal(adv, expected_adv)
    assert torch.equal(ret, expected_ret)


def test_hand_computed_done_cuts_the_episode():
    # done after the middle step: A_1 = delta_1 = 0 + 0 - 1 = -1 (no bootstrap from V_2),
    # A_0 = 1 + 0.5 * 1 - 0.5 + 0.25 * (-1) = 0.75, and the last step starts a new episode: A_2 = 3.
    r, v = torch.tensor([HAND_R]), torch.tensor([HAND_V])
    adv, ret = compute_gae(r, v, torch.ones(1, 3), 0.5, 0.5, dones=torch.tensor([[0, 1, 0]]))
    assert torch.equal(adv, torch.tensor([[0.75, -1.0, 3.0]]))
    assert torch.equal(ret, torch.tensor([[1.25, 0.0, 2.0]]))


def test_hand_computed_lam_zero_is_td_and_lam_one_is_monte_carlo():
    r, v, m = torch.tensor([HAND_R]), torch.tensor([HAND_V]), torch.ones(1, 3)
    td, _ = compute_gae(r, v, m, gamma=0.5, lam=0.0)
    assert torch.equal(td, torch.tensor([[1.0, -1.5, 3.0]]))  # the deltas
    mc, ret = compute_gae(r, v, m, gamma=1.0, lam=1.0)
    assert torch.equal(mc, torch.tensor([[3.0 - 0.5, 2.0 - 1.0, 2.0 + 1.0]]))  # sum of later r, minus V
    assert torch.equal(ret, torch.tensor([[3.0, 2.0, 2.0]]))


def test_discounted_cumsum_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(discounted_cumsum(x, 0.5), torch.tensor([[1 + 0.5 * (2 + 0.5 * 3), 2 + 0.5 * 3, 3.0]]))


# --- tier 2: against the reference loop on random inputs ------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    batch=batches(max_t=100),
    gamma=st.sampled_from([0.0, 0.5, 0.99, 1.0]),
    lam=st.sampled_from([0.0, 0.7, 0.95, 1.0]),
    with_dones=st.booleans(),
)
def test_matches_reference_loop(batch, gamma, lam, with_dones):
    gen, B, T, mask = batch
    r, v = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    dones = (torch.rand(B, T, generator=gen) < 0.15) if with_dones else None
    adv, ret = compute_gae(r, v, mask, gamma, lam, dones)
    ref_adv, ref_ret = gae_loop(r, v, mask, gamma, lam, dones)
    close(adv, ref_adv)
    close(ret, ref_ret)


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 2000), c=st.sampled_from([0.0, 0.3, 0.95, 1.0]), seed=st.integers(0, 2**31 - 1))
def test_discounted_cumsum_matches_loop_across_chunk_levels(L, c, seed):
    x = torch.randn(2, L, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    expected, acc = torch.zeros_like(x), torch.zeros(2, dtype=torch.float64)
    for t in reversed(range(L)):
        acc = x[:, t] + c * acc
        expected[:, t] = acc
    torch.testing.assert_close(discounted_cumsum(x, c), expected, rtol=1e-12, atol=1e-9)


# --- tier 3: invariance to what is stored at masked positions -------------------------------------------
@settings(max_examples=30, deadline=None)
@given(batch=batches(), with_dones=st.booleans())
def test_junk_at_masked_positions_changes_nothing(batch, with_dones):
    gen, B, T, mask = batch
    r, v = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    dones = (torch.rand(B, T, generator=gen) < 0.2).float() if with_dones else None
    clean = compute_gae(r, v, mask, 1.0, 0.95, dones)
    junk_dones = None if dones is None else add_junk(gen, dones, mask)
    dirty = compute_gae(add_junk(gen, r, mask), add_junk(gen, v, mask), mask, 1.0, 0.95, junk_dones)
    for a, b in zip(clean, dirty, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a[~mask], torch.zeros_like(a[~mask]))  # masked outputs are exactly 0


def test_mask_dtypes_agree():
    gen = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 9, generator=gen), torch.randn(3, 9, generator=gen)
    m = torch.rand(3, 9, generator=gen) < 0.6
    expected = compute_gae(r, v, m)
    for as_type in (torch.float32, torch.int64, torch.uint8):
        for a, b in zip(compute_gae(r, v, m.to(as_type)), expected, strict=True):
            assert torch.equal(a, b)


# --- tier 4: edge cases ----------------------------------------------------------------------------------
def test_one_token_rows_and_fully_masked_rows():
    r = torch.tensor([[5.0, NAN], [NAN, 2.0], [NAN, NAN]])
    v = torch.tensor([[1.0, NAN], [NAN, 4.0], [INF, NAN]])
    m = torch.tensor([[1, 0], [0, 1], [0, 0]])
    adv, ret = compute_gae(r, v, m)
    assert torch.equal(adv, torch.tensor([[4.0, 0.0], [0.0, -2.0], [0.0, 0.0]]))
    assert torch.equal(ret, torch.tensor([[5.0, 0.0], [0.0, 2.0], [0.0, 0.0]]))
    adv, ret = compute_gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert not adv.any() and not ret.any()


@pytest.mark.parametrize("lam", [0.95, 1.0])
@pytest.mark.parametrize("with_holes", [False, True])
def test_long_rows_t8192_within_bound_of_float64_loop(lam, with_holes):
    gen = torch.Generator().manual_seed(1)
    B, T = 2, 8192
    r = torch.randn(B, T, generator=gen) * 0.1
    r[:, -1] += 3.0  # a sequence score at the end, as in RLHF
    v = torch.randn(B, T, generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :100] = False  # left padding
    if with_holes:
        mask &= torch.rand(B, T, generator=gen) < 0.9
    dones = (torch.rand(B, T, generator=gen) < 0.001) if with_holes else None
    adv, ret = compute_gae(r, v, mask, 1.0, lam, dones)
    ref_adv, ref_ret = gae_loop(r, v, mask, 1.0, lam, dones)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_dtypes():
    r, v, m = torch.randn(2, 4), torch.randn(2, 4), torch.ones(2, 4)
    assert compute_gae(r, v, m)[0].dtype == torch.float32
    assert compute_gae(r, v, m, lam=1.0)[0].dtype == torch.float32  # float64 inside, float32 out
    assert compute_gae(r.double(), v, m)[0].dtype == torch.float64
    assert compute_gae(r.bfloat16(), v.bfloat16(), m)[0].dtype == torch.float32


def test_empty_time_axis():
    adv, ret = compute_gae(torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(3, 0))
    assert adv.shape == ret.shape == (3, 0)


# --- errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rewards", "values"])
@pytest.mark.parametrize("bad", [NAN, INF])
def test_nonfinite_at_valid_position_raises(name, bad):
    r, v, m = torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4)
    {"rewards": r, "values": v}[name][1, 2] = bad
    with pytest.raises(ValueError, match=rf"{name} has NaN/inf .* row 1, position 2"):
        compute_gae(r, v, m)


def test_bad_arguments_raise():
    r = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="values"):
        compute_gae(r, torch.zeros(2, 5), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        compute_gae(torch.zeros(4), torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="lam"):
        compute_gae(r, r, torch.ones(2, 4), lam=1.5)
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(r, r, torch.ones(2, 4), gamma=-0.1)
