"""rlhfkit's own draw of a token from processed probabilities (``online.sampler: exact``), and the per-row
random streams it reads its uniforms from.

- :func:`stream_uniforms`: one 53-bit uniform per row, a stateless hash of (seed, prompt index, sample index,
  position): counter-based, as vLLM's and SGLang's per-request generators, so that a row's tokens depend on
  neither the batch it is drawn in, nor how many calls, micro-batches, processes or threads draw the rollout.
  The hash is SplitMix64's finaliser (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number
  generators"; the constants of ``java.util.SplittableRandom``), chained over the four numbers, in int64
  tensor arithmetic (which wraps modulo 2^64, as the unsigned original does).
- :func:`inverse_cdf_draw`: the token whose interval of the cumulative distribution holds ``u * total``, by a
  two-level inverse CDF accumulated in float64: the sums of blocks of :data:`BLOCK` entries, the block that
  holds the target, then the cumulative sum inside that block only. Exact in distribution: a token's
  probability is its interval's length over ``total``, within ~1e-16 of ``p / sum(p)`` per token (an fp32
  cumulative sum is off by ~1e-4 in total variation at 49,152 entries and cannot draw a token below 2^-24; an
  fp64 cumulative sum over the whole row is 3-6x slower). docs/performance.md, "The draw".
- :func:`draw_intervals`: the length of every token's interval, as :func:`inverse_cdf_draw` lays them out (what
  the exactness tests compare with the probabilities).

Every entry > 0 is drawable: entries below :data:`FLOOR` (2^-50 of a row that sums to 1) are raised to it, so
that each holds several of the 2^53 uniforms; the total variation this costs is at most ``V * FLOOR`` (4e-11 at
49,152 entries). An entry equal to 0 (a suppressed or truncated token) is never drawn.

Shapes: ``B`` rows, ``V`` vocabulary.
"""

from __future__ import annotations

import torch

SAMPLER_VERSION = 1  # of the exact sampler's draw and streams: a change of either gives other tokens
BLOCK = 256  # entries per block of the two-level inverse CDF
FLOOR = 2.0**-50  # the least weight of an entry > 0 (module docstring)
_CHUNK = 32 * BLOCK  # columns floored and summed at a time (a multiple of BLOCK)
_TOTAL_TOLERANCE = 1e-3  # how far a row's sum may be from 1 (a float32 softmax is within ~1e-6)

