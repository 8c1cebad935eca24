"""Reward-model overoptimization on the built-in task, and Gao et al. (2022)'s fit of gold against KL.

PPO with a learning rate high enough (and a KL coefficient small enough) to run far from the SFT policy:
the proxy score (the reward model, what PPO optimises) keeps rising while the gold score (the task's
annotators' own criterion) rises, peaks and falls. On held-out prompts the pipeline's reward-hacking
meter (:class:`rlhfkit.quickstart.pipeline.HackingMeter`) logs gold, proxy and KL (k1, nats per response, at the
training temperature) every ``--eval-every`` rollouts. Then, with d = sqrt(KL) and Δgold = gold minus
the SFT policy's gold (the meter's step-0 value), the script fits Gao, Schulman & Hilton 2022
("Scaling Laws for Reward Model Overoptimization", eq. for RL):

    Δgold(d) = d (α − β log d)          least squares; linear in (α, β): columns d and −d log d

against the linear fit Δgold = a·d, prints α, β, R² and RMSE of both, where the fitted curve peaks
(d* = exp(α/β − 1), Δgold* = β d*, for β > 0) and where the observed gold peaked, and plots the points
with both curves (``fit.png``; numbers in ``fit.json``).

``--refresh-steps K`` also runs the same PPO (same seed, same settings) with the online reward-model
refresh of :mod:`rlhfkit.trainers.online.refresh` every K rollouts, and compares gold, proxy and KL of the two
runs: at the end, and at the same KL (the mean of each run's evaluations in KL bins of 3 nats).
The gap is reported in the proxy's units: the proxy is normalised to std 1 on SFT responses, so gold is
put on the same footing as z = (gold − gold_SFT) / std(gold of SFT samples), and gap = proxy − z (0 for
the SFT policy; it grows when the proxy rises faster than what the annotators want).

Inputs: the SFT policy, the reward model, the prompt splits and (for the refresh) the reward model's
training pairs. Take them from a finished quickstart, name them, or let the script run one first::

    rlhfkit quickstart --out runs/qs                       # ~3 min on 2 idle cores (tiny preset)
    python examples/overoptimization.py --quickstart runs/qs --out runs/overopt
    python examples/overoptimization.py --quickstart runs/qs --out runs/overopt --refresh-steps 5
    python examples/overoptimization.py --sft DIR --reward-model DIR --prompts-train FILE \\
        --prompts-eval FILE --pairs FILE --out runs/overopt
    python examples/overoptimization.py --out runs/overopt --fit-only     # re-fit and re-plot finished runs
    python examples/overoptimization.py --help

A finished PPO run in ``OUT/ppo`` (or ``OUT/ppo-refresh``) is reused, not run again (``--overwrite``
reruns it). One process, CPU; keep ``RLHFKIT_NUM_THREADS=1`` on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

TINY_DEFAULTS = {"rollouts": 60, "learning_rate": 3e-4, "kl_coef": 0.05, "eval_every": 2, "eval_prompts": 128}


# ----------------------------------------------------------------------------------------------------------
# The fit (pure numpy)


def fit_gao(d, delta) -> dict[str, float]:
    """Least-squares fits of Δgold(d) = d (α − β log d) and of Δgold = a d, with their quality.

    Args:
        d: (N,) sqrt(KL) of each evaluation, > 0 (points at d = 0 carry no information and are refused).
        delta: (N,) gold minus the SFT policy's gold.
    Returns:
        ``alpha``, ``beta``, ``r2``, ``rmse`` (the Gao form), ``linear_a``, ``linear_r2``, ``linear_rmse``,
        ``points``, and, when β > 0, ``d_peak`` = exp(α/β − 1), ``kl_peak`` = d_peak², ``delta_peak`` = β d_peak
        (else None: the fitted curve has no interior maximum, or one beyond float range).
    """
    d, delta = np.asarray(d, dtype=np.float64), np.asarray(delta, dtype=np.float64)
    if d.shape != delta.shape or d.ndim != 1:
        raise ValueError(f"d and delta must be two 1-D arrays of one length, got {d.shape} and {delta.shape}")
    if len(d) < 3 or not np.all(d > 0) or not np.all(np.isfinite(delta)):
        raise ValueError("the fit needs at least 3 points, each with d > 0 and a finite Δgold")
    design = np.stack([d, -d * np.log(d)], axis=1)  # (N, 2): Δ = α d − β d log d
    (alpha, beta), *_ = np.linalg.lstsq(design, delta, rcond=None)
    a = float(d @ delta / (d @ d))  # Δ = a d
    out = {"alpha": float(alpha), "beta": float(beta), "linear_a": a, "points": int(len(d))}
    out.update(_quality(delta, design @ np.array([alpha, beta]), ""))
    out.update(_quality(delta, a * d, "linear_"))
    out["d_peak"] = out["kl_peak"] = out["delta_peak"] = None
    if beta > 0:
        try:  # d(α − β log d) has its maximum where α − β log d − β = 0
            d_peak = math.exp(alpha / beta - 1.0)
            out.update({"d_peak": d_peak, "kl_peak": d_peak**2, "delta_peak": float(beta * d_peak)})
        except OverflowError:  # β ~ 0: a straight line, no peak in range
            pass
    return out


def _quality(y: np.ndarray, fitted: np.ndarray, prefix: str) -> dict[str, float]:
    residual = float(((y - fitted) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    return {
        f"{prefix}r2": 1.0 - residual / total if total > 0 else float("nan"),
        f"{prefix}rmse": math.sqrt(residual / len(y)),
    }


def gao_curve(d, alpha: float, beta: float) -> np.ndarray:
    """d (α − β log d), with the limit 0 at d = 0."""
    d = np.asarray(d, dtype=np.float64)
    safe = np.where(d > 0, d, 1.0)
    return np.where(d > 0, d * (alpha - beta * np.log(safe)), 0.0)


# ----------------------------------------------------------------------------------------------------------
# Trajectories from metrics.jsonl


@dataclass
class Trajectory:
    """The meter's held-out evaluations of one run, in step order (step 0 = the SFT policy)."""

    steps: np.ndarray
    kl: np.ndarray
    gold: np.ndarray
    proxy: np.ndarray

    @property
    def d(self) -> np.ndarray:
        return np.sqrt(np.clip(self.kl, 0.0, None))

    @classmethod
    def from_rows(cls, rows: list[dict]) -> Trajectory:
        keys = ("eval/kl/mean", "eval/gold/mean", "eval/score/mean")
        picked = [r for r in rows if all(isinstance(r.get(k), int | float) for k in keys)]
        if not picked or picked[0]["step"] != 0:
            raise ValueError(
                "the run has no held-out evaluation at step 0 (the SFT policy's gold is the baseline)"
            )

        def col(k):
            return np.array([float(r[k]) for r in picked])

        return cls(col("step"), col(keys[0]), col(keys[1]), col(keys[2]))

    def in_kl_bin(self, low: float, high: float) -> dict | None:
        """Mean gold and proxy of the evaluations after step 0 with low <= KL < high (and how many), or None."""
        inside = (self.steps > 0) & (self.kl >= low) & (self.kl < high)
        if not inside.any():
            return None
        return {
            "gold": float(self.gold[inside].mean()),
            "proxy": float(self.proxy[inside].mean()),
            "n": int(inside.sum()),
        }


