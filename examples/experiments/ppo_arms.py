"""What the four claim experiments share (``length_bias.py``, ``ppo_epochs.py``, ``critic_init.py``,
``overfit_reward.py``): named PPO arms from one seed's SFT policy, each against one of that seed's reward
models, measured along the run as ``ppo_sweep.py`` measures (gold, proxy, KL to SFT, length, validity on the
held-out prompts at T = 0.7, the same sampling seed at every checkpoint), plus chosen training figures of every
rollout from ``metrics.jsonl``; every arm paired per seed against a base arm (:mod:`rlhfkit.reporting.paired`);
the tables, CSVs and the common panels of the figure.

An arm's reward model is named by a key of ``stage["rewards"]`` (``"reward"``: the seed's reward model, trained as
``temperature.py`` trains it); its proxy is measured with that reward model. Every arm's record is cached in its
folder (``sweep_rows.json``), so a rerun reuses it unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_sweep import Meter, ppo_run, sft_figures  # noqa: E402
from temperature import Sizes, _common, _done  # noqa: E402
from temperature_report import plus_minus, write_csv  # noqa: E402

from rlhfkit.reporting.paired import describe, paired, verdict  # noqa: E402

FIGURES = (("gold", 2), ("proxy", 2), ("kl", 2), ("length", 1), ("valid_rate", 2))
UNITS = {
    "gold": "gold score",
    "proxy": "proxy score (reward-model units)",
    "kl": "KL to SFT (nats / response)",
}
UNITS |= {"length": "response length (tokens)", "valid_rate": "valid responses (share)"}


@dataclass(frozen=True)
class Arm:
    """One PPO run of a seed: its folder name, label, KL coefficient, reward model and other dotted keys."""

    name: str
    label: str
    kl_coef: float = 0.05
    reward: str = "reward"
    settings: dict = field(default_factory=dict)
    refresh_every: int = 0  # the online reward-model refresh every K rollouts (0: none)
    folder: str | None = (
        None  # the run's folder under the seed's; default: ``name`` (a sweep's run: its name)
    )

    @property
    def path(self) -> str:
        return self.folder or self.name


def train_reward_variant(
    folder: Path, stage: dict, train_file: Path, seed: int, s: Sizes, args, **keys
) -> Path:
    """A reward model from the seed's SFT policy as ``temperature.py`` trains it, with ``keys`` replacing or adding
    dotted keys (e.g. ``reward.length_bias_coef``); its ``final/`` folder (kept when already trained)."""
    from rlhfkit.config import config_from
    from rlhfkit.trainers import reward

    if not _done(folder, args):
        print(f"seed {seed}: reward model {folder.name} {keys or ''}", flush=True)
        settings = {
            **_common(seed, s),
            "model.name_or_path": stage["sft"],
            "data.train_file": train_file,
            "data.eval_file": stage["pairs"]["eval"],
            "train.max_steps": s.rm_steps,
            "train.batch_size": s.rm_batch,
            "train.learning_rate": s.rm_lr,
            "train.weight_decay": 0.1,
            "train.warmup_steps": max(1, s.rm_steps // 15),
            "train.lr_schedule": "linear",
            "train.log_steps": 10,
            **keys,
        }
        steps = settings["train.max_steps"]
        settings |= {"train.save_steps": steps, "train.eval_steps": steps}
        reward.train(config_from("reward", folder, settings), overwrite=True)
    return folder / "final"


def pair_accuracy(reward_dir: Path, pairs_file: Path, s: Sizes) -> float:
    """The share of ``pairs_file``'s pairs whose chosen response the reward model scores higher (ties 1/2): on its
    own training pairs, how well it fits them."""
    import torch

    from rlhfkit.data import TokenLimits, prepare_examples
    from rlhfkit.models import load_scalar_model, load_tokenizer
    from rlhfkit.trainers.preference_data import PairCollator
    from rlhfkit.trainers.reward import score_examples

    tokenizer = load_tokenizer(str(reward_dir))
    model = load_scalar_model(str(reward_dir), tokenizer=tokenizer, frozen=True).eval()
    limits = TokenLimits(32, 32 + s.response_length)
    examples = prepare_examples(str(pairs_file), "preferences", tokenizer, limits)
    with torch.no_grad():
        chosen, rejected = score_examples(model, PairCollator(tokenizer.pad_token_id), examples, 64, "cpu")
    return float(((chosen > rejected).double() + 0.5 * (chosen == rejected).double()).mean())


def run_arms(root: Path, stage: dict, seed: int, s: Sizes, arms, args, train_keys=()) -> dict:
    """Every arm of one seed; ``{"seed", "rm_accuracy", "sft", "arms": {name: record}}``, a record holding the arm's
    held-out ``eval`` (every ``s.eval_every`` rollouts, rollout 0 the SFT policy) and ``train`` rows (the keys of
    ``ppo_sweep``'s TRAIN_KEYS and ``train_keys`` that a rollout logged)."""
    root.mkdir(parents=True, exist_ok=True)
    base_view = {**stage, "reward": stage["rewards"]["reward"]}
    meter, sft = sft_figures(root, base_view, seed, s, args)  # cached in root/sft_meter.json
    meters: dict[str, Meter | None] = {"reward": meter}
    out = {"seed": seed, "rm_accuracy": stage.get("rm_accuracy"), "sft": sft, "arms": {}}
    for arm in arms:
        view = {**stage, "reward": stage["rewards"][arm.reward]}
        run = {"kl_coef": arm.kl_coef, "gamma": arm.settings.get("online.gamma", 1.0)}
        run["lam"] = arm.settings.get("online.lam", 0.95)
        if arm.refresh_every:  # the refresh re-points its meter's proxy: a meter of its own
            from rlhfkit.quickstart.pipeline import task_refresh

            def refresh(m, view=view):  # args.refresh_settings: RefreshConfig fields (the smoke test's sizes)
                settings = getattr(args, "refresh_settings", None) or {}
                return task_refresh(view["task"], m, view["pairs"]["train"], s, seed, **settings)

            settings = {**arm.settings, "refresh.every": arm.refresh_every}
            _, record = ppo_run(root / arm.path, view, None, seed, s, run, args, refresh=refresh, **settings)
        else:
            meters[arm.reward], record = ppo_run(
                root / arm.path, view, meters.get(arm.reward), seed, s, run, args, **arm.settings
            )
        record["train"] = train_rows(root / arm.path, train_keys)
        out["arms"][arm.name] = record
    return out


def train_rows(folder: Path, keys) -> list[dict]:
    """Per rollout of ``folder/metrics.jsonl``: score, KL, response length and every key of ``keys`` it logged."""
    rows = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "score/mean" not in record:
            continue
        wanted = ("score/mean", "kl/mean", "response_length/mean", *keys)
        rows.append({"rollout": record["step"], **{k: record[k] for k in wanted if k in record}})
    return rows


def last_eval(record: dict) -> dict:
    return max(record["eval"], key=lambda e: e["rollout"])


def end_table(results: list[dict], arms) -> str:
    """The last checkpoint of every arm (and SFT): mean ± sd over seeds, gold per seed."""
    head = " | ".join(UNITS[f].split(" (")[0] for f, _ in FIGURES)
    lines = [f"| policy | {head} | gold per seed |", "|---|" + "---|" * (len(FIGURES) + 1)]

    def line(label: str, figures: list[dict]) -> str:
        row = {}
        for f, _ in FIGURES:
            values = [x.get(f) for x in figures if x.get(f) is not None]
            row[f] = float(np.mean(values)) if values else None
            row[f + "_sd"] = float(np.std(values, ddof=1)) if len(values) > 1 else None
        cells = " | ".join(plus_minus(row, f, d) for f, d in FIGURES)
        seeds = " / ".join(f"{x['gold']:.2f}" for x in figures)
        return f"| {label} | {cells} | {seeds} |"

    lines.append(line("SFT", [r["sft"] for r in results]))
    for arm in arms:
        lines.append(line(arm.label, [last_eval(r["arms"][arm.name]) for r in results]))
    return "\n".join(lines)


def paired_table(results: list[dict], arms, base: str, claims: dict | None = None) -> str:
    """Each arm against ``base`` at the last checkpoint, paired per seed (arm − base): mean (per seed), 95%
    t-interval, sign test; ``claims``: {arm name: (figure, +1 or -1)}, the direction a claim predicts, read into
    a verdict (holds / fails / open here)."""
    claims = claims or {}
    names = {a.name: a.label for a in arms}
    lines = [
        f"Paired per seed against {names[base]} (arm − base, last checkpoint; mean (per seed); 95% t-interval; "
        "sign test):",
        "",
        "| arm | " + " | ".join(f for f, _ in FIGURES) + " | claim: verdict |",
        "|---|" + "---|" * (len(FIGURES) + 1),
    ]
    for arm in arms:
        if arm.name == base:
            continue
        a = [last_eval(r["arms"][base]) for r in results]
        b = [last_eval(r["arms"][arm.name]) for r in results]
        cells, result = [], {}
        for f, digits in FIGURES:
            xs, ys = [x.get(f) for x in a], [y.get(f) for y in b]
            if any(v is None for v in xs + ys):
                cells.append("–")
                continue
            result[f] = paired(xs, ys)
            cells.append(describe(result[f], digits))
        claim = "–"
        if arm.name in claims:
            f, sign = claims[arm.name]
            claim = f"{f} {'up' if sign > 0 else 'down'}: {verdict(result[f], sign)}" if f in result else "–"
        lines.append(f"| {arm.label} | " + " | ".join(cells) + f" | {claim} |")
    return "\n".join(lines)


def eval_rows(results: list[dict], arms) -> list[dict]:
    """One row per seed, arm and checkpoint (rollout 0: the SFT policy)."""
    rows = []
    for r in results:
        for arm in arms:
            rows.append({"seed": r["seed"], "arm": arm.name, "rollout": 0, **r["sft"]})
            rows += [{"seed": r["seed"], "arm": arm.name, **e} for e in r["arms"][arm.name]["eval"]]
    return rows


def train_csv_rows(results: list[dict], arms) -> list[dict]:
    return [
        {"seed": r["seed"], "arm": arm.name, **t}
        for r in results
        for arm in arms
        for t in r["arms"][arm.name]["train"]
    ]


def curve(rows: list[dict], arm: str, f: str) -> tuple[list[int], list[float], list[float]]:
    """(rollouts, mean over seeds, sd over seeds) of figure ``f`` along ``arm``."""
    xs = sorted({r["rollout"] for r in rows if r["arm"] == arm})
    cells = [
        [r[f] for r in rows if (r["arm"], r["rollout"]) == (arm, x) and r.get(f) is not None] for x in xs
    ]
    means = [float(np.mean(c)) if c else float("nan") for c in cells]
    sds = [float(np.std(c, ddof=1)) if len(c) > 1 else 0.0 for c in cells]
    return xs, means, sds


def common_panels(axes, rows: list[dict], arms, title: str) -> None:
    """Gold, proxy and KL to SFT along every arm (mean ± sd over seeds), one colour per arm, a legend on each."""
    for ax, f in zip(axes, ("gold", "proxy", "kl"), strict=True):
        for i, arm in enumerate(arms):
            xs, means, sds = curve(rows, arm.name, f)
            ax.errorbar(xs, means, sds, marker="o", capsize=3, color=f"C{i}", label=arm.label)
        ax.set(
            title=f"{title}: {UNITS[f].split(' (')[0]} (held out, T = 0.7)", xlabel="rollout", ylabel=UNITS[f]
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def write_report(out: Path, name: str, results: list[dict], arms, text: str) -> tuple[list[dict], list[dict]]:
    """``OUT/<name>.md`` (``text`` under a header naming the seeds), ``<name>_rows.csv``, ``<name>_train.csv``;
    the rows for the figure."""
    if not results:
        raise SystemExit(f"no finished seed in {out}")
    rows, train = eval_rows(results, arms), train_csv_rows(results, arms)
    write_csv(out / f"{name}_rows.csv", rows)
    write_csv(out / f"{name}_train.csv", train)
    accuracy = ", ".join("n/a" if r["rm_accuracy"] is None else f"{r['rm_accuracy']:.3f}" for r in results)
    header = (
        f"Seeds {[r['seed'] for r in results]}; mean ± sd over seeds; held-out prompts at T = 0.7; "
        f"reward-model held-out gold accuracy per seed: {accuracy}.\n\n"
    )
    (out / f"{name}.md").write_text(header + text + "\n", encoding="utf-8")
    print(header + text, flush=True)
    return rows, train


def add_arguments(p) -> None:
    """The options every claim script shares (``ppo_sweep.py``'s sizes, seeds, jobs, caching)."""
    from temperature import SIZES, add_size_arguments

    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    add_size_arguments(p, SIZES)
    p.add_argument(
        "--jobs", type=int, default=2, help="seeds run at once, each in its own one-thread process"
    )
    p.add_argument("--overwrite", action="store_true", help="rerun finished stages and runs")
    p.add_argument("--report-only", action="store_true", help="only the tables and the figure, from OUT")
    p.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)


def run_seeds(script: str, argv: list[str], args, run_seed) -> list[dict] | None:
    """Each seed in its own one-thread process (``--jobs`` at a time) or here; then every seed's results read back
    from the caches (``run_seed(seed, args)``); None when a seed failed."""
    import os
    import subprocess

    from rlhfkit.engine.threads import set_num_threads

    set_num_threads()
    if not args.report_only and args.jobs > 1 and len(args.seeds) > 1:
        env = {**os.environ, "RLHFKIT_NUM_THREADS": os.environ.get("RLHFKIT_NUM_THREADS", "1")}
        pending, running = list(args.seeds), []
        while pending or running:
            while pending and len(running) < args.jobs:
                child = [*argv, "--seeds", str(pending.pop(0)), "--no-report", "--jobs", "1"]
                running.append(subprocess.Popen([sys.executable, script, *child], env=env))
            running[0].wait()
            if running[0].returncode != 0:
                print(f"a seed failed: {' '.join(running[0].args)}", file=sys.stderr)
                return None
            running.pop(0)
        args.overwrite = False  # the children trained; from here on every figure comes from the caches
    if args.report_only:  # only the seeds that have run (a missing arm of one of them is trained, though)
        args.seeds = [k for k in args.seeds if (args.out / f"seed-{k}" / "sft_meter.json").is_file()]
    return [run_seed(seed, args) for seed in args.seeds]


def seed_stage(root: Path, seed: int, s: Sizes, args) -> dict:
    """The seed's SFT policy, labelled pairs and reward model (``temperature.train_sft_and_reward``), with
    ``pairs`` (train / eval files) and ``rewards`` ({"reward": the reward model}) for :func:`run_arms`."""
    from temperature import train_sft_and_reward

    stage = train_sft_and_reward(root, seed, s, args)
    pairs = {k: root / "pairs" / f"pairs_{k}.jsonl" for k in ("train", "eval")}
    return {**stage, "root": root, "pairs": pairs, "rewards": {"reward": stage["reward"]}}
