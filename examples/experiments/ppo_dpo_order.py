"""PPO then DPO, DPO then PPO: gold and KL to the SFT policy after each order, against PPO alone and DPO alone.

The question the classic RLHF chapter leaves open once DPO is beside PPO: are the two interchangeable, and does
one add anything after the other? PPO maximises the reward model's score minus a KL penalty to its starting
policy,

    max_pi E[r_phi(x, y)] - beta_PPO * KL(pi || pi_start),

and DPO fits the same preferences directly, its implicit reward being beta_DPO * log(pi(y|x) / pi_ref(y|x))
(Rafailov et al. 2023, eq. 7: L = -log sigmoid(beta (log-ratio of the chosen - log-ratio of the rejected))).
Both see the same labelled pairs (PPO through the reward model trained on them). On the built-in task, for each
seed (the SFT policy, pairs and reward model of ``ppo_sweep.py``'s seeds, trained as ``temperature.py`` trains
them, so one ``--out`` serves both):

- ``ppo``: PPO from SFT, the quickstart's tiny PPO (``ppo_sweep.py``'s ``kl0.05-gamma1`` run, trained once);
- ``dpo``: DPO from SFT on the reward model's training pairs (the quickstart's tiny DPO stage: 40 steps of 32
  pairs, beta 0.1), reference SFT, at the seed's tuned learning rate (below);
- ``ppo→dpo``: that DPO from the PPO policy, reference the PPO policy (the library's default: the starting
  policy), and ``ppo→dpo (ref SFT)``: the same with the SFT policy as DPO's reference (``dpo.reference_model``);
- ``dpo→ppo``: that PPO from the DPO policy (its critic from the reward model, its KL penalty against the DPO
  policy: PPO's reference is always its starting policy).

DPO's learning rate, chosen per seed on DPO's own validation pairs. For each seed, DPO from the SFT policy is
trained at every rate of a grid (``DPO_LRS``; ``--dpo-lrs`` replaces it), and the rate whose final DPO loss on
the seed's held-out labelled pairs (``pairs/pairs_eval.jsonl``, DPO's ``eval_file``) is lowest is the rate of
every DPO run of that seed (``dpo``, ``ppo→dpo``, ``ppo→dpo (ref SFT)``, and the DPO policy ``dpo→ppo`` starts
from); an exact tie goes to the smaller rate, and a run whose loss is not finite is never chosen. The loss is
the one DPO minimises, read against the annotators' labels, as a user without the gold scorer would; the gold
scorer takes no part in the choice. The loss rather than the accuracy: on 255 pairs the accuracy moves in steps
of 0.004 with a standard error near 0.03, and it does not see a policy growing over-confident on the pairs it
gets wrong. The grid's run at the chosen rate is the ``dpo`` arm itself, so the grid costs one DPO stage per
extra rate and seed. Its figures per seed are in ``OUT/seed-N/dpo_lr.json`` and in the report; a chosen rate at
the edge of the grid is flagged there (the grid did not bracket the best). ``--dpo-lr 3e-4`` pins a rate
instead (no grid): the set-up of the table measured before the rate was tuned. Every DPO folder names its rate
(``dpo-lr0.0003``, ``ppo-then-dpo-lr0.0003``, ``dpo-lr0.0003-then-ppo``, ...), so figures cached at one rate
are never read as another's.

The grid, 3e-4, 1e-3, 3e-3, 1e-2 (half a decade apart; smoke size 1e-4, 1e-3): on a default-size seed-0 SFT
policy and its pairs, the held-out loss of DPO from SFT fell from 0.676 at 1e-4 through 0.645 (3e-4) and 0.622
(1e-3) to 0.579 at 3e-3, and rose again to 0.607 at 1e-2 and 0.861 at 3e-2, so the grid brackets that minimum
with a rate on each side and keeps 3e-4, the rate the table was first measured at. What the held-out pairs do
not see: they are the SFT policy's responses, not the trained policy's. On the same seed, 128 responses of each
policy to training prompts at T = 0.7 were valid 99% of the time at 3e-4 (KL to SFT 1.4 nats), 26% at 1e-3
(44 nats) and 55% at 3e-3 (18 nats): the rate with the lowest held-out loss is not one whose own samples stay
like the SFT policy's.

What the choice may see. The validation pairs are responses of the SFT policy to held-out prompts, labelled by
the noisy annotators; the gold evaluation below reads fresh responses of each trained policy scored by the gold
scorer. They are not separate prompt sets: ``label_pairs`` draws the validation pairs' prompts from the task's
held-out split, the very split the evaluation reads (at the default size, the 255 validation pairs of seed 0
sit on 255 of its 384 held-out prompts). The responses and the judge differ, and the choice picks one rate of
four from the labels alone, so what it can learn of the evaluation is small, but it is not nil.

Every final policy is read as ``ppo_sweep.py`` reads it: ``--final-samples`` responses at T = 0.7 to each
held-out prompt (the same sampling seed for every policy), with the evaluation's standard error; the PPO runs
every ``--eval-every`` rollouts on one response to each of ``--eval-prompts`` held-out prompts. Figures: gold,
proxy, KL to the SFT policy (k1, nats per response), length, validity. Writes ``OUT/order.md`` (means ± sd over
seeds, the paired differences, the learning-rate grid per seed), ``OUT/order_rows.csv`` and ``OUT/order.png``;
every policy's figures are cached in its folder (``--overwrite`` reruns)::

    RLHFKIT_NUM_THREADS=1 python examples/experiments/ppo_dpo_order.py --out runs/ppo_sweep   # 3 seeds, two at a time
    RLHFKIT_NUM_THREADS=1 python examples/experiments/ppo_dpo_order.py --out runs/ppo_sweep --report-only
    RLHFKIT_NUM_THREADS=1 python examples/experiments/ppo_dpo_order.py --out runs/ppo_sweep --dpo-lr 3e-4  # pinned
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stages and reports beside this script
from ppo_sweep import BASE, Meter, parse_args, ppo_run, run_name, sft_figures, sizes_of  # noqa: E402
from ppo_sweep_report import aggregate, plus_minus  # noqa: E402
from temperature import Sizes, train_sft_and_reward  # noqa: E402
from temperature_report import write_csv  # noqa: E402

from rlhfkit.reporting.paired import describe, paired  # noqa: E402

# (name, label, how it is made); the order of the table and the figure
ARMS = (
    ("sft", "SFT", "the starting policy"),
    ("ppo", "PPO", "PPO from SFT"),
    ("dpo", "DPO", "DPO from SFT, reference SFT"),
    ("ppo-dpo", "PPO → DPO", "DPO from PPO, reference PPO"),
    ("ppo-dpo-ref-sft", "PPO → DPO (ref SFT)", "DPO from PPO, reference SFT"),
    ("dpo-ppo", "DPO → PPO", "PPO from DPO, KL to DPO"),
)
DPO_PRESET = {
    "default": "tiny",
    "smoke": "smoke",
}  # rlhfkit.quickstart.dpo_stage.DPO_PRESETS by experiment size
# The learning rates DPO from SFT is tried at, per seed, by experiment size (the module docstring says why these).
DPO_LRS = {"default": (3e-4, 1e-3, 3e-3, 1e-2), "smoke": (1e-4, 1e-3)}
SELECTION_METRIC = "heldout_loss"  # DPO's loss on the held-out labelled pairs (its summary.json key)


def lr_name(lr: float) -> str:
    """``lr0.0003``: the rate in a DPO run's folder name."""
    return f"lr{lr:g}"


