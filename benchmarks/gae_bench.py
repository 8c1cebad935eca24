"""Benchmark: ``rlhfkit.algos.compute_gae`` against the two loops it replaces.

Compared, on the same float32 inputs (B rows, T steps):

* ``compute_gae`` from rlhfkit (docs/design.md, "The algorithm core");
* a per-time-step torch loop over the batch, the form most RLHF libraries ship:
  ``for t in reversed(range(T))``, a few vector operations per step over the B rows. On contiguous
  (right-padded) masks it is TRL's ``PPOTrainer`` form (padding zeroed, plain recursion: the cheapest
  loop, so the least flattering speed-up); on general masks, masked steps are skipped by carrying the
  next value and advantage through them (verl's ``compute_gae_advantage_return``), with ``dones``;
* the textbook's per-sequence numpy loop (Schulman et al. 2016, eq. 16, as written in Sutton & Barto
  style code): for each row, a Python loop over its valid tokens, in float64. It is the reference for
  the agreement check.

Before any timing, all three must agree on the valid tokens within 1e-4 * (1 + |A|) (the float32
loops drift a little from the float64 reference at long T). Masks are either contiguous (right padding
with random lengths, the common RLHF case, no ``dones``) or general (random left/right padding, ~10%
holes inside the valid span, ``dones`` on ~2% of the tokens).

Run (figures depend on the machine's load; the thread count is printed with the table)::

    python benchmarks/gae_bench.py                 # one torch thread, gamma 1, lam 0.95
    python benchmarks/gae_bench.py --threads 2 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from rlhfkit.algos import compute_gae

SIZES = [(64, 128), (64, 1024), (64, 4096), (512, 128), (512, 1024), (512, 4096)]


def gae_torch_loop_right_padded(rewards, values, mask, gamma, lam):
    """The per-time-step loop as TRL's ``PPOTrainer`` writes it: right padding only, no dones.

    Padding is zeroed first, so past a row's end delta = 0 and A = 0; the advantages are then masked.
    rewards, values, mask (B, T) -> advantages (B, T).
    """
    T = rewards.shape[1]
    rewards, values = rewards.masked_fill(~mask, 0.0), values.masked_fill(~mask, 0.0)
    last_gae = 0.0
    reversed_advantages = []
    for t in reversed(range(T)):
        next_values = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        reversed_advantages.append(last_gae)
    return torch.stack(reversed_advantages[::-1], dim=1).masked_fill(~mask, 0.0)


def gae_torch_loop(rewards, values, mask, gamma, lam, dones=None):
    """The per-time-step loop with holes and dones (verl's carry form). (B, T) -> advantages (B, T)."""
    B, T = rewards.shape
    m = mask.to(rewards.dtype)
    not_done = torch.ones_like(rewards) if dones is None else 1.0 - dones.to(rewards.dtype)
    next_values = torch.zeros(B, dtype=rewards.dtype)
    last_gae = torch.zeros(B, dtype=rewards.dtype)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * not_done[:, t] * next_values - values[:, t]
        gae = delta + gamma * lam * not_done[:, t] * last_gae
        # A masked step passes the next valid step's value and advantage through unchanged.
        next_values = m[:, t] * values[:, t] + (1.0 - m[:, t]) * next_values
        last_gae = m[:, t] * gae + (1.0 - m[:, t]) * last_gae
        advantages[:, t] = m[:, t] * gae
    return advantages


def gae_numpy_per_sequence(rewards, values, mask, gamma, lam, dones=None):
    """The textbook loop, one row at a time over its valid tokens, float64. numpy (B, T) -> (B, T)."""
    advantages = np.zeros(rewards.shape, dtype=np.float64)
    for b in range(rewards.shape[0]):
        idx = np.flatnonzero(mask[b])
        r = rewards[b, idx].astype(np.float64)
        v = values[b, idx].astype(np.float64)
        d = np.zeros(len(idx)) if dones is None else dones[b, idx].astype(np.float64)
        adv = np.zeros(len(idx))
        last_gae, next_value = 0.0, 0.0
        for t in reversed(range(len(idx))):
            delta = r[t] + gamma * next_value * (1.0 - d[t]) - v[t]
            last_gae = delta + gamma * lam * (1.0 - d[t]) * last_gae
            adv[t] = last_gae
            next_value = v[t]
        advantages[b, idx] = adv
    return advantages


def make_inputs(B: int, T: int, general: bool, gen: torch.Generator):
    """Random rewards/values (B, T) float32, a mask (B, T) bool, and dones (B, T) (None if contiguous).

    Masked positions hold large junk, so that a path that reads them shows up in the agreement check.
    """
    rewards = torch.randn(B, T, generator=gen)
    values = torch.randn(B, T, generator=gen)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    pos = torch.arange(T)
    if not general:
        mask = pos < lengths[:, None]
        dones = None
    else:
        left = torch.rand(B, generator=gen) < 0.5
        start = torch.where(left, T - lengths, torch.zeros_like(lengths))
        mask = (pos >= start[:, None]) & (pos < (start + lengths)[:, None])
        mask &= torch.rand(B, T, generator=gen) > 0.1
        dones = (torch.rand(B, T, generator=gen) < 0.02).float()
    rewards = torch.where(mask, rewards, torch.full_like(rewards, 1e4))
    values = torch.where(mask, values, torch.full_like(values, -1e4))
    return rewards, values, mask, dones


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` in milliseconds, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def check_agreement(adv: torch.Tensor, ref: np.ndarray, mask: torch.Tensor, name: str) -> float:
    """Max error on valid tokens, relative to 1 + |A|; raise if above 1e-4 or if masked outputs are not 0."""
    ref_t = torch.from_numpy(ref)
    err = ((adv.double() - ref_t).abs() / (1.0 + ref_t.abs()))[mask]
    worst = float(err.max()) if err.numel() else 0.0
    if not worst <= 1e-4:  # also catches NaN
        raise SystemExit(f"{name} disagrees with the float64 reference: max relative error {worst:.2e}")
    if bool(adv[~mask].ne(0).any()):
        raise SystemExit(f"{name} leaves non-zero advantages at masked positions")
    return worst


def bench_case(B, T, general, args, gen) -> dict:
    rewards, values, mask, dones = make_inputs(B, T, general, gen)
    np_in = [x.numpy() for x in (rewards, values, mask)]
    np_dones = None if dones is None else dones.numpy()
    kw = {"gamma": args.gamma, "lam": args.lam}
    ref = gae_numpy_per_sequence(*np_in, dones=np_dones, **kw)
    ours = compute_gae(rewards, values, mask, dones=dones, **kw)[0]
    if general:
        loop_fn = partial(gae_torch_loop, rewards, values, mask, dones=dones, **kw)
    else:
        loop_fn = partial(gae_torch_loop_right_padded, rewards, values, mask, **kw)
    loop = loop_fn()
    row = {
        "err_ours": check_agreement(ours, ref, mask, "compute_gae"),
        "err_loop": check_agreement(loop, ref, mask, "torch loop"),
    }
    row["ours"] = time_ms(lambda: compute_gae(rewards, values, mask, dones=dones, **kw), args.repeats)
    row["loop"] = time_ms(loop_fn, args.repeats)
    if B * T <= args.numpy_max_elements:
        # The Python loop is slow at large B*T: fewer repeats there (the warm-up call is the check above).
        reps = max(1, min(args.repeats, 200_000 // (B * T)))
        row["numpy"] = time_ms(lambda: gae_numpy_per_sequence(*np_in, dones=np_dones, **kw), reps)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compute_gae vs a torch time loop and a numpy per-row loop")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--gamma", type=float, default=1.0, help="discount (RLHF uses 1)")
    parser.add_argument("--lam", type=float, default=0.95, help="GAE lambda")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per cell (median reported)")
    parser.add_argument(
        "--numpy-max-elements",
        type=int,
        default=512 * 1024,
        help="time the numpy loop only up to this B*T (it is still run once as the check)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)

    print(
        f"compute_gae benchmark: torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"gamma={args.gamma}, lam={args.lam}, float32, median of {args.repeats} calls (ms)"
    )
    header = (
        f"{'mask':<12}{'B':>5}{'T':>6} | {'compute_gae':>11}{'torch loop':>11}{'numpy rows':>11} | "
        f"{'x loop':>7}{'x numpy':>8} | {'err ours':>9}{'err loop':>9}"
    )
    print(header)
    print("-" * len(header))
    for general in (False, True):
        for B, T in SIZES:
            row = bench_case(B, T, general, args, gen)
            numpy_ms = f"{row['numpy']:11.2f}" if "numpy" in row else f"{'skipped':>11}"
            x_numpy = f"{row['numpy'] / row['ours']:7.1f}x" if "numpy" in row else f"{'-':>8}"
            print(
                f"{'holes+dones' if general else 'contiguous':<12}{B:>5}{T:>6} | {row['ours']:11.3f}"
                f"{row['loop']:11.2f}{numpy_ms} | {row['loop'] / row['ours']:6.1f}x{x_numpy} | "
                f"{row['err_ours']:9.1e}{row['err_loop']:9.1e}",
                flush=True,
            )
    print(
        f"numpy rows: timed only for B*T <= {args.numpy_max_elements} (fewer repeats above 200k elements). "
        "err: max over valid tokens of |A - A_ref| / (1 + |A_ref|), A_ref = the float64 numpy loop."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
