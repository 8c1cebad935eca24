"""rlhfkit's exact draw (rlhfkit.algos.draw): the probability of every token from the draw's own float64
interval boundaries against the probabilities (total variation <= 1e-9), the token the draw picks for uniforms
fed by hand, tail tokens of 1e-7 to 1e-9 counted over uniforms confined to a window around them (a z-test whose
window comes from an exact sum, not from the draw), masked tokens never drawn over 10^6 draws, every token > 0
drawable, the draw equal to a plain one-level float64 cumulative sum, and the per-row streams against a plain
Python SplitMix64."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from rlhfkit.algos.draw import (
    BLOCK,
    FLOOR,
    draw_intervals,
    inverse_cdf_draw,
    sampler_record,
    stream_uniforms,
)

MASK64 = 2**64 - 1


def splitmix_reference(x: int) -> int:
    """SplitMix64's step on unsigned Python ints (java.util.SplittableRandom's constants)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform_reference(seed: int, prompt: int, sample: int, position: int) -> float:
    h = splitmix_reference(seed % 2**64)
    for part in (prompt, sample, position):
        h = splitmix_reference(h ^ (part % 2**64))
    return (h >> 11) / 2**53


def exact_probabilities(probs: torch.Tensor) -> list[list[float]]:
    """p / sum(p) per row, the sum exact (math.fsum), in float64."""
    rows = probs.double().tolist()
    totals = [math.fsum(row) for row in rows]
    return [[x / total for x in row] for row, total in zip(rows, totals, strict=True)]


def total_variation(probs: torch.Tensor) -> torch.Tensor:
    """(B,) the total variation between the draw's distribution and the probabilities given."""
    reference = torch.tensor(exact_probabilities(probs), dtype=torch.float64)
    return 0.5 * (draw_intervals(probs) - reference).abs().sum(-1)


def softmax_rows(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=g) * scale, -1)  # (rows, vocab) float32


def with_masked(probs: torch.Tensor, masked: list[int]) -> torch.Tensor:
    """``probs`` with ``masked`` columns at exactly 0, renormalised in float32 (as a softmax over -inf gives)."""
    logits = probs.log()
    logits[:, masked] = float("-inf")
    return torch.softmax(logits, -1)


# --- the streams ------------------------------------------------------------------------------------------
def test_stream_uniforms_are_splitmix64_of_seed_prompt_sample_position():
    cases = [(0, 0, 0, 0), (1, 2, 3, 4), (2**63 - 1, 2**40, 7, 511), (-5, 3, 0, 9), (123456789, 0, 1, 2**31)]
    seeds = {c[0] for c in cases}
    for seed in seeds:
        rows = [c for c in cases if c[0] == seed]
        got = stream_uniforms(
            seed,
            torch.tensor([r[1] for r in rows]),
            torch.tensor([r[2] for r in rows]),
            torch.tensor([r[3] for r in rows]),
        )
        assert got.dtype == torch.float64
        assert got.tolist() == [uniform_reference(*r) for r in rows]


def test_stream_uniforms_have_53_bits_and_change_with_each_number():
    n = 4096
    index = torch.arange(n)
    u = stream_uniforms(7, index, torch.zeros_like(index), torch.zeros_like(index))
    assert bool(((u >= 0) & (u < 1)).all())
    assert bool(((u * 2**53) == (u * 2**53).floor()).all())  # multiples of 2^-53
    assert float((u * 2**53 % 2).mean()) == pytest.approx(0.5, abs=0.05)  # the lowest bit is used
    assert abs(float(u.mean()) - 0.5) < 4 * (1 / 12 / n) ** 0.5
    base = stream_uniforms(7, torch.tensor([3]), torch.tensor([1]), torch.tensor([5]))
    for other in [
        stream_uniforms(8, torch.tensor([3]), torch.tensor([1]), torch.tensor([5])),
        stream_uniforms(7, torch.tensor([4]), torch.tensor([1]), torch.tensor([5])),
        stream_uniforms(7, torch.tensor([3]), torch.tensor([0]), torch.tensor([5])),
        stream_uniforms(7, torch.tensor([3]), torch.tensor([1]), torch.tensor([6])),
    ]:
        assert float(other) != float(base)