def choose_lr(grid: list[dict]) -> float:
    """The rate of ``grid`` (``[{"lr", "heldout_loss", ...}]``) whose held-out DPO loss is lowest; an exact tie
    goes to the smaller rate; a run whose loss is missing or not finite (diverged) is never chosen."""
    finite = [g for g in grid if g[SELECTION_METRIC] is not None and math.isfinite(g[SELECTION_METRIC])]
    if not finite:
        raise ValueError(f"no rate of the grid {[g['lr'] for g in grid]} has a finite held-out DPO loss")
    return min(finite, key=lambda g: (g[SELECTION_METRIC], g["lr"]))["lr"]


def dpo_train(
    folder: Path, start: Path, stage: dict, seed: int, s: Sizes, args, lr: float, retrain: bool, **extra
):
    """DPO at ``lr`` from ``start`` on the seed's labelled pairs, held out on its validation pairs (``extra``: other
    dotted keys); its summary, cached in ``folder`` (rerun when ``retrain``)."""
    from rlhfkit.quickstart.dpo_stage import dpo_stage

    summary = folder / "summary.json"
    if summary.is_file() and (folder / "final").is_dir() and not retrain:
        return json.loads(summary.read_text())
    if folder.exists():
        shutil.rmtree(folder)  # an unfinished run of this script's own
    print(f"seed {seed}: DPO from {start} at lr {lr:g} {extra or ''}", flush=True)
    pairs = {k: stage["root"] / "pairs" / f"pairs_{k}.jsonl" for k in ("train", "eval")}
    extra = {"train.learning_rate": lr, **extra}
    return dpo_stage(folder, DPO_PRESET[args.size], seed, start, pairs, s.response_length, **extra)


