"""Reward-model overoptimization against reward-model quality and the KL coefficient (Gao et al. 2022, on the built-in task).

Gao, Schulman & Hilton (2022, "Scaling Laws for Reward Model Overoptimization") optimise a policy against proxy
reward models of several sizes and training-set sizes and measure the gold reward against d = sqrt(KL to the
initial policy): the gold score rises, peaks and falls, and the better the reward model the later and higher
the peak. They fit, for best-of-n and for RL,

    gold_bon(d) = d (α − β d)          gold_RL(d) = d (α − β log d)

(gold relative to the initial policy). Here, on the ``reviews`` task:

1. one SFT policy (the quickstart's tiny one: trained here, or taken from ``--quickstart DIR``) and one pool of
   pairs sampled from it and labelled by the task's annotators (4,096 for training, 512 held out);
2. per seed, reward models from that SFT policy on the first 256, 1,024 and 4,000 pairs of the pool (1.5
   epochs at batch 32, at least ``--rm-steps`` = 150 steps): the reward-model quality is the held-out gold accuracy;
3. per seed and reward model, PPO runs long enough (constant learning rate) to go far from the SFT policy:
   kl_coef 0 and 0.05, and kl_coef 0 with the online reward-model refresh of :mod:`rlhfkit.trainers.online.refresh`
   every ``--refresh-steps`` rollouts (the quickstart's ``--refresh-steps``);
4. every ``--eval-every`` rollouts (and before the first): one T = 0.7 response to each of ``--eval-prompts``
   held-out prompts, the same sampling seed for every checkpoint: gold, proxy (the reward model PPO
   optimises, refreshed or not), KL to the SFT policy (k1, nats per response), length, validity.

The seeds vary the reward models' training and PPO; the SFT policy and the pool of labelled pairs are shared
(as a user's quickstart has one of each). ``overoptimization_quality_report.py`` beside this script fits both of
Gao et al.'s forms and a line per reward model and KL coefficient and writes ``OUT/table.md``, ``OUT/fits.csv``,
``OUT/rows.csv`` and ``OUT/overoptimization.png``. A finished stage or run is reused (``--overwrite`` reruns)::

    python examples/experiments/overoptimization_quality.py --out runs/overopt_quality          # 2 jobs at a time
    python examples/experiments/overoptimization_quality.py --out runs/overopt_quality --quickstart runs/qs
    python examples/experiments/overoptimization_quality.py --out runs/overopt_quality --report-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # the stages, the meter and the report beside this script
import temperature  # noqa: E402
from ppo_sweep import Meter  # noqa: E402
from temperature import (  # noqa: E402
    Sizes,
    add_size_arguments,
    label,
    ppo_config,
    sizes_argv,
    train_reward_model,
    train_sft,
)

QUALITIES = (256, 1024, 4000)  # training pairs per reward model (the pool keeps ~4,070 of 4,096 after ties)
KL_COEFS = (0.0, 0.05)
REFRESH_KL_COEFS = (0.0,)  # the refresh runs: at these KL coefficients, for these reward models
REFRESH_QUALITIES = (256, 4000)
EVAL_TEMPERATURE = 0.7
SIZES = {
    "default": replace(
        Sizes(),
        pairs=4096,
        rm_steps=150,
        rm_batch=32,
        ppo_batch=16,
        ppo_lr=1e-4,
        rollouts=40,
        eval_every=5,
        eval_prompts=128,
    ),
    "smoke": replace(temperature.SIZES["smoke"], eval_every=1),  # the temperature experiment's smoke sizes
}
EVAL_PAIRS = {"default": 512, "smoke": 8}


def run_name(kl_coef: float, refresh_steps: int) -> str:
    return f"kl{kl_coef:g}" + (f"-refresh{refresh_steps}" if refresh_steps else "")


def runs_of(args, quality: int) -> list[dict]:
    """The PPO runs of one reward model: every KL coefficient plain, the refresh ones with the refresh."""
    runs = [{"kl_coef": float(k), "refresh_steps": 0} for k in args.kl_coefs]
    if args.refresh_steps and quality in args.refresh_qualities:
        runs += [{"kl_coef": float(k), "refresh_steps": args.refresh_steps} for k in args.refresh_kl_coefs]
    return runs


def rm_steps(quality: int, s: Sizes, epochs: float) -> int:
    """Reward-model steps for ``quality`` pairs: ``epochs`` passes over them, at least ``s.rm_steps``."""
    return max(s.rm_steps, -(-int(epochs * quality) // s.rm_batch))


def shared_stage(args, s: Sizes) -> dict:
    """The SFT policy (trained, or the quickstart's) and the pool of labelled pairs with its nested subsets
    (a job, ``--child``, reads them back)."""
    from rlhfkit.tasks import get_task

    if args.child:
        args = argparse.Namespace(**{**vars(args), "overwrite": False})
    root = args.out / "shared"
    if args.quickstart is not None:
        q = args.quickstart
        stage = {
            "task": get_task("reviews", seed=args.task_seed),
            "files": {n: q / "task" / f"{n}.jsonl" for n in ("prompts_train", "prompts_eval")},
            "sft": q / "sft" / "final",
        }
        for path in (stage["sft"], *stage["files"].values()):
            if not path.exists():
                _fail(f"--quickstart {q}: {path} not found (is it a finished quickstart folder?)")
    else:
        stage = train_sft(root, args.task_seed, s, args)
    pool = label(root / "pairs", stage, args.task_seed, s, args, num_eval_pairs=EVAL_PAIRS[args.size])
    lines = (pool / "pairs_train.jsonl").read_text().splitlines()
    if len(lines) < max(args.qualities):
        _fail(
            f"the pool holds {len(lines)} pairs (after dropping ties), fewer than --qualities' {max(args.qualities)}"
        )
    subsets = {}
    for n in args.qualities:  # the first n pairs: a random subset (the pool's prompts are drawn at random)
        subsets[n] = pool / f"pairs_train_{n}.jsonl"
        if not subsets[n].is_file() or (args.overwrite and not args.child):
            subsets[n].write_text("\n".join(lines[:n]) + "\n")
    return {**stage, "pool": pool, "subsets": subsets}


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_job(seed: int, quality: int, shared: dict, s: Sizes, args) -> None:
    """One seed and reward model: train the reward model, then its PPO runs (each cached in ``run.json``)."""
    from rlhfkit.quickstart.pipeline import task_refresh
    from rlhfkit.trainers import online

    root = args.out / f"seed-{seed}" / f"rm{quality}"
    sized = replace(s, rm_steps=rm_steps(quality, s, args.rm_epochs))
    clock, trained = time.process_time(), args.overwrite or not (root / "reward" / "summary.json").is_file()
    train_reward_model(
        root / "reward",
        shared["sft"],
        shared["subsets"][quality],
        shared["pool"] / "pairs_eval.jsonl",
        seed,
        sized,
        args,
    )
    rm_summary = json.loads((root / "reward" / "summary.json").read_text())
    stage = {**shared, "reward": root / "reward" / "final"}
    if trained:  # its CPU time counts (not when read back)
        (root / "rm_cpu.json").write_text(json.dumps({"cpu_seconds": time.process_time() - clock}))
    for run in runs_of(args, quality):
        folder = root / run_name(run["kl_coef"], run["refresh_steps"])
        if (folder / "run.json").is_file() and not args.overwrite:
            continue
        clock = time.process_time()
        # A meter per run: a refresh trains the trainer's copy of the reward model and hands it to this meter.
        meter = Meter(stage, s, seed)
        evals: list[dict] = []

        def hook(policy, step, evals=evals, meter=meter):
            figures = meter.measure(policy, final=step == s.rollouts)
            evals.append({"rollout": step, **figures})
            return {
                "eval/gold/mean": figures["gold"],
                "eval/score/mean": figures["proxy"],
                "eval/kl/mean": figures["kl"],
            }

        hooks = online.OnlineHooks(evaluate=hook)
        if run["refresh_steps"]:
            hooks.refresh_reward_model = task_refresh(
                stage["task"], meter, shared["subsets"][quality], s, seed, **json.loads(args.refresh_settings)
            )
        print(f"seed {seed}, reward model on {quality} pairs: PPO {run}, {s.rollouts} rollouts", flush=True)
        cfg = ppo_config(
            folder,
            seed,
            stage,
            s,
            s.rollouts,
            EVAL_TEMPERATURE,
            run["kl_coef"],
            **{"train.lr_schedule": "constant", "refresh.every": run["refresh_steps"]},
        )
        online.train(cfg, overwrite=True, hooks=hooks)
        record = {
            "seed": seed,
            "quality": quality,
            **run,
            "rm_accuracy": rm_summary.get("heldout_gold_accuracy"),
            "rm_steps": sized.rm_steps,
            "eval": evals,
            "cpu_seconds": time.process_time() - clock,
        }
        (folder / "run.json").write_text(json.dumps(record, indent=1))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument(
        "--quickstart", type=Path, help="take the SFT policy and prompts of this finished quickstart"
    )
    p.add_argument("--task-seed", type=int, default=0, help="the task's seed (the quickstart's --seed)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument(
        "--qualities", type=int, nargs="+", default=list(QUALITIES), help="training pairs per reward model"
    )
    p.add_argument("--kl-coefs", type=float, nargs="+", default=list(KL_COEFS))
    p.add_argument("--refresh-kl-coefs", type=float, nargs="*", default=list(REFRESH_KL_COEFS))
    p.add_argument("--refresh-qualities", type=int, nargs="*", default=list(REFRESH_QUALITIES))
    p.add_argument(
        "--refresh-steps", type=int, default=5, help="rollouts between refreshes (0: no refresh runs)"
    )
    p.add_argument(
        "--refresh-settings",
        default="{}",
        metavar="JSON",
        help="RefreshConfig fields, e.g. '{\"pairs\": 64}'",
    )
    p.add_argument("--rm-epochs", type=float, default=1.5, help="passes over each reward model's pairs")
    add_size_arguments(p, SIZES)
    p.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="(seed, reward model) jobs at once"
    )
    p.add_argument("--overwrite", action="store_true", help="rerun finished stages and runs")
    p.add_argument("--report-only", action="store_true", help="only the tables and the plot from OUT")
    p.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a job: the shared stage exists
    args = p.parse_args(argv)
    if any(n < 2 for n in args.qualities) or any(k < 0 for k in args.kl_coefs + args.refresh_kl_coefs):
        p.error("--qualities must be >= 2 pairs and every KL coefficient >= 0")
    return args


def sizes_of(args) -> Sizes:
    return temperature.sizes_of(args, SIZES)


def child_argv(args, seed: int, quality: int) -> list[str]:
    argv = ["--out", str(args.out), "--seeds", str(seed), "--qualities", str(quality), "--size", args.size]
    argv += ["--kl-coefs", *map(str, args.kl_coefs), "--refresh-kl-coefs", *map(str, args.refresh_kl_coefs)]
    argv += ["--refresh-qualities", *map(str, args.refresh_qualities)]
    argv += ["--refresh-steps", str(args.refresh_steps), "--refresh-settings", args.refresh_settings]
    argv += ["--rm-epochs", str(args.rm_epochs), "--task-seed", str(args.task_seed), "--no-report", "--child"]
    argv += ["--quickstart", str(args.quickstart)] if args.quickstart is not None else []
    return argv + sizes_argv(args, SIZES)


def main(argv=None) -> int:
    from rlhfkit.engine.threads import set_num_threads

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    s = sizes_of(args)
    if not args.report_only:
        set_num_threads()
        clock, cpu = time.process_time(), args.out / "shared" / "cpu.json"
        fresh = args.overwrite or not (args.out / "shared" / "pairs" / "pairs_train.jsonl").is_file()
        shared = shared_stage(args, s)
        if fresh:  # the stage ran here (not read back): its CPU time counts
            cpu.write_text(json.dumps({"cpu_seconds": time.process_time() - clock}))
        # A seed at a time (its longest job first): an interrupted run leaves whole seeds.
        jobs = [(seed, n) for seed in args.seeds for n in sorted(args.qualities, reverse=True)]
        if args.jobs > 1 and len(jobs) > 1:
            env = {**os.environ, "RLHFKIT_NUM_THREADS": os.environ.get("RLHFKIT_NUM_THREADS", "1")}
            running: list[subprocess.Popen] = []
            while jobs or running:
                while jobs and len(running) < args.jobs:
                    cmd = [sys.executable, os.path.abspath(__file__), *child_argv(args, *jobs.pop(0))]
                    running.append(subprocess.Popen(cmd, env=env))
                time.sleep(0.5)
                for proc in [r for r in running if r.poll() is not None]:
                    if proc.returncode != 0:
                        print(f"a job failed: {' '.join(proc.args)}", file=sys.stderr)
                        return 1
                    running.remove(proc)
        else:
            for seed, n in jobs:
                run_job(seed, n, shared, s, args)
    if not args.no_report:
        from overoptimization_quality_report import report

        print(report(args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