def analyse(t: Trajectory) -> dict:
    """The Gao fit of one run, with its observed peak."""
    delta = t.gold - t.gold[0]
    moved = t.d > 0
    fit = fit_gao(t.d[moved], delta[moved])  # the SFT point (d = 0) is on every curve of the form
    best = int(np.argmax(t.gold))
    fit.update(
        {
            "sft_gold": float(t.gold[0]),
            "observed_peak": {
                "step": int(t.steps[best]),
                "kl": float(t.kl[best]),
                "d": float(t.d[best]),
                "gold": float(t.gold[best]),
                "delta": float(delta[best]),
            },
            "final": {
                "step": int(t.steps[-1]),
                "kl": float(t.kl[-1]),
                "gold": float(t.gold[-1]),
                "proxy": float(t.proxy[-1]),
            },
        }
    )
    return fit


def compare(plain: Trajectory, refreshed: Trajectory, gold_std: float, bin_width: float = 3.0) -> dict:
    """Gold, proxy and the gap (proxy − (gold − gold_SFT) / gold_std) of both runs at the end, and at the same KL:
    the means over each run's evaluations in KL bins of ``bin_width`` nats (a trajectory's KL goes up and
    down, so every evaluation counts, not only the first to reach a level)."""

    def gap(gold: float, proxy: float, sft_gold: float) -> float | None:
        return proxy - (gold - sft_gold) / gold_std if gold_std > 0 else None  # SFT samples all scored alike

    runs = {"plain": plain, "refresh": refreshed}
    out: dict = {"gold_std_sft": gold_std, "bin_width": bin_width, "end": {}, "same_kl": []}
    for name, t in runs.items():
        out["end"][name] = {
            "step": int(t.steps[-1]),
            "kl": float(t.kl[-1]),
            "gold": float(t.gold[-1]),
            "proxy": float(t.proxy[-1]),
            "gap": gap(t.gold[-1], t.proxy[-1], t.gold[0]),
        }
    top = max(float(plain.kl.max()), float(refreshed.kl.max()))
    for low in np.arange(0.0, top + bin_width, bin_width):
        row: dict = {"kl_low": float(low), "kl_high": float(low + bin_width)}
        for name, t in runs.items():
            hit = t.in_kl_bin(low, low + bin_width)
            row[name] = None if hit is None else {**hit, "gap": gap(hit["gold"], hit["proxy"], t.gold[0])}
        if row["plain"] is not None or row["refresh"] is not None:
            out["same_kl"].append(row)
    return out


