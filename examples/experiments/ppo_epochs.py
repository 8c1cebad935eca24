"""PPO epochs: more passes over a rollout drift further from pi_old, until clipping stops holding the policy.

PPO's clipped surrogate (Schulman et al. 2017, eq. 7) keeps the ratio pi / pi_old inside [1 - eps, 1 + eps]
only for the tokens it clips; each further epoch over the same rollout starts where the last one ended, so the
claim is that the approximate KL(pi_old || pi) grows epoch by epoch while the clipped share saturates: the
clip removes the gradient of the clipped tokens, not the drift the others' updates cause. On the built-in task,
per seed (the SFT policy and reward model of ``ppo_sweep.py``'s seeds, trained as ``temperature.py`` trains
them, so one ``--out`` serves both): PPO at ``online.ppo_epochs`` 1, 2, 4 (the library's default) and 8, with
``online.epoch_stats`` on, so that every rollout logs clipfrac and approx_kl of each epoch on its own. Held-out
gold, proxy, KL to SFT, length and validity every ``--eval-every`` rollouts as ``ppo_sweep.py`` measures them.

Each epoch here is one minibatch, so n epochs are also n optimizer steps a rollout. The control arms take the
same steps in one pass (``--equal-steps``): 1 epoch of n minibatches (n = 4 and 8), each step on a different
n-th of the rollout. n epochs minus 1 epoch of n minibatches is then the effect of the passes alone; the claims
(``EQUAL_STEP_CLAIMS``), fixed before these arms ran: no difference within ±0.1 gold at 4, lower gold at 8.

Writes ``OUT/ppo_epochs.md`` (the final policies, the per-epoch drift, each arm paired per seed against 4
epochs), ``ppo_epochs_rows.csv``, ``ppo_epochs_train.csv`` and ``ppo_epochs.png``::

    RLHFKIT_NUM_THREADS=1 python examples/experiments/ppo_epochs.py --out runs/ppo_sweep --jobs 2   # 5 seeds
    python examples/experiments/ppo_epochs.py --out runs/ppo_sweep --report-only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo_arms  # noqa: E402
from temperature import sizes_of  # noqa: E402

EPOCHS = (1, 2, 4, 8)
EQUAL_STEPS = (4, 8)  # the control arms: 1 epoch of n minibatches, as many optimizer steps as n epochs of 1
BASE = "epochs4"
# Claimed before the control arms ran, for n epochs of one minibatch minus 1 epoch of n minibatches (equal
# optimizer steps, so the difference is the passes over the same samples): at 4 epochs no difference within
# ±0.1 gold (the library's default reuses its samples at no cost); at 8, lower gold (past a few epochs they hurt).
EQUAL_STEP_CLAIMS = {4: (0, 0.1), 8: (-1, None)}


def arms_of(epochs=EPOCHS, equal_steps=EQUAL_STEPS) -> list[ppo_arms.Arm]:
    arms = [
        ppo_arms.Arm(
            f"epochs{n}",
            f"{n} epoch{'s' if n > 1 else ''}",
            settings={"online.ppo_epochs": n, "online.epoch_stats": True},
        )
        for n in epochs
    ]
    return arms + [
        ppo_arms.Arm(
            f"epochs1-mb{n}",
            f"1 epoch of {n} minibatches",
            settings={"online.ppo_epochs": 1, "online.num_minibatches": n, "online.epoch_stats": True},
        )
        for n in equal_steps
    ]


def train_keys(epochs=EPOCHS) -> list[str]:
    return [f"{k}/epoch{e}" for k in ("clipfrac", "approx_kl") for e in range(1, max(epochs) + 1)]


def run_stage(root: Path, stage: dict, seed: int, s, args) -> dict:
    arms = arms_of(args.epochs, args.equal_steps)
    return ppo_arms.run_arms(root, stage, seed, s, arms, args, train_keys(args.epochs))


def run_seed(seed: int, args) -> dict:
    s = sizes_of(args)
    root = args.out / f"seed-{seed}"
    return run_stage(root, ppo_arms.seed_stage(root, seed, s, args), seed, s, args)


def epoch_drift(results: list[dict], arms) -> list[dict]:
    """Per arm and epoch: clipfrac and approx_kl averaged over the arm's rollouts, then mean and sd over seeds."""
    out = []
    for arm in arms:
        n = arm.settings["online.ppo_epochs"]
        for e in range(1, n + 1):
            row = {"arm": arm.name, "label": arm.label, "epoch": e}
            for key in ("clipfrac", "approx_kl"):
                per_seed = []
                for r in results:
                    values = [
                        t[f"{key}/epoch{e}"] for t in r["arms"][arm.name]["train"] if f"{key}/epoch{e}" in t
                    ]
                    if values:
                        per_seed.append(float(np.mean(values)))
                row[key] = float(np.mean(per_seed)) if per_seed else None
                row[key + "_sd"] = float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else None
                row[key + "_per_seed"] = per_seed
            out.append(row)
    return out


