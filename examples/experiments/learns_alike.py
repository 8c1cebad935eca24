"""Sharded PPO and GRPO, and the vLLM backend, learn as one plain process does: the built-in task, several seeds.

The sharding tests (tests/distributed) show that one update of 2 FSDP2-sharded processes equals one unsharded
process's in float64, and the vLLM tests that greedy engine tokens follow the synced actor. This experiment asks
the question a user asks: does a whole run learn the same? For each seed, one SFT policy and one reward model
trained as ``temperature.py`` trains them (the quickstart's tiny preset, 1,024 labelled pairs, 150 reward-model
steps), then PPO (GAE, critic from the reward model) and GRPO (group of 4, as many responses a rollout) from
them, each launched in several ways (arms) with the same settings and global batch:

- ``1``: ``rlhfkit train KIND`` in one process (two torch threads on a two-core machine), Hugging Face generate;
- ``2-dp``: ``torchrun --nproc_per_node 2`` (plain data parallelism, one thread each);
- ``2-sharded``: the same with ``train.sharding=full_shard`` (actor and critic sharded with their AdamW state,
  the reference and reward model sharded forward-only);
- ``vllm``: one process with ``online.generation_backend=vllm`` (needs the environment of ``./setup.sh vllm``;
  not among the default arms);
- ``2-sharded-vllm``: ``2-sharded`` with one vLLM engine per process (the same environment), paired against
  ``2-sharded``.

The other arms draw other samples than ``1`` (two processes each sample their half of the prompts with their
own generators; the engine has its own sampler), so they are not the same trajectory; the question is whether
their results agree seed by seed. Each final policy is measured as ``ppo_sweep.py`` measures a final policy
(4 responses at T = 0.7 to every held-out prompt, the same sampling seed for every policy, the evaluation's
standard error beside each mean): gold (the task's
annotators), proxy (the seed's reward model), KL to the SFT policy, length. The verdicts of an arm, by the page's
rule (:func:`rlhfkit.reporting.paired.decide`): gold against its base arm "no difference within ±0.1", and gold
above the SFT policy's.

Writes ``OUT/learns_alike.md`` (per seed and arm; paired differences against ``1``), ``OUT/learns_alike.csv`` and
``OUT/learns_alike.png`` (the training proxy score per rollout, mean over seeds, and the final gold per seed). A
finished run is reused (``--overwrite`` reruns it)::

    python examples/experiments/learns_alike.py --out runs/learns-alike                 # seeds 0-4, ~30 min
    .venv-vllm/bin/python examples/experiments/learns_alike.py --out runs/learns-alike-vllm --arms 1 vllm
    .venv-vllm/bin/python examples/experiments/learns_alike.py --out runs/learns-alike-sharded-vllm \
        --arms 2-sharded 2-sharded-vllm
    python examples/experiments/learns_alike.py --out runs/learns-alike --report-only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ppo_sweep import EVAL_TEMPERATURE, Meter  # noqa: E402
from temperature import SIZES, Sizes, add_size_arguments, sizes_of, train_sft_and_reward  # noqa: E402
from temperature_report import write_csv  # noqa: E402

from rlhfkit.reporting.paired import describe, paired  # noqa: E402

KINDS = ("ppo", "grpo")
ARMS = {  # name: (processes, extra dotted keys, label)
    "1": (1, {}, "1 process"),
    "2-dp": (2, {}, "2 processes, data parallel"),
    "2-sharded": (2, {"train.sharding": "full_shard"}, "2 processes, FSDP2 full_shard"),
    "vllm": (1, {"online.generation_backend": "vllm"}, "1 process, vLLM engine"),
    "2-sharded-vllm": (
        2,
        {"train.sharding": "full_shard", "online.generation_backend": "vllm"},
        "2 processes, FSDP2 full_shard, vLLM engine",
    ),
}
BASE_OF = {"2-sharded-vllm": "2-sharded"}  # the arm each is paired against; the others against "1"
DEFAULT_ARMS = ("1", "2-dp", "2-sharded")
GROUP_SIZE = 4  # GRPO's responses per prompt: batch_size / 4 prompts, the same number of responses as PPO
FIGURES = (("gold", 2), ("proxy", 2), ("kl", 2), ("length", 1))


def run_config(kind: str, folder: Path, seed: int, stage: dict, s: Sizes) -> dict:
    """The dotted keys of one run: the quickstart's tiny PPO (or GRPO with as many responses a rollout)."""
    keys = {
        "output_dir": str(folder),
        "seed": seed,
        "model.name_or_path": str(stage["sft"]),
        "data.train_file": str(stage["files"]["prompts_train"]),
        "data.max_prompt_length": 32,
        "online.reward_model": str(stage["reward"]),
        "online.response_length": s.response_length,
        "online.temperature": EVAL_TEMPERATURE,
        "online.kl_coef": 0.05,
        "train.max_steps": s.rollouts,
        "train.batch_size": s.ppo_batch,
        "train.learning_rate": s.ppo_lr,
        "train.lr_schedule": "linear",
        "train.save_steps": s.rollouts,
        "train.log_steps": 1,
    }
    if kind == "grpo":
        keys |= {"online.group_size": GROUP_SIZE, "train.batch_size": max(2, s.ppo_batch // GROUP_SIZE)}
    return keys


def launch_argv(kind: str, arm: str, config: Path) -> list[str]:
    """The command line of one run (``torchrun`` for two processes)."""
    processes, extra, _ = ARMS[arm]
    cli = ["-m", "rlhfkit.cli", "train", kind, "--config", str(config), "--overwrite"]
    cli += [f"{k}={v}" for k, v in extra.items()]
    if processes == 1:
        return [sys.executable, *cli]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
    ]
    return torchrun + cli


def train_rows(folder: Path) -> list[dict]:
    """The training proxy score and KL of every rollout (``metrics.jsonl``)."""
    from rlhfkit.engine.metrics_writer import read_metrics

    return [
        {"rollout": r["step"], "score": r["score/mean"], "kl": r["kl/mean"]}
        for r in read_metrics(folder / "metrics.jsonl")
        if "score/mean" in r and "kl/mean" in r
    ]


def one_run(kind: str, arm: str, root: Path, seed: int, stage: dict, s: Sizes, meter_of, args) -> dict:
    """Train (unless cached) and measure one run; its record is cached in ``root/KIND-ARM/record.json``."""
    import yaml

    folder = root / f"{kind}-{arm}"
    cache = folder.with_name(folder.name + ".json")
    if cache.is_file() and not args.overwrite:
        record = json.loads(cache.read_text())
        if "eval_samples" in record or not (folder / "final").is_dir():
            return record
        # measured by the earlier one-sample read: measure its final policy again, keep its training figures
        record.update(meter_of().measure_saved(folder / "final"))
        cache.write_text(json.dumps(record, indent=1))
        return record
    if folder.exists():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    config = folder.with_name(folder.name + ".yaml")
    nested: dict = {}
    for key, value in run_config(kind, folder, seed, stage, s).items():
        *parents, leaf = key.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    config.write_text(yaml.safe_dump(nested, sort_keys=False))
    argv = launch_argv(kind, arm, config)
    print(f"seed {seed}: {kind} {ARMS[arm][2]}: {' '.join(argv[1:])}", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RLHFKIT_NUM_THREADS", "OMP_NUM_THREADS")}
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    record = {
        "kind": kind,
        "arm": arm,
        "seed": seed,
        "seconds": seconds,
        **meter_of().measure_saved(folder / "final"),
    }
    record["train"] = train_rows(folder)
    cache.write_text(json.dumps(record, indent=1))
    return record


def run_seed(seed: int, s: Sizes, args) -> list[dict]:
    from rlhfkit.engine.threads import set_num_threads

    set_num_threads()
    root = args.out / f"seed-{seed}"
    stage = train_sft_and_reward(root, seed, s, args)
    meters: list = []

    def meter_of():
        if not meters:
            meters.append(Meter(stage, s, seed))
        return meters[0]

    sft_cache = root / "sft_meter.json"
    figures = json.loads(sft_cache.read_text()) if sft_cache.is_file() and not args.overwrite else {}
    if "eval_samples" not in figures:  # none yet, or the earlier one-sample read
        figures = meter_of().measure(meter_of().reference, final=True)
        sft_cache.write_text(json.dumps(figures, indent=1))
    sft = {"kind": "sft", "arm": "sft", "seed": seed, **figures}
    records = [sft]
    for kind in args.kinds:
        for arm in args.arms:
            records.append(one_run(kind, arm, root, seed, stage, s, meter_of, args))
    return records


def collect(out: Path, seeds, kinds, arms) -> list[dict]:
    """The cached records of the finished runs (and each seed's SFT figures)."""
    records = []
    for seed in seeds:
        root = out / f"seed-{seed}"
        if (root / "sft_meter.json").is_file():
            records.append(
                {
                    "kind": "sft",
                    "arm": "sft",
                    "seed": seed,
                    **json.loads((root / "sft_meter.json").read_text()),
                }
            )
        for kind in kinds:
            for arm in arms:
                path = root / f"{kind}-{arm}.json"
                if path.is_file():
                    records.append(json.loads(path.read_text()))
    return records


def _by(records, kind, arm) -> dict[int, dict]:
    return {r["seed"]: r for r in records if r["kind"] == kind and r["arm"] == arm}


MARGIN = 0.1  # gold: "no difference" when the 90% interval of arm minus base lies inside ±MARGIN (the page's)


def verdict(base: dict[int, dict], other: dict[int, dict], sft: dict[int, dict]) -> str:
    """The page's rule (:func:`rlhfkit.reporting.paired.decide`) on the two claims of "this arm learns as its base
    arm does": gold, arm minus base, is no different within ±``MARGIN``; and the arm ends above the SFT policy
    (arm minus SFT, a direction)."""
    from rlhfkit.reporting.paired import Claim, decide

    seeds = sorted(set(base) & set(other) & set(sft))
    if not seeds:
        return "alike: open; above SFT: open (no seed has both runs)"
    gold = lambda by: [by[s]["gold"] for s in seeds]  # noqa: E731
    alike = decide(paired(gold(base), gold(other)), Claim(0, MARGIN))
    above = decide(paired(gold(sft), gold(other)), Claim(+1))
    return f"alike (within ±{MARGIN:g} gold): {alike}; above SFT: {above}"


def markdown(records: list[dict], kinds, arms) -> str:
    sft = _by(records, "sft", "sft")
    seeds = sorted(sft)
    lines = ["# PPO and GRPO launched several ways against one plain process", ""]
    lines += [
        f"Seeds {', '.join(map(str, seeds))}; held-out figures of each final policy at T = {EVAL_TEMPERATURE}.",
        "",
    ]
    head = "| run | " + " | ".join(f"{name} (per seed)" for name, _ in FIGURES) + " | seconds |"
    lines += [head, "|---" * (len(FIGURES) + 2) + "|"]

    def row(label, by):
        cells = []
        for name, digits in FIGURES:
            values = [by[s][name] for s in seeds if s in by]
            cells.append(f"{np.mean(values):.{digits}f} ({' / '.join(f'{v:.{digits}f}' for v in values)})")
        secs = [by[s]["seconds"] for s in seeds if s in by and "seconds" in by[s]]
        return (
            f"| {label} | " + " | ".join(cells) + f" | {np.mean(secs):.0f} |"
            if secs
            else f"| {label} | " + " | ".join(cells) + " | |"
        )

    lines.append(row("SFT", sft))
    for kind in kinds:
        for arm in arms:
            by = _by(records, kind, arm)
            if by:
                lines.append(row(f"{kind.upper()}, {ARMS[arm][2]}", by))
    lines.append("")
    for kind in kinds:
        for arm in arms:
            base_arm = BASE_OF.get(arm, "1")
            base, by = _by(records, kind, base_arm), _by(records, kind, arm)
            common = [s for s in seeds if s in base and s in by]
            if arm == "1" or not common:
                continue
            p = paired([base[s]["gold"] for s in common], [by[s]["gold"] for s in common])
            lines.append(f"- {kind.upper()} gold, {ARMS[arm][2]} minus {ARMS[base_arm][2]}: {describe(p)}")
            lines.append(f"  - verdicts (the page's rule): {verdict(base, by, sft)}")
    return "\n".join(lines) + "\n"


LINES = {
    "1": ("C0", "-", 2.0),
    "2-dp": ("C1", "-", 3.0),
    "2-sharded": ("C2", "--", 1.5),
    "vllm": ("C3", "-", 1.5),
    "2-sharded-vllm": ("C4", "--", 1.5),
}


def plot(records: list[dict], kinds, arms, path: Path) -> None:
    """Top: each arm's training proxy score per rollout, mean over seeds (a dashed line over a wider one where
    two arms coincide). Bottom: the final gold per seed, one line per seed across the arms (the paired view)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(kinds), figsize=(5.5 * len(kinds), 7.5), squeeze=False)
    sft = _by(records, "sft", "sft")
    for col, kind in enumerate(kinds):
        top, bottom = axes[0][col], axes[1][col]
        shown = [a for a in arms if _by(records, kind, a)]
        for arm in shown:
            by = _by(records, kind, arm)
            curves = [np.array([t["score"] for t in r["train"]]) for r in by.values()]
            n = min(len(c) for c in curves)
            color, style, width = LINES[arm]
            mean = np.mean([c[:n] for c in curves], axis=0)
            top.plot(np.arange(1, n + 1), mean, color=color, ls=style, lw=width, label=ARMS[arm][2])
        for seed in sorted(sft):
            xs = [i for i, a in enumerate(shown) if seed in _by(records, kind, a)]
            ys = [_by(records, kind, shown[i])[seed]["gold"] for i in xs]
            bottom.plot(xs, ys, "o-", color="grey", alpha=0.6, lw=1)
            if xs:
                bottom.annotate(
                    f"seed {seed}", (xs[-1], ys[-1]), fontsize=7, xytext=(5, -2), textcoords="offset points"
                )
        if sft:
            bottom.axhline(
                np.mean([r["gold"] for r in sft.values()]), color="k", ls=":", label="SFT (mean over seeds)"
            )
        top.set_title(f"{kind.upper()}: training proxy score per rollout (mean over seeds)", fontsize=10)
        top.set_xlabel("rollout")
        top.set_ylabel("reward-model score (proxy units)")
        top.legend(fontsize=8)
        bottom.set_title(f"{kind.upper()}: held-out gold of the final policy, one line per seed", fontsize=10)
        bottom.set_xticks(range(len(shown)), [ARMS[a][2].replace(", ", ",\n") for a in shown], fontsize=8)
        bottom.set_xlim(-0.3, len(shown) - 0.4)
        bottom.set_ylabel("gold score (task annotators)")
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path, seeds, kinds, arms) -> str:
    records = collect(out, seeds, kinds, arms)
    text = markdown(records, kinds, arms)
    (out / "learns_alike.md").write_text(text)
    write_csv(out / "learns_alike.csv", [{k: v for k, v in r.items() if k != "train"} for r in records])
    plot(records, kinds, arms, out / "learns_alike.png")
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(DEFAULT_ARMS))
    add_size_arguments(p, SIZES)
    p.add_argument("--overwrite", action="store_true", help="rerun finished stages and runs")
    p.add_argument("--report-only", action="store_true", help="only the table and plot from OUT")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        s = sizes_of(args, SIZES)
        for seed in args.seeds:
            run_seed(seed, s, args)
    print(report(args.out, args.seeds, args.kinds, args.arms), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