# ----------------------------------------------------------------------------------------------------------
# Plots


def plot_fit(path: Path, t: Trajectory, fit: dict, title: str) -> None:
    """Δgold against sqrt(KL): the points, the Gao curve, the linear fit, the peaks; Δproxy beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.4), dpi=110)
    grid = np.linspace(0.0, max(float(t.d.max()), fit["d_peak"] or 0.0) * 1.05, 200)
    ax.plot(t.d, t.gold - t.gold[0], "o", color="C0", label="Δgold (held out)")
    ax.plot(
        grid,
        gao_curve(grid, fit["alpha"], fit["beta"]),
        "-",
        color="C0",
        label=f"d(α − β log d): α={fit['alpha']:.3g}, β={fit['beta']:.3g}, R²={fit['r2']:.2f}",
    )
    ax.plot(
        grid,
        fit["linear_a"] * grid,
        ":",
        color="gray",
        label=f"linear a·d: a={fit['linear_a']:.3g}, R²={fit['linear_r2']:.2f}",
    )
    ax.plot(
        t.d, t.proxy - t.proxy[0], "s", color="C1", markersize=3, alpha=0.7, label="Δproxy (reward model)"
    )
    if fit["d_peak"] is not None:
        ax.axvline(
            fit["d_peak"], color="C0", alpha=0.4, linestyle="--", label=f"fitted peak d*={fit['d_peak']:.2f}"
        )
    peak = fit["observed_peak"]
    ax.plot(
        [peak["d"]],
        [peak["delta"]],
        "*",
        color="C3",
        markersize=12,
        label=f"observed peak (step {peak['step']})",
    )
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_title(title)
    ax.set_xlabel("d = sqrt(KL to the SFT policy, nats per response)")
    ax.set_ylabel("change from the SFT policy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_compare(path: Path, runs: dict[str, Trajectory], gold_std: float) -> None:
    """Gold (z units) and proxy of each run against the rollout and against sqrt(KL); KL against the rollout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_kl, kl) = plt.subplots(1, 3, figsize=(15.0, 4.2), dpi=110)
    unit = gold_std if gold_std > 0 else 1.0
    for i, (name, t) in enumerate(runs.items()):
        z = (t.gold - t.gold[0]) / unit
        by_step.plot(t.steps, z, "o-", color=f"C{i}", markersize=3, label=f"{name}: gold (z)")
        by_step.plot(t.steps, t.proxy, "s--", color=f"C{i}", markersize=3, alpha=0.6, label=f"{name}: proxy")
        by_kl.plot(t.d, z, "o", color=f"C{i}", markersize=4, label=f"{name}: gold (z)")
        by_kl.plot(t.d, t.proxy, "s", color=f"C{i}", markersize=3, alpha=0.45, label=f"{name}: proxy")
        kl.plot(t.steps, t.kl, "o-", color=f"C{i}", markersize=3, label=name)
    by_step.set_title("Gold and proxy, held-out prompts")
    by_step.set_xlabel("rollout")
    by_kl.set_title("... against sqrt(KL)")
    by_kl.set_xlabel("sqrt(KL, nats per response)")
    for ax in (by_step, by_kl):
        ax.set_ylabel("SFT-std units (gold: 0 = SFT policy)")
        ax.axhline(0.0, color="black", linewidth=0.6)
    kl.set_title("KL to the SFT policy")
    kl.set_xlabel("rollout")
    kl.set_ylabel("nats per response")
    for ax in (by_step, by_kl, kl):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------