def markdown(results: list[dict], arms, drift: list[dict]) -> str:
    from rlhfkit.reporting.paired import describe, paired, verdict

    lines = [ppo_arms.end_table(results, arms), ""]
    lines += [
        "| arm | epoch | clipfrac (mean over rollouts) | approx_kl (nats / token) |",
        "|---|---|---|---|",
    ]
    for d in drift:
        cells = [ppo_arms.plus_minus(d, k, 4) for k in ("clipfrac", "approx_kl")]
        lines.append(f"| {d['label']} | {d['epoch']} | " + " | ".join(cells) + " |")
    # the claim, paired per seed: the last epoch's drift against the first epoch's, within each arm
    lines += ["", "Last epoch against the first, per seed (last − first):", ""]
    lines += ["| arm | approx_kl | clipfrac | claim (approx_kl grows): verdict |", "|---|---|---|---|"]
    for arm in arms:
        rows = [d for d in drift if d["arm"] == arm.name]
        if len(rows) < 2 or not rows[0]["approx_kl_per_seed"]:
            continue
        first, last = rows[0], rows[-1]
        tests = {k: paired(first[f"{k}_per_seed"], last[f"{k}_per_seed"]) for k in ("approx_kl", "clipfrac")}
        cells = [describe(t, 4) for t in tests.values()] + [verdict(tests["approx_kl"], +1)]
        lines.append(f"| {arm.label} | " + " | ".join(cells) + " |")
    # the end figures against the default 4 epochs (no direction claimed for them)
    plain = [a for a in arms if "online.num_minibatches" not in a.settings]
    base = BASE if BASE in {a.name for a in plain} else plain[0].name
    lines += ["", ppo_arms.paired_table(results, plain, base)]
    lines += equal_step_lines(results, arms)
    return "\n".join(lines)


def equal_step_lines(results: list[dict], arms) -> list[str]:
    """n epochs of one minibatch against 1 epoch of n minibatches (the same optimizer steps), paired per seed,
    each with its claim (``EQUAL_STEP_CLAIMS``) decided by the page's rule."""
    from rlhfkit.reporting.paired import Claim, decide, describe, paired

    names = {a.name for a in arms}
    lines = []
    for n in sorted(
        {a.settings["online.num_minibatches"] for a in arms if "online.num_minibatches" in a.settings}
    ):
        if f"epochs{n}" not in names or not results:
            continue
        a = [ppo_arms.last_eval(r["arms"][f"epochs1-mb{n}"])["gold"] for r in results]
        b = [ppo_arms.last_eval(r["arms"][f"epochs{n}"])["gold"] for r in results]
        direction, margin = EQUAL_STEP_CLAIMS.get(n, (0, 0.1))
        claim = Claim(direction, margin)
        said = {1: "higher", -1: "lower"}.get(direction) or f"no difference within ±{margin:g}"
        if not lines:
            lines = [
                "",
                "Equal optimizer steps: n epochs of one minibatch − 1 epoch of n minibatches, gold, per seed:",
                "",
            ]
            lines += ["| n | gold, b − a | claim | verdict (the page's rule) |", "|---|---|---|---|"]
        lines.append(f"| {n} | {describe(paired(a, b))} | {said} | {decide(paired(a, b), claim)} |")
    return lines


def plot(path: Path, rows: list[dict], arms, drift: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16.0, 8.6), dpi=100)
    ppo_arms.common_panels(axes[0], rows, arms, "PPO epochs")
    for ax, key, unit in (
        (axes[1][0], "approx_kl", "approx. KL(pi_old || pi), nats / token"),
        (axes[1][1], "clipfrac", "clipped share of tokens"),
    ):
        for i, arm in enumerate(arms):
            mine = [d for d in drift if d["arm"] == arm.name and d[key] is not None]
            ax.errorbar([d["epoch"] for d in mine], [d[key] for d in mine], [d[key + "_sd"] or 0.0 for d in mine],
                        marker="o", capsize=3, color=f"C{i}", label=arm.label)  # fmt: skip
        ax.set(title=f"PPO epochs: {key} in each epoch (mean over rollouts)", xlabel="PPO epoch", ylabel=unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for i, arm in enumerate(arms):
        xs, means, sds = ppo_arms.curve(rows, arm.name, "length")
        axes[1][2].errorbar(xs, means, sds, marker="o", capsize=3, color=f"C{i}", label=arm.label)
    axes[1][2].set(title="PPO epochs: response length (held out)", xlabel="rollout", ylabel="tokens")
    axes[1][2].grid(alpha=0.3)
    axes[1][2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(out: Path, results: list[dict], epochs=EPOCHS, equal_steps=EQUAL_STEPS) -> str:
    arms = arms_of(epochs, equal_steps)
    drift = epoch_drift(results, arms)
    text = markdown(results, arms, drift)
    rows, _ = ppo_arms.write_report(out, "ppo_epochs", results, arms, text)
    plot(out / "ppo_epochs.png", rows, arms, drift)
    return text


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ppo_arms.add_arguments(p)
    p.add_argument(
        "--epochs", type=int, nargs="+", default=list(EPOCHS), help="online.ppo_epochs of each arm"
    )
    p.add_argument(
        "--equal-steps",
        type=int,
        nargs="*",
        default=list(EQUAL_STEPS),
        help="the control arms: 1 epoch of n minibatches each (none: only the epoch arms)",
    )
    args = p.parse_args(argv)
    if any(e < 1 for e in args.epochs) or any(n < 2 for n in args.equal_steps):
        p.error("--epochs must be positive and --equal-steps at least 2")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = ppo_arms.run_seeds(__file__, argv, args, run_seed)
    if results is None:
        return 1
    if not args.no_report:
        report(args.out, results, tuple(args.epochs), tuple(args.equal_steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