# SplitMix64's increment and multipliers as signed int64 (the same 64 bits as the unsigned constants)
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def sampler_record(name: str) -> dict[str, str | int]:
    """What a run records of its sampler (``config.yaml``'s run line, ``summary.json``): ``exact`` with
    :data:`SAMPLER_VERSION`, or ``multinomial`` with the torch version whose ``torch.multinomial`` drew."""
    return {"name": name, "version": SAMPLER_VERSION if name == "exact" else f"torch {torch.__version__}"}


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's step: the increment, then the finaliser (a bijection of the 64 bits)."""
    z = x + _GAMMA
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def stream_uniforms(
    seed: int, prompt_index: torch.Tensor, sample_index: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """The uniform of each row's draw at ``position``: a hash of (seed, prompt index, sample index, position).

    Args:
        seed: the stream's seed (any int; taken modulo 2^64).
        prompt_index: (B,) long, the row's prompt.
        sample_index: (B,) long, the row's sample of that prompt.
        position: (B,) long, the drawn token's position in its row.
    Returns:
        (B,) float64 in [0, 1), a multiple of 2^-53 (the top 53 bits of the hash).
    """
    seed = (int(seed) + 2**63) % 2**64 - 2**63  # the same 64 bits as a signed int64
    h = _splitmix(torch.full_like(prompt_index, seed, dtype=torch.long))
    for part in (prompt_index, sample_index, position):
        h = _splitmix(h ^ part.long())
    return _shift_right(h, 11).double() * 2.0**-53


def _floored(probs: torch.Tensor) -> torch.Tensor:
    """``probs`` with its entries > 0 raised to :data:`FLOOR` (0 stays 0), same shape and dtype."""
    return torch.maximum(probs, probs.sign().mul_(FLOOR))


def _block_edges(probs: torch.Tensor) -> torch.Tensor:
    """(B, N) float64: the cumulative sums of the floored weights' blocks of :data:`BLOCK` entries,
    N = ceil(V / BLOCK) (the last block may be short). Computed on column chunks of :data:`_CHUNK` entries, so
    that no float64 (or floored) copy of the whole (B, V) tensor is made: on a CPU such copies cost more than
    the sums (the allocator pages them in afresh at every step)."""
    batch, vocab = probs.shape
    full = vocab // BLOCK * BLOCK
    sums = torch.empty(batch, -(-vocab // BLOCK), dtype=torch.float64, device=probs.device)  # (B, N)
    for start in range(0, full, _CHUNK):
        stop = min(start + _CHUNK, full)
        chunk = _floored(probs[:, start:stop]).view(batch, -1, BLOCK)  # (B, n, BLOCK)
        sums[:, start // BLOCK : stop // BLOCK] = chunk.sum(-1, dtype=torch.float64)
    if full < vocab:
        sums[:, -1] = _floored(probs[:, full:]).sum(-1, dtype=torch.float64)
    edges = sums.cumsum(-1)  # (B, N)
    total = edges[:, -1]
    if not bool(((total - 1).abs() <= _TOTAL_TOLERANCE).all()):  # also NaN / inf
        raise ValueError(f"each row of probs must be probabilities summing to 1, got sums {total.tolist()}")
    return edges


def _block_cumsum(probs: torch.Tensor, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inner, columns): the float64 cumulative sum of the floored weights of block ``block`` of each row
    ((B, BLOCK), columns past V weigh 0) and the columns it covers ((B, BLOCK) long, clamped into the
    vocabulary)."""
    vocab = probs.shape[1]
    columns = block[:, None] * BLOCK + torch.arange(BLOCK, device=probs.device)  # (B, BLOCK)
    inside = columns < vocab
    columns = columns.clamp(max=vocab - 1)
    values = _floored(probs.gather(1, columns)).double() * inside  # (B, BLOCK)
    return values.cumsum(-1), columns


def inverse_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row: the one whose interval holds ``uniforms * total`` (module docstring).

    A token's interval inside its block is ``[inner[j - 1], inner[j])`` of the block's float64 cumulative
    sum, moved to the block's start ``edges[b - 1]``; the block's last token > 0 also takes the (rounding-sized)
    rest of the block's range, so that a target past ``inner``'s last value never lands on a token of weight 0.

    Args:
        probs: (B, V) float32 (or float64) probabilities, each row summing to 1 (within 1e-3); 0 = never drawn.
        uniforms: (B,) float64 in [0, 1) (:func:`stream_uniforms`).
    Returns:
        (B,) long token ids.
    """
    edges = _block_edges(probs)  # (B, N)
    total = edges[:, -1]  # (B,)
    target = (uniforms.double() * total).unsqueeze(1)  # (B, 1) in [0, total)
    block = torch.searchsorted(edges, target, right=True)  # (B, 1): edges[b - 1] <= target < edges[b]
    nonempty = torch.cat([edges[:, :1] > 0, edges[:, 1:] > edges[:, :-1]], dim=1)  # (B, N)
    last_block = _last_true(nonempty)  # (B,) a target at total (by rounding) takes the last block > 0
    block = torch.minimum(block.squeeze(1), last_block)  # (B,)
    below = torch.where(block > 0, edges.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    inner, columns = _block_cumsum(probs, block)  # (B, BLOCK)
    rest = (target.squeeze(1) - below).clamp(min=0)  # (B,)
    j = torch.searchsorted(inner, rest[:, None], right=True).squeeze(1)  # (B,)
    positive = torch.cat([inner[:, :1] > 0, inner[:, 1:] > inner[:, :-1]], dim=1)  # (B, BLOCK)
    j = torch.minimum(j, _last_true(positive))
    return columns.gather(1, j[:, None]).squeeze(1)


def _last_true(flags: torch.Tensor) -> torch.Tensor:
    """(B,) the last column where ``flags`` (B, N) is True (0 where none is)."""
    steps = torch.arange(flags.shape[1], device=flags.device)
    return torch.where(flags, steps, 0).amax(dim=1)


def draw_intervals(probs: torch.Tensor) -> torch.Tensor:
    """The probability :func:`inverse_cdf_draw` gives each token: its interval's length over the row's total,
    from the same float64 boundaries (blocks' edges, each block's cumulative sum; the rest of a block's range
    to its last token > 0). For tests and checks: it builds every block's cumulative sum.

    Args:
        probs: (B, V), as :func:`inverse_cdf_draw` takes them.
    Returns:
        (B, V) float64, each row summing to 1.
    """
    edges = _block_edges(probs)
    weights = _floored(probs)
    batch, vocab = weights.shape
    blocks = edges.shape[1]
    starts = torch.cat([torch.zeros_like(edges[:, :1]), edges[:, :-1]], dim=1)  # (B, N)
    padded = torch.zeros(batch, blocks * BLOCK, dtype=torch.float64, device=probs.device)
    padded[:, :vocab] = weights.double()
    inner = padded.view(batch, blocks, BLOCK).cumsum(-1)  # (B, N, BLOCK)
    width = (edges - starts)[..., None]  # (B, N, 1): the block's range of targets
    # A target t in the block picks the first j with inner[j] > t - start, capped at the block's last token > 0,
    # which also takes the rest of the block's range.
    hi = torch.minimum(inner, width)
    lo = torch.cat([torch.zeros_like(hi[..., :1]), hi[..., :-1]], dim=-1)
    positive = torch.cat([inner[..., :1] > 0, inner[..., 1:] > inner[..., :-1]], dim=-1)  # (B, N, BLOCK)
    last = _last_true(positive.view(batch * blocks, BLOCK)).view(batch, blocks, 1)
    at = torch.arange(BLOCK, device=probs.device)
    lengths = torch.where(at > last, 0.0, torch.where(at == last, width - lo, hi - lo))  # (B, N, BLOCK)
    lengths = lengths.reshape(batch, -1)[:, :vocab]  # (B, V)
    return lengths / edges[:, -1:]