def select_dpo_lr(root: Path, stage: dict, seed: int, s: Sizes, args) -> dict:
    """The seed's DPO learning rate: ``{"metric", "grid": [{"lr", "heldout_loss", "heldout_accuracy"}],
    "chosen", "pinned"}``. With ``args.dpo_lr`` that rate, no grid (and no file: a pinned run leaves the
    grid's record alone); else DPO from SFT at each of ``args.dpo_lrs`` (each run cached in ``root/dpo-lr<rate>``,
    the ``dpo`` arm at its rate) and :func:`choose_lr` of their held-out figures, written to
    ``root/dpo_lr.json``."""
    if args.dpo_lr is not None:
        return {"metric": SELECTION_METRIC, "grid": [], "chosen": args.dpo_lr, "pinned": True}
    grid = []
    for lr in args.dpo_lrs:
        summary = dpo_train(
            root / f"dpo-{lr_name(lr)}", stage["sft"], stage, seed, s, args, lr, args.overwrite
        )
        grid.append({"lr": lr, **{k: summary.get(k) for k in ("heldout_loss", "heldout_accuracy")}})
    record = {"metric": SELECTION_METRIC, "grid": grid, "chosen": choose_lr(grid), "pinned": False}
    (root / "dpo_lr.json").write_text(json.dumps(record, indent=1))
    return record


def dpo_run(folder: Path, start: Path, stage: dict, meter, seed: int, s: Sizes, args, lr: float, retrain: bool,
            **extra):  # fmt: skip
    """DPO at ``lr`` from ``start`` (:func:`dpo_train`); ``(meter, figures)``, the figures of the final policy (and
    DPO's held-out implicit-reward accuracy) cached in ``folder`` (both rerun when ``retrain``)."""
    cache = folder / "order_rows.json"
    if cache.is_file() and not retrain:
        return meter, json.loads(cache.read_text())
    summary = dpo_train(folder, start, stage, seed, s, args, lr, retrain, **extra)
    meter = meter or Meter(stage, s, seed)
    figures = {
        **meter.measure_saved(folder / "final"),
        "dpo_lr": lr,
        "dpo_accuracy": summary.get("heldout_accuracy"),
        "dpo_gold_accuracy": summary.get("heldout_gold_accuracy"),
    }
    cache.write_text(json.dumps(figures, indent=1))
    return meter, figures


def dpo_folders(lr: float) -> dict[str, str]:
    """The folder of each DPO arm (and of PPO from the DPO policy) at rate ``lr``."""
    name = lr_name(lr)
    return {
        "dpo": f"dpo-{name}",
        "ppo-dpo": f"ppo-then-dpo-{name}",
        "ppo-dpo-ref-sft": f"ppo-then-dpo-ref-sft-{name}",
        "dpo-ppo": f"dpo-{name}-then-ppo",
    }