# Running PPO with the meter (and the refresh)


@dataclass
class Inputs:
    sft: Path
    reward_model: Path
    prompts_train: Path
    prompts_eval: Path
    pairs: Path | None


def resolve_inputs(args) -> Inputs:
    """The inputs from ``--quickstart DIR``, from the explicit flags, or from a quickstart run first."""
    from rlhfkit.errors import UserError

    if args.quickstart is None and args.sft is None:
        from rlhfkit.quickstart.pipeline import quickstart

        args.quickstart = args.out / "quickstart"
        if not (args.quickstart / "summary.json").is_file():
            print(
                f"no --quickstart or --sft given: running the quickstart into {args.quickstart} first",
                flush=True,
            )
            quickstart(args.quickstart, args.preset, overwrite=True, seed=args.seed)
    if args.quickstart is not None:
        q = Path(args.quickstart)
        inputs = Inputs(
            q / "sft" / "final",
            q / "reward" / "final",
            q / "task" / "prompts_train.jsonl",
            q / "task" / "prompts_eval.jsonl",
            q / "pairs" / "pairs_train.jsonl",
        )
    else:
        if None in (args.reward_model, args.prompts_train, args.prompts_eval):
            raise UserError("--sft needs --reward-model, --prompts-train and --prompts-eval too")
        inputs = Inputs(args.sft, args.reward_model, args.prompts_train, args.prompts_eval, args.pairs)
    if args.refresh_steps and inputs.pairs is None:
        raise UserError(
            "--refresh-steps needs --pairs (the reward model's training pairs, replayed by the refresh)"
        )
    for name, path in vars(inputs).items():
        if path is not None and not Path(path).exists():
            raise UserError(f"{name.replace('_', ' ')} not found: {path}")
    return inputs


def run_ppo(inputs: Inputs, out: Path, args, refresh_steps: int = 0) -> Path:
    """PPO from the SFT policy against the reward model, the meter every ``--eval-every`` rollouts; returns
    the run folder (reused when it already holds a finished run)."""
    from rlhfkit.config import load_config
    from rlhfkit.quickstart.pipeline import PRESETS, HackingMeter, task_refresh
    from rlhfkit.tasks import get_task
    from rlhfkit.trainers import online

    if (out / "summary.json").is_file() and not args.overwrite:
        print(f"{out}: a finished run, reused (--overwrite runs it again)", flush=True)
        return out
    preset = replace(PRESETS[args.preset], num_eval_prompts=args.eval_prompts)
    task = get_task("reviews", seed=args.task_seed)
    meter = HackingMeter(
        task,
        inputs.sft,
        inputs.reward_model,
        inputs.prompts_eval,
        preset,
        args.seed,
        meter_prompts=args.eval_prompts,
    )
    hooks = online.OnlineHooks(evaluate=meter.during_training)
    if refresh_steps:
        hooks.refresh_reward_model = task_refresh(
            task, meter, inputs.pairs, preset, args.seed, **json.loads(args.refresh_settings)
        )
    overrides = {
        "output_dir": out,
        "seed": args.seed,
        "model.name_or_path": inputs.sft,
        "data.train_file": inputs.prompts_train,
        "data.max_prompt_length": 32,
        "online.reward_model": inputs.reward_model,
        "online.response_length": preset.response_length,
        "online.kl_coef": args.kl_coef,
        "train.max_steps": args.rollouts,
        "train.batch_size": preset.ppo_batch,
        "train.learning_rate": args.learning_rate,
        "train.lr_schedule": "constant",
        "train.save_steps": args.rollouts,
        "train.eval_steps": args.eval_every,
        "train.log_steps": 1,
        "refresh.every": refresh_steps,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()], "ppo")
    print(
        f"PPO{' with a reward-model refresh every ' + str(refresh_steps) + ' rollouts' if refresh_steps else ''}: "
        f"{args.rollouts} rollouts, lr {args.learning_rate}, kl_coef {args.kl_coef} -> {out}",
        flush=True,
    )
    online.train(cfg, overwrite=True, hooks=hooks)
    return out