def test_sampler_record_names_the_draw_and_its_version():
    assert sampler_record("exact") == {"name": "exact", "version": 1}
    assert sampler_record("multinomial") == {"name": "multinomial", "version": f"torch {torch.__version__}"}


# --- exactness ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [2, 3, 17, BLOCK, BLOCK + 1, 3 * BLOCK - 5, 49152, 151936])
def test_total_variation_from_the_draws_own_boundaries_is_below_1e_9(vocab):
    rows = 2 if vocab > 10_000 else 6
    probs = torch.cat(
        [softmax_rows(rows // 2, vocab, 1.0, vocab), softmax_rows(rows // 2, vocab, 6.0, vocab + 1)]
    )
    if vocab > 3:
        probs = with_masked(probs, [0, vocab // 2, vocab - 1])
    assert float(total_variation(probs).max()) <= 1e-9


def test_closed_form_on_a_small_vocabulary_by_hand():
    """Five tokens, one masked: each token's probability from the draw's boundaries is the exact p / sum(p)
    (computed in rationals) to within 1e-15, and the masked token has exactly 0."""
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.125, 0.125]], dtype=torch.float32)
    assert draw_intervals(probs)[0].tolist() == [0.5, 0.0, 0.25, 0.125, 0.125]
    probs = torch.tensor([[0.1, 0.2, 0.0, 0.3, 0.4]], dtype=torch.float32)
    exact = [Fraction(float(x)) for x in probs[0]]
    total = sum(exact)
    for got, want in zip(draw_intervals(probs)[0].tolist(), exact, strict=True):
        assert abs(Fraction(got) - want / total) <= Fraction(1, 10**15)
    assert draw_intervals(probs)[0, 2] == 0


def interval_edges(probs: torch.Tensor) -> torch.Tensor:
    """(B, V + 1) the cumulative sum of :func:`draw_intervals`: token j holds the uniforms in [e[j], e[j + 1])."""
    lengths = draw_intervals(probs)
    return torch.cat([torch.zeros_like(lengths[:, :1]), lengths.cumsum(-1)], dim=1)


def tail_probabilities(vocab: int = 3 * BLOCK - 5) -> tuple[torch.Tensor, list[int]]:
    """One row with tokens of 1e-7, 1e-8, 1e-9 (and a 1e-30 one) placed after heavy tokens: at a block's
    start after a heavy block, inside a block after a token of ~0.4, and in the short last block."""
    probs = torch.full((1, vocab), 1e-6, dtype=torch.float64)
    probs[0, 10] = 0.4  # heavy, in the first block
    probs[0, BLOCK + 3] = 0.3
    tails = {11: 1e-9, BLOCK: 1e-8, BLOCK + 4: 1e-7, 2 * BLOCK + 7: 1e-9, vocab - 1: 1e-8, 40: 1e-30}
    for j, p in tails.items():
        probs[0, j] = p
    probs[0, 100] = 0.0
    probs[0, 100] = 1.0 - float(probs.sum())  # every other entry fixed: the row sums to 1
    return probs.float(), list(tails)


def test_the_draw_picks_the_token_whose_interval_holds_the_uniform():
    """Uniforms fed by hand at the middle of every token's interval (tail tokens of 1e-7 .. 1e-9, tokens either
    side of every block edge) give that token; a token raised to the floor (1e-30) is found among the 2^-53
    grid's uniforms around its place; the ends 0 and 1 - 2^-53 give the first and the last token > 0."""
    for probs in (tail_probabilities()[0], with_masked(softmax_rows(1, 700, 3.0, 0), [0, 255, 256, 699])):
        edges = interval_edges(probs)[0]  # (V + 1,)
        lengths = edges[1:] - edges[:-1]
        drawable = (lengths > 0).nonzero().squeeze(1)
        assert torch.equal(drawable, (probs[0] > 0).nonzero().squeeze(1))  # exactly the tokens > 0
        wide = drawable[lengths[drawable] > 1e-12]  # the cumulative sum here is good to ~1e-15
        middles = (edges[:-1] + lengths / 2)[wide]
        assert torch.equal(inverse_cdf_draw(probs.expand(len(wide), -1), middles), wide)
        for j in drawable[lengths[drawable] <= 1e-12].tolist():
            grid = (edges[j] * 2**53).floor() + torch.arange(-64, 65, dtype=torch.float64)  # (129,)
            assert j in inverse_cdf_draw(probs.expand(len(grid), -1), grid * 2**-53).tolist()
        ends = inverse_cdf_draw(probs.expand(2, -1), torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64))
        assert ends.tolist() == [int(drawable[0]), int(drawable[-1])]