def run_seed(seed: int, s: Sizes, args) -> dict:
    """Every policy of one seed: ``{"seed", "rm_accuracy", "dpo_lr", "arms": {name: figures}, "curves": {...}}``."""
    root = args.out / f"seed-{seed}"
    stage = {**train_sft_and_reward(root, seed, s, args), "root": root}
    meter, sft = sft_figures(root, stage, seed, s, args)
    base = dict(BASE)
    meter, ppo = ppo_run(root / run_name(base), stage, meter, seed, s, base, args)
    ppo_final = root / run_name(base) / "final"
    selection = select_dpo_lr(root, stage, seed, s, args)
    lr, folders = selection["chosen"], dpo_folders(selection["chosen"])
    # DPO from SFT at the chosen rate is the grid's run at that rate: trained (or retrained) by the grid already
    retrain_dpo = args.overwrite and selection["pinned"]
    meter, dpo = dpo_run(root / folders["dpo"], stage["sft"], stage, meter, seed, s, args, lr, retrain_dpo)
    meter, ppo_dpo = dpo_run(
        root / folders["ppo-dpo"], ppo_final, stage, meter, seed, s, args, lr, args.overwrite
    )
    meter, ppo_dpo_sft = dpo_run(
        root / folders["ppo-dpo-ref-sft"],
        ppo_final,
        stage,
        meter,
        seed,
        s,
        args,
        lr,
        args.overwrite,
        **{"dpo.reference_model": stage["sft"]},
    )
    meter, dpo_ppo = ppo_run(
        root / folders["dpo-ppo"],
        stage,
        meter,
        seed,
        s,
        base,
        args,
        **{"model.name_or_path": root / folders["dpo"] / "final"},
    )
    return {
        "seed": seed,
        "rm_accuracy": stage["rm_accuracy"],
        "dpo_lr": selection,
        "arms": {
            "sft": sft,
            "ppo": ppo["eval"][-1],
            "dpo": dpo,
            "ppo-dpo": ppo_dpo,
            "ppo-dpo-ref-sft": ppo_dpo_sft,
            "dpo-ppo": dpo_ppo["eval"][-1],
        },
        # gold, proxy and KL along the two PPO runs, from their starting policies (rollout 0)
        "curves": {
            "ppo": [{"rollout": 0, **sft}, *ppo["eval"]],
            "dpo-ppo": [{"rollout": 0, **dpo}, *dpo_ppo["eval"]],
        },
    }


def rows_of(results: list[dict]) -> list[dict]:
    """One row per seed and policy (``setting``: the policy's name, ``rollout`` 0: :func:`aggregate`'s keys)."""
    rows = []
    for res in results:
        for name, _, _ in ARMS:
            figures = {k: v for k, v in res["arms"][name].items() if k != "rollout"}
            rows.append({"seed": res["seed"], "setting": name, "rollout": 0, **figures})
    return rows


def markdown(table: list[dict], results: list[dict]) -> str:
    """Every policy: gold, proxy, KL to SFT, length, validity (mean ± sd over seeds), gold per seed; then DPO's
    held-out implicit-reward accuracy (against the labels and against gold) per DPO run."""
    by = {r["setting"]: r for r in table}
    lines = [
        "| policy | how | gold | proxy | proxy − gold | KL to SFT (nats) | length | valid | gold per seed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, label, how in ARMS:
        r = by[name]
        figures = " | ".join(
            plus_minus(r, f, 1 if f == "length" else 2) for f in ("gold", "proxy", "gap", "kl")
        )
        seeds = " / ".join(f"{g:.2f}" for g in r["gold_per_seed"])
        lines.append(
            f"| {label} | {how} | {figures} | {plus_minus(r, 'length', 1)} | {plus_minus(r, 'valid_rate')} | {seeds} |"
        )
    lines += ["", "Gold paired per seed (arm − PPO alone; mean (per seed); 95% t-interval; sign test):", ""]
    lines += ["| policy | gold − PPO's |", "|---|---|"]
    ppo = [res["arms"]["ppo"]["gold"] for res in results]
    for name, label, _ in ARMS:
        if name not in ("sft", "ppo"):
            lines.append(
                f"| {label} | {describe(paired(ppo, [res['arms'][name]['gold'] for res in results]))} |"
            )
    lines += [
        "",
        "| DPO run | held-out implicit-reward accuracy (labels) | ... against gold |",
        "|---|---|---|",
    ]
    for name, label, _ in ARMS:
        acc = [res["arms"][name].get("dpo_accuracy") for res in results]
        if all(a is not None for a in acc):
            gold = [res["arms"][name].get("dpo_gold_accuracy") for res in results]
            cells = [
                " / ".join(f"{a:.3f}" if a is not None and a == a else "–" for a in x) for x in (acc, gold)
            ]
            lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines + ["", *lr_table(results)])