def sft_gold_std(inputs: Inputs, args) -> float:
    """The std of the gold score of SFT samples on the meter's prompts (the unit of the gap)."""
    import torch

    from rlhfkit.data import TokenLimits, prepare_examples
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.quickstart.pipeline import PRESETS
    from rlhfkit.rollout.evaluate import sample_and_score
    from rlhfkit.tasks import get_task

    tokenizer = load_tokenizer(str(inputs.sft))
    policy = load_causal_lm(str(inputs.sft), tokenizer=tokenizer).eval()
    examples = prepare_examples(str(inputs.prompts_eval), "prompts", tokenizer, TokenLimits(32, None, "left"))
    torch.manual_seed(args.seed)
    samples = sample_and_score(
        policy,
        tokenizer,
        examples[: args.eval_prompts],
        temperature=0.7,
        max_new_tokens=PRESETS[args.preset].response_length,
        gold_score=get_task("reviews", seed=args.task_seed).gold_score,
    )
    return samples.summary()["gold_std"]


# ----------------------------------------------------------------------------------------------------------
# Reports


def format_fit(fit: dict) -> str:
    peak = fit["observed_peak"]
    fitted_peak = (
        "no interior peak (β <= 0)"
        if fit["d_peak"] is None
        else f"d* = {fit['d_peak']:.3f} (KL {fit['kl_peak']:.2f} nats), Δgold* = {fit['delta_peak']:.3f}"
    )
    return "\n".join(
        [
            f"  Gao et al. fit  Δgold = d(α − β log d):  α = {fit['alpha']:.4f}, β = {fit['beta']:.4f}   "
            f"R² = {fit['r2']:.3f}, RMSE = {fit['rmse']:.4f}  ({fit['points']} points)",
            f"  linear fit      Δgold = a·d:            a = {fit['linear_a']:.4f}              "
            f"R² = {fit['linear_r2']:.3f}, RMSE = {fit['linear_rmse']:.4f}",
            f"  fitted peak     {fitted_peak}",
            f"  observed peak   step {peak['step']}: gold {peak['gold']:.3f} (Δ {peak['delta']:+.3f}) at KL "
            f"{peak['kl']:.2f} (d = {peak['d']:.3f})",
            f"  SFT gold {fit['sft_gold']:.3f}; final (step {fit['final']['step']}): gold {fit['final']['gold']:.3f}, "
            f"proxy {fit['final']['proxy']:.3f}, KL {fit['final']['kl']:.2f}",
        ]
    )


