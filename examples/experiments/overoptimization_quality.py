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
   the refresh labels N more pairs (``refresh/pairs`` of its last refresh), so for the reward models of
   ``--matched-qualities`` (256) a control follows it in the same job: the same PPO run without a refresh,
   against an offline reward model trained as the others on the first 256 + N pairs of the pool (an equal
   label budget, all sampled from the SFT policy);
4. every ``--eval-every`` rollouts: one T = 0.7 response to each of ``--eval-prompts`` held-out prompts, the
   same sampling seed for every checkpoint: gold, proxy (the reward model PPO optimises, refreshed or not), KL
   to the SFT policy (k1, nats per response), length, validity; before the first rollout (the SFT policy) and
   after the last, the final read (``ppo_sweep.Meter``: ``--final-samples`` responses to each of the
   ``--final-prompts`` held-out prompts, with standard errors), so the end is measured against the start with
   the same read.

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
# the refreshed reward models that get the offline control at the refresh's label budget
MATCHED_QUALITIES = (256,)
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


def run_name(kl_coef: float, refresh_steps: int, matched: int = 0) -> str:
    """``kl0``, ``kl0-refresh5``, and ``kl0-matched-refresh5`` for the offline control of ``kl0-refresh5``."""
    if matched:
        return f"kl{kl_coef:g}-matched-refresh{matched}"
    return f"kl{kl_coef:g}" + (f"-refresh{refresh_steps}" if refresh_steps else "")


def refresh_labels(records: list[dict], where: str = "the refresh run") -> int:
    """N, the pairs a refresh run labelled: ``refresh/pairs`` (the pairs collected so far, the reward model's own
    training pairs not counted) at the run's last refresh, from its metrics records (``metrics.jsonl``)."""
    counts = [(r["step"], r["refresh/pairs"]) for r in records if "refresh/pairs" in r]
    if not counts:
        raise ValueError(f"{where}: no record holds refresh/pairs (did the run refresh its reward model?)")
    return int(max(counts)[1])  # the latest step (a resumed run logs some steps twice, with the same count)