def lr_table(results: list[dict]) -> list[str]:
    """DPO's learning rate per seed: each rate of the grid with its held-out loss and accuracy (against the
    labels), the chosen one marked (and flagged when it is the grid's smallest or largest); or the pinned rate."""
    lines = [
        "DPO's learning rate per seed, chosen by the lowest held-out DPO loss on the seed's validation pairs "
        "(labels, not gold):",
        "",
        "| seed | lr | held-out loss | held-out accuracy | chosen |",
        "|---|---|---|---|---|",
    ]
    for res in results:
        selection = res["dpo_lr"]
        if selection["pinned"]:
            lines.append(f"| {res['seed']} | {selection['chosen']:g} | – | – | pinned (--dpo-lr) |")
            continue
        rates = [g["lr"] for g in selection["grid"]]
        for g in selection["grid"]:
            chosen = ""
            if g["lr"] == selection["chosen"]:
                edge = len(rates) > 1 and g["lr"] in (min(rates), max(rates))
                chosen = "yes, at the grid's edge" if edge else "yes"
            cells = [f"{g[k]:.4f}" if g[k] is not None else "–" for k in ("heldout_loss", "heldout_accuracy")]
            lines.append(f"| {res['seed']} | {g['lr']:g} | {cells[0]} | {cells[1]} | {chosen} |")
    return lines