@pytest.mark.parametrize("which", range(5))
def test_z_test_on_tail_tokens_over_uniforms_in_a_window_around_them(which):
    """A tail token j (1e-7 .. 1e-9) sits in [S_j, S_j + p_j), S_j an exact sum of the probabilities before it.
    40,000 stream uniforms confined to a window of width 100 p_j around it must land on j with probability
    1/100 (a z-test, |z| < 4.5): the draw gives each tail token its probability at its place, with no
    boundary taken from the draw itself (uniforms confined to a window stand for the ~10^11 unconfined draws a
    1e-9 token would need). An fp32 cumulative sum (ulp 3e-8 near 0.4) fails it."""
    probs, tails = tail_probabilities()
    j = tails[which]
    exact = [Fraction(float(x)) for x in probs[0].double()]
    total = sum(exact)
    start = sum(exact[:j]) / total
    p = float(exact[j] / total)
    width = 100 * p
    low = min(float(start) + p / 2 - width / 2, 1 - width)  # the token's interval in the window's middle, or
    # at its end for the last token
    n, chunk, hits = 40_000, 20_000, 0
    for first in range(0, n, chunk):
        index = torch.arange(first, first + chunk)
        v = stream_uniforms(which, index, torch.zeros_like(index), torch.zeros_like(index))
        picked = inverse_cdf_draw(probs.expand(chunk, -1), (low + width * v).clamp(max=1 - 2**-53))
        hits += int((picked == j).sum())
    q = p / width
    z = (hits - n * q) / math.sqrt(n * q * (1 - q))
    assert abs(z) < 4.5, (j, p, hits, n * q)