def format_compare(c: dict) -> str:
    lines = [
        f"  gap = proxy − (gold − gold_SFT) / {c['gold_std_sft']:.3f}  (proxy units; 0 for the SFT policy)"
    ]

    def number(x):
        return "    n/a" if x is None else f"{x:7.3f}"

    def cells(row, name):
        r = row.get(name)
        return (
            " " * 22 + "-   "
            if r is None
            else f"{r['gold']:7.3f} {r['proxy']:7.3f} {number(r['gap'])} {r['n']:3d}"
        )

    for name in ("plain", "refresh"):
        e = c["end"][name]
        lines.append(
            f"  end of {name:<8} (KL {e['kl']:5.2f}, step {e['step']}): gold {e['gold']:.3f}, proxy "
            f"{e['proxy']:.3f}, gap {number(e['gap']).strip()}"
        )
    lines.append("  KL bin (nats)   | plain: gold   proxy     gap   n | refresh: gold   proxy     gap   n")
    for row in c["same_kl"]:
        lines.append(
            f"  [{row['kl_low']:4.1f}, {row['kl_high']:4.1f})    | {cells(row, 'plain')} | {cells(row, 'refresh')}"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (runs, fit.json, fit.png)")
    src = p.add_argument_group("inputs (default: run the quickstart into OUT/quickstart first)")
    src.add_argument("--quickstart", type=Path, help="a finished `rlhfkit quickstart` folder")
    src.add_argument("--sft", type=Path, help="the SFT policy folder")
    src.add_argument("--reward-model", type=Path, help="the reward model folder")
    src.add_argument("--prompts-train", type=Path, help='training prompts (JSON Lines {"prompt"})')
    src.add_argument("--prompts-eval", type=Path, help="held-out prompts (the meter's)")
    src.add_argument("--pairs", type=Path, help="the reward model's training pairs (for --refresh-steps)")
    src.add_argument(
        "--task-seed", type=int, default=0, help="the seed the task's prompt split was made with"
    )
    ppo = p.add_argument_group("PPO")
    ppo.add_argument("--preset", default="tiny", choices=("tiny", "small", "smoke"))
    ppo.add_argument("--rollouts", type=int, default=TINY_DEFAULTS["rollouts"])
    ppo.add_argument("--learning-rate", type=float, default=TINY_DEFAULTS["learning_rate"])
    ppo.add_argument("--kl-coef", type=float, default=TINY_DEFAULTS["kl_coef"])
    ppo.add_argument(
        "--eval-every", type=int, default=TINY_DEFAULTS["eval_every"], help="rollouts between evaluations"
    )
    ppo.add_argument(
        "--eval-prompts",
        type=int,
        default=TINY_DEFAULTS["eval_prompts"],
        help="held-out prompts per evaluation",
    )
    ppo.add_argument("--seed", type=int, default=0)
    ppo.add_argument(
        "--refresh-steps",
        type=int,
        default=0,
        metavar="K",
        help="also run PPO with a reward-model refresh every K rollouts, and compare",
    )
    ppo.add_argument(
        "--refresh-settings",
        default="{}",
        metavar="JSON",
        help='RefreshConfig fields for the refresh run, e.g. \'{"pairs": 128, "steps": 16}\'',
    )
    ppo.add_argument("--overwrite", action="store_true", help="rerun PPO runs that already finished")
    ppo.add_argument("--fit-only", action="store_true", help="only fit and plot the runs already in OUT")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from rlhfkit.engine.metrics_writer import read_metrics
    from rlhfkit.engine.threads import set_num_threads

    args = parse_args(argv)
    set_num_threads()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {"plain": args.out / "ppo"}
    if args.refresh_steps:
        runs["refresh"] = args.out / "ppo-refresh"
    cache = args.out / "sft_gold.json"  # the unit of the gap, measured once
    if not args.fit_only:
        inputs = resolve_inputs(args)
        for name, folder in runs.items():
            run_ppo(inputs, folder, args, refresh_steps=args.refresh_steps if name == "refresh" else 0)
        if args.refresh_steps and not cache.is_file():
            cache.write_text(json.dumps({"gold_std": sft_gold_std(inputs, args)}))
    trajectories = {
        name: Trajectory.from_rows(read_metrics(folder / "metrics.jsonl"))
        for name, folder in runs.items()
        if (folder / "metrics.jsonl").is_file()
    }
    if "plain" not in trajectories:
        print(f"no PPO run in {runs['plain']}", file=sys.stderr)
        return 1
    result: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    result["fit"] = analyse(trajectories["plain"])
    print("\nOveroptimization (held-out prompts, PPO without refresh):\n" + format_fit(result["fit"]))
    plot_fit(
        args.out / "fit.png",
        trajectories["plain"],
        result["fit"],
        f"Gold against sqrt(KL): PPO lr {args.learning_rate}, kl_coef {args.kl_coef}",
    )
    if "refresh" in trajectories:
        result["fit_refresh"] = analyse(trajectories["refresh"])
        print(
            f"\nWith a reward-model refresh every {args.refresh_steps} rollouts:\n"
            + format_fit(result["fit_refresh"])
        )
        if not cache.is_file():
            print(f"{cache} is missing: run once without --fit-only", file=sys.stderr)
            return 1
        gold_std = json.loads(cache.read_text())["gold_std"]
        result["compare"] = compare(trajectories["plain"], trajectories["refresh"], gold_std)
        print(
            "\nPlain PPO against PPO with the refresh (same seed and settings):\n"
            + format_compare(result["compare"])
        )
        plot_compare(args.out / "compare.png", trajectories, gold_std)
    (args.out / "fit.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(
        f"\nwrote {args.out / 'fit.json'}, {args.out / 'fit.png'}"
        + (", compare.png" if "refresh" in trajectories else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