def plot(path: Path, table: list[dict], results: list[dict]) -> None:
    """Left: gold against KL to SFT for every policy (mean ± sd over seeds, each seed a faint dot), the two
    orders drawn as paths from SFT. Middle: gold along the two PPO runs (from SFT, from DPO). Right: proxy
    against gold (the reward model's view against the annotators')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {r["setting"]: r for r in table}
    fig, axes = plt.subplots(1, 3, figsize=(17.0, 5.2), dpi=100)
    for i, (name, label, _) in enumerate(ARMS):
        r = by[name]
        for ax, (x, y) in zip((axes[0], axes[2]), (("kl", "gold"), ("gold", "proxy")), strict=True):
            ax.errorbar(r[x], r[y], r.get(y + "_sd") or 0.0, r.get(x + "_sd") or 0.0, fmt="o", color=f"C{i}",
                        capsize=3, label=label)  # fmt: skip
            seeds = [res["arms"][name] for res in results]
            ax.plot([f[x] for f in seeds], [f[y] for f in seeds], ".", color=f"C{i}", alpha=0.35)
    for path_names, style in ((("sft", "ppo", "ppo-dpo"), "-"), (("sft", "dpo", "dpo-ppo"), "--")):
        axes[0].plot([by[n]["kl"] for n in path_names], [by[n]["gold"] for n in path_names], style, color="grey",
                     lw=1, alpha=0.7)  # fmt: skip
    for i, (name, label) in enumerate((("ppo", "PPO from SFT"), ("dpo-ppo", "PPO from DPO"))):
        rollouts = sorted({c["rollout"] for res in results for c in res["curves"][name]})
        gold = [
            [c["gold"] for res in results for c in res["curves"][name] if c["rollout"] == k] for k in rollouts
        ]
        sd = [float(np.std(g, ddof=1)) if len(g) > 1 else 0.0 for g in gold]
        axes[1].errorbar(rollouts, [np.mean(g) for g in gold], sd, marker="o", capsize=3, color=f"C{1 + 4 * i}",
                         label=label)  # fmt: skip
    axes[1].axhline(by["dpo"]["gold"], color="C2", ls=":", label="DPO (from SFT)")
    axes[1].axhline(by["ppo-dpo"]["gold"], color="C3", ls=":", label="PPO → DPO")
    axes[0].set(
        title="Gold against KL to SFT (paths: the two orders)", xlabel="KL to SFT (nats)", ylabel="gold"
    )
    axes[1].set(title="Gold along the PPO runs (rollout 0: the start)", xlabel="rollout", ylabel="gold")
    axes[2].set(title="Proxy (reward model) against gold", xlabel="gold", ylabel="proxy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(out: Path, results: list[dict]) -> list[dict]:
    if not results:
        raise SystemExit(f"no finished seed in {out}")
    rows = rows_of(results)
    table = aggregate(rows)
    write_csv(out / "order_rows.csv", rows)
    accuracy = ", ".join("n/a" if r["rm_accuracy"] is None else f"{r['rm_accuracy']:.3f}" for r in results)
    header = (
        f"Seeds {[r['seed'] for r in results]}; mean ± sd over seeds; held-out prompts at T = 0.7; "
        f"reward-model held-out gold accuracy per seed: {accuracy}.\n\n"
    )
    text = header + markdown(table, results) + "\n"
    (out / "order.md").write_text(text, encoding="utf-8")
    plot(out / "order.png", table, results)
    print(text, flush=True)
    print(f"wrote {out / 'order.md'}, order_rows.csv, order.png", flush=True)
    return table


def finished(root: Path, args) -> bool:
    """Whether every policy of a seed has its figures cached, at the rate this invocation would use (the pinned
    one, or the one chosen on this grid)."""
    if args.dpo_lr is not None:
        lr = args.dpo_lr
    else:
        record = root / "dpo_lr.json"
        if not record.is_file():
            return False
        selection = json.loads(record.read_text())
        if selection["pinned"] or [g["lr"] for g in selection["grid"]] != list(args.dpo_lrs):
            return False
        lr = selection["chosen"]
    folders = dpo_folders(lr)
    caches = ["sft_meter.json", f"{run_name(BASE)}/sweep_rows.json", f"{folders['dpo-ppo']}/sweep_rows.json"]
    caches += [f"{folders[arm]}/order_rows.json" for arm in ("dpo", "ppo-dpo", "ppo-dpo-ref-sft")]
    return all((root / c).is_file() for c in caches)


def positive_rate(text: str) -> float:
    """A learning rate from the command line: a finite number above 0."""
    rate = float(text)
    if not (math.isfinite(rate) and rate > 0):
        raise argparse.ArgumentTypeError(f"a learning rate must be a finite number above 0, got {text}")
    return rate


def dpo_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's own options (``--dpo-lr``, ``--dpo-lrs``) and the rest (``ppo_sweep.py``'s)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--dpo-lr", type=positive_rate, help="pin DPO's learning rate (no grid); default: tuned")
    p.add_argument("--dpo-lrs", type=positive_rate, nargs="+", help="the grid (default: DPO_LRS of the size)")
    own, rest = p.parse_known_args(argv)
    if own.dpo_lr is not None and own.dpo_lrs is not None:
        p.error("--dpo-lr pins the rate and --dpo-lrs is the grid it is chosen from: give one of them")
    if own.dpo_lrs is not None and len(set(own.dpo_lrs)) != len(own.dpo_lrs):
        p.error(f"--dpo-lrs has a rate twice: {own.dpo_lrs}")
    return own, rest


def order_args(argv: list[str]) -> argparse.Namespace:
    """``ppo_sweep.py``'s options (its sweep is not used) with ``dpo_lr`` (None: tuned) and ``dpo_lrs`` (the
    grid, ascending)."""
    own, rest = dpo_options(argv)
    args = parse_args(["--sweep", "kl_coef", *rest])
    args.dpo_lr = own.dpo_lr
    args.dpo_lrs = tuple(sorted(own.dpo_lrs or DPO_LRS[args.size]))
    return args


def main(argv=None) -> int:
    from rlhfkit.engine.threads import set_num_threads

    argv = list(sys.argv[1:] if argv is None else argv)
    args = order_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    s = sizes_of(args)
    set_num_threads()
    seeds = args.seeds
    if args.report_only or (args.jobs > 1 and len(args.seeds) > 1):
        env = {**os.environ, "RLHFKIT_NUM_THREADS": os.environ.get("RLHFKIT_NUM_THREADS", "1")}
        pending, running = ([] if args.report_only else list(args.seeds)), []
        while pending or running:
            while pending and len(running) < args.jobs:
                child = [*argv, "--seeds", str(pending.pop(0)), "--no-report", "--jobs", "1"]
                running.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *child], env=env))
            running[0].wait()
            if running[0].returncode != 0:
                print(f"a seed failed: {' '.join(running[0].args)}", file=sys.stderr)
                return 1
            running.pop(0)
        args.overwrite = False  # the children trained; from here on every figure comes from the caches
        seeds = [seed for seed in args.seeds if finished(args.out / f"seed-{seed}", args)]
    results = [run_seed(seed, s, args) for seed in seeds]
    if not args.no_report:
        report(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