def test_masked_tokens_are_never_drawn_over_a_million_draws():
    """Masked tokens next to heavy ones, at both sides of block edges, a whole masked block and the last
    column: none drawn in 10^6 stream draws, nor at any token boundary fed by hand; the counts of the drawn
    tokens agree with their probabilities."""
    vocab = 2 * BLOCK + 20
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, vocab, generator=g) * 2
    logits[:, 20] = 8.0  # a heavy token with masked neighbours
    masked = [0, 19, 21, *range(BLOCK - 1, 2 * BLOCK + 1), vocab - 1]  # the middle block and its neighbours
    logits[:, masked] = float("-inf")
    probs = torch.softmax(logits, -1)  # (4, V)
    rows, draws = 1000, 1000
    counts = torch.zeros(4, vocab, dtype=torch.long)
    prompt = torch.arange(rows)
    repeated = probs.repeat(rows // 4, 1)  # row r has the distribution of r % 4
    for position in range(draws):
        u = stream_uniforms(11, prompt, torch.zeros_like(prompt), torch.full_like(prompt, position))
        picked = inverse_cdf_draw(repeated, u)
        counts.index_put_((prompt % 4, picked), torch.ones_like(picked), accumulate=True)
    assert int(counts.sum()) == rows * draws
    assert int(counts[:, masked].sum()) == 0
    expected = probs.double() * (rows * draws // 4)
    heavy = expected > 2000
    assert float(((counts - expected).abs() / expected.sqrt())[heavy].max()) < 5
    edges = interval_edges(probs)  # (4, V + 1): every boundary, and one float64 step either side
    for u in (
        edges[:, :-1],
        torch.nextafter(edges[:, :-1], torch.zeros(())),
        torch.nextafter(edges[:, 1:], torch.ones(())),
    ):
        u = u.clamp(max=1 - 2**-53)
        picked = inverse_cdf_draw(probs.repeat_interleave(vocab, 0), u.reshape(-1))
        assert not bool(torch.isin(picked, torch.tensor(masked)).any())


def test_every_token_above_zero_is_drawable_down_to_float32s_least():
    """Tokens of 1e-30 and 1e-45 (float32's least) next to one of ~1 get an interval of at least FLOOR."""
    probs = torch.zeros(1, 2 * BLOCK)
    probs[0, 5], probs[0, 6], probs[0, BLOCK + 1] = 1.0, 1e-30, 1e-45
    lengths = draw_intervals(probs)[0]
    assert float(lengths[6]) >= FLOOR * 0.99 and float(lengths[BLOCK + 1]) >= FLOOR * 0.99
    assert int((lengths > 0).sum()) == 3
    assert abs(float(lengths[5]) - 1) <= 2 * FLOOR


def test_the_draw_equals_a_plain_one_level_float64_cumulative_sum():
    """The two-level draw against the plain loop (one float64 cumulative sum over the floored weights, the
    first index whose sum exceeds u * total) on 500 rows of random distributions and uniforms."""
    probs = torch.cat(
        [softmax_rows(250, 1000, 2.0, 1), with_masked(softmax_rows(250, 1000, 8.0, 2), [3, 500])]
    )
    u = torch.rand(500, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weights = torch.maximum(probs, probs.sign() * FLOOR).double()
    plain = []
    for row, ui in zip(weights.tolist(), u.tolist(), strict=True):
        target, running, pick = ui * math.fsum(row), 0.0, None
        for j, w in enumerate(row):
            running += w
            if w > 0 and running > target:
                pick = j
                break
        plain.append(pick if pick is not None else max(j for j, w in enumerate(row) if w > 0))
    assert inverse_cdf_draw(probs, u).tolist() == plain


def test_rows_that_are_not_probabilities_are_refused():
    with pytest.raises(ValueError, match="summing to 1"):
        inverse_cdf_draw(torch.ones(2, 5), torch.zeros(2, dtype=torch.float64))
    nan = torch.full((1, 4), 0.25)
    nan[0, 1] = float("nan")
    with pytest.raises(ValueError, match="summing to 1"):
        inverse_cdf_draw(nan, torch.zeros(1, dtype=torch.float64))


def test_a_target_past_the_blocks_cumulative_sum_takes_its_last_token_above_zero():
    """A block's range (from the block sums) can end a rounding past its own cumulative sum's last value; a
    uniform in that sliver goes to the block's last token > 0, never to the masked tokens after it. Rows are
    searched (seeds) until the float64 block sum exceeds the cumulative sum, then fed u = 1 - 2^-53."""
    found = 0
    for seed in range(300):
        logits = torch.randn(1, BLOCK, generator=torch.Generator().manual_seed(seed)) * 3
        logits[:, -8:] = float("-inf")  # the block ends with masked tokens
        probs = torch.softmax(logits, -1)
        weights = torch.maximum(probs, probs.sign() * FLOOR).double()
        if float(weights.sum()) <= float(weights.cumsum(-1)[0, -1]):
            continue
        found += 1
        top = torch.tensor([1 - 2**-53, 1 - 2**-52], dtype=torch.float64)
        assert inverse_cdf_draw(probs.expand(2, -1), top).tolist() == [BLOCK - 9, BLOCK - 9]
    assert found > 0