def refresh_label_bound(args, rollouts: int) -> int:
    """The most pairs one refresh run can label: ``refresh.pairs`` per refresh, one refresh every
    ``--refresh-steps`` rollouts (identical or empty pairs are dropped, so N is at most this)."""
    from rlhfkit.config import RefreshConfig

    pairs = json.loads(args.refresh_settings).get("pairs", RefreshConfig.pairs)
    return int(pairs) * (rollouts // args.refresh_steps) if args.refresh_steps else 0


def runs_of(args, quality: int) -> list[dict]:
    """The PPO runs of one reward model: every KL coefficient plain, the refresh ones with the refresh."""
    runs = [{"kl_coef": float(k), "refresh_steps": 0} for k in args.kl_coefs]
    if args.refresh_steps and quality in args.refresh_qualities:
        runs += [{"kl_coef": float(k), "refresh_steps": args.refresh_steps} for k in args.refresh_kl_coefs]
    return runs


def matched_runs_of(args, quality: int) -> list[dict]:
    """The offline controls of one reward model: one per refresh run, after it (its label budget is read from it)."""
    if quality not in args.matched_qualities:
        return []
    return [
        {**r, "refresh_steps": 0, "matched_refresh": r["refresh_steps"]}
        for r in runs_of(args, quality)
        if r["refresh_steps"]
    ]


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
    """One seed and reward model: train the reward model, then its PPO runs (each cached in ``run.json``), then
    the offline control of each refresh run at that run's label budget."""
    from rlhfkit.engine.metrics_writer import read_metrics

    root = args.out / f"seed-{seed}" / f"rm{quality}"
    stage, rm = reward_stage(root, "reward", shared, shared["subsets"][quality], quality, seed, s, args)
    for run in runs_of(args, quality):
        folder = root / run_name(run["kl_coef"], run["refresh_steps"])
        ppo_run(folder, stage, rm, run, quality, seed, s, args)
        read_start_finally(folder, stage, seed, s)
    for run in matched_runs_of(args, quality):
        refreshed = root / run_name(run["kl_coef"], run["matched_refresh"])
        extra = refresh_labels(read_metrics(refreshed / "metrics.jsonl"), str(refreshed / "metrics.jsonl"))
        pool = (shared["pool"] / "pairs_train.jsonl").read_text().splitlines()
        if quality + extra > len(pool):  # main() checks the bound before any job; this is what it bounds
            _fail(
                f"{refreshed} labelled {extra} pairs: {quality} + {extra} is more than the pool's {len(pool)}"
            )
        name = run_name(run["kl_coef"], 0, run["matched_refresh"])
        # the first quality + N pairs of the pool: the reward model's own, then N more
        pairs, control_args = root / f"pairs_{name}.jsonl", args
        if not pairs.is_file() or len(pairs.read_text().splitlines()) != quality + extra:
            pairs.write_text("\n".join(pool[: quality + extra]) + "\n")
            # a rerun refresh run labelled a different N: the control's reward model and run are stale
            control_args = argparse.Namespace(**{**vars(args), "overwrite": True})
        control, crm = reward_stage(
            root, f"reward-{name}", shared, pairs, quality + extra, seed, s, control_args
        )
        ppo_run(root / name, control, crm, run, quality, seed, s, control_args)
        read_start_finally(root / name, control, seed, s)


def reward_stage(root: Path, name: str, shared: dict, pairs: Path, count: int, seed: int, s: Sizes, args):
    """The reward model ``root/name`` on the ``count`` pairs of ``pairs`` (1.5 epochs, at least ``s.rm_steps``
    steps: :func:`rm_steps`), unless it is there; the stage PPO runs from and the figures a run records of it."""
    folder = root / name
    sized = replace(s, rm_steps=rm_steps(count, s, args.rm_epochs))
    clock, trained = time.process_time(), args.overwrite or not (folder / "summary.json").is_file()
    train_reward_model(folder, shared["sft"], pairs, shared["pool"] / "pairs_eval.jsonl", seed, sized, args)
    summary = json.loads((folder / "summary.json").read_text())
    if trained:  # its CPU time counts (not when read back)
        cpu = root / ("rm_cpu.json" if name == "reward" else f"rm_cpu-{name}.json")
        cpu.write_text(json.dumps({"cpu_seconds": time.process_time() - clock}))
    rm = {"rm_accuracy": summary.get("heldout_gold_accuracy"), "rm_steps": sized.rm_steps, "labels": count}
    return {**shared, "reward": folder / "final"}, rm


def ppo_run(folder: Path, stage: dict, rm: dict, run: dict, quality: int, seed: int, s: Sizes, args) -> None:
    """One PPO run against ``stage``'s reward model, measured every ``s.eval_every`` rollouts, unless it is there;
    its ``run.json`` holds the run, the reward model's figures ``rm`` and every evaluation."""
    from rlhfkit.engine.metrics_writer import read_metrics
    from rlhfkit.quickstart.pipeline import task_refresh
    from rlhfkit.trainers import online

    if (folder / "run.json").is_file() and not args.overwrite:
        return
    clock = time.process_time()
    # A meter per run: a refresh trains the trainer's copy of the reward model and hands it to this meter.
    meter = Meter(stage, s, seed)
    evals: list[dict] = []

    def hook(policy, step):
        # the start (the SFT policy, shared by the runs of one reward model) and the end take the final read
        figures = (
            start_read(stage, seed, s, meter)
            if step == 0
            else meter.measure(policy, final=step == s.rollouts)
        )
        evals.append({"rollout": step, **figures})
        return {
            "eval/gold/mean": figures["gold"],
            "eval/score/mean": figures["proxy"],
            "eval/kl/mean": figures["kl"],
        }

    hooks = online.OnlineHooks(evaluate=hook)
    if run["refresh_steps"]:
        hooks.refresh_reward_model = task_refresh(
            stage["task"], meter, stage["subsets"][quality], s, seed, **json.loads(args.refresh_settings)
        )
    print(f"seed {seed}, reward model on {rm['labels']} pairs: PPO {run}, {s.rollouts} rollouts", flush=True)
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
    record = {"seed": seed, "quality": quality, **run, **rm, "eval": evals}
    if run["refresh_steps"]:  # the pairs it labelled, beside the reward model's own
        record["refresh_labels"] = refresh_labels(read_metrics(folder / "metrics.jsonl"), str(folder))
    record["cpu_seconds"] = time.process_time() - clock
    (folder / "run.json").write_text(json.dumps(record, indent=1))


def start_read(stage: dict, seed: int, s: Sizes, meter: Meter | None = None) -> dict:
    """The final read of the SFT policy, a run's start. It depends on the seed, the sizes and the reward model the
    run starts against (a refresh replaces it later), so the runs of one reward model share it: cached beside that
    reward model (an --overwrite that retrains the reward model empties its folder, and the cache with it)."""
    cache = Path(stage["reward"]).parent / f"start_read_seed{seed}_{s.final_samples}x{s.final_prompts}.json"
    if not cache.is_file():
        meter = meter or Meter(stage, s, seed)
        cache.write_text(json.dumps(meter.measure(meter.reference, final=True), indent=1))
    return json.loads(cache.read_text())


def read_start_finally(folder: Path, stage: dict, seed: int, s: Sizes) -> None:
    """Give a finished run's start (rollout 0) the final read, as :func:`ppo_run` now takes it, when the run was
    measured before it did: the read is seeded, so it is the figures the hook records (the evaluation hook runs
    under its own RNG, so training does not depend on it)."""
    record = json.loads((folder / "run.json").read_text())
    start = record["eval"][0]
    if start["rollout"] != 0 or "eval_samples" in start:
        return
    record["eval"][0] = {"rollout": 0, **start_read(stage, seed, s)}
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
    p.add_argument(
        "--matched-qualities",
        type=int,
        nargs="*",
        default=None,
        help="refreshed reward models whose refresh runs get the offline control at their label budget "
        f"(default: {', '.join(map(str, MATCHED_QUALITIES))}, where refreshed)",
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
    refreshed = set(args.qualities) & set(args.refresh_qualities) if args.refresh_steps else set()
    if args.matched_qualities is None:
        args.matched_qualities = [q for q in MATCHED_QUALITIES if q in refreshed]
    elif not set(args.matched_qualities) <= refreshed or (
        args.matched_qualities and not args.refresh_kl_coefs
    ):
        p.error(
            f"--matched-qualities {args.matched_qualities}: the offline control needs a refresh run of each "
            "(a quality of --qualities and of --refresh-qualities, --refresh-steps > 0, a --refresh-kl-coefs)"
        )
    return args


def sizes_of(args) -> Sizes:
    return temperature.sizes_of(args, SIZES)


def child_argv(args, seed: int, quality: int) -> list[str]:
    argv = ["--out", str(args.out), "--seeds", str(seed), "--qualities", str(quality), "--size", args.size]
    argv += ["--kl-coefs", *map(str, args.kl_coefs), "--refresh-kl-coefs", *map(str, args.refresh_kl_coefs)]
    argv += ["--refresh-qualities", *map(str, args.refresh_qualities)]
    argv += ["--refresh-steps", str(args.refresh_steps), "--refresh-settings", args.refresh_settings]
    argv += ["--matched-qualities", *(str(q) for q in args.matched_qualities if q == quality)]
    argv += ["--rm-epochs", str(args.rm_epochs), "--task-seed", str(args.task_seed), "--no-report", "--child"]
    argv += ["--quickstart", str(args.quickstart)] if args.quickstart is not None else []
    return argv + sizes_argv(args, SIZES)


def check_matched_budget(args, s: Sizes, shared: dict) -> None:
    """Refuse, before any reward model or PPO run, a control that could need more pairs than the pool holds."""
    pool = len((shared["pool"] / "pairs_train.jsonl").read_text().splitlines())
    for quality in args.matched_qualities:
        most = quality + refresh_label_bound(args, s.rollouts)
        if most > pool:
            _fail(
                f"--matched-qualities {quality}: its offline control may need up to {most} pairs ({quality} + a "
                f"refresh's {most - quality} labels), more than the pool's {pool} (raise --pairs, or lower "
                "the refresh's pairs or the rollouts)"
            )


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
        check_matched_budget(args, s, shared)
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
