"""ORM against PRM on the arithmetic task at 20 seeds (docs/experiments.md, the registered claim ``orm-prm``).

The textbook's claim (Lightman et al. 2023, "Let's Verify Step by Step"; Uesato et al. 2022): a reward model
supervised on every step (a process reward model, PRM) is a better training signal than one supervised on the
final answer only (an outcome reward model, ORM). Here both are learned from the same solutions of the
arithmetic task's corpus writer (``rlhfkit.tasks.arithmetic``): the PRM from every line labelled by the step
checker (``task.prm_records``, ``rlhfkit train prm``), the ORM from pairs of a right solution over the writer's
slipped one of the same prompt (``task.orm_pairs``, ``rlhfkit train reward``, Bradley-Terry). Each is then the
only reward of a GRPO run from the same SFT policy:

- ``orm``: ``online.reward_model`` = the ORM, its score on the response's last token;
- ``prm``: ``online.process_reward_model`` = the PRM, ``P(step correct) - 1`` on every step-end token
  (``rlhfkit.rollout.process_rewards``: never positive, so writing extra lines earns nothing); GRPO's return
  of a response is the sum of its rewards.

Neither arm sees the exact-match checker; the kl penalty (``online.kl_coef`` 0.01 in the reward) and every other
setting is the arithmetic quickstart's tiny preset (``rlhfkit.quickstart.verifiable``): 40 rollouts of 8 prompts
x a group of 8 responses at T = 1, lr 3e-4 constant, 2 PPO epochs of 2 minibatches, responses up to 40 tokens.

Shared by every seed (``OUT/task``, ``OUT/sft``): the task's files (task seed 0) and the SFT policy (1,200 steps,
seed 0). Per training seed ``s`` (``OUT/seed-s``): the PRM and the ORM (``prm/``, ``orm/``), each trained from the SFT policy with
seed ``s`` on the same records (the seed sets their heads' initialisation and the order of their batches), then
the two GRPO runs with seed ``s`` (``grpo-orm/``, ``grpo-prm/``). Every 5 updates (and before the first) a hook reads the
policy's greedy exact match on the first 256 held-out prompts (``OUT/task/prompts_eval.jsonl``).

Comparisons (b − a = PRM − ORM, paired by seed): ``accuracy``, the greedy exact match after the last update;
``updates``, the first update count (0, 5, ..., 40) at which the read reaches 0.5, a run that never does
counted as 45 (its length + 5).

    RLHFKIT_NUM_THREADS=1 nice -n 19 python examples/experiments/orm_prm.py --out runs/orm-prm --jobs 2
    python examples/experiments/orm_prm.py --out runs/orm-prm --report-only

A finished arm is cached in ``OUT/seed-s/ARM.json`` and copied to ``--records`` (by default the committed
``examples/experiments/records/orm_prm/``), from which a later sitting takes it instead of running it again; an
interrupted arm runs again from its start. Each record keeps the commit it ran at (``--commit``).
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

HERE = Path(__file__).resolve().parent
RECORDS = HERE / "records" / "orm_prm"
PLAN = HERE.parents[1] / "docs" / "experiments_plan.json"
SEEDS = list(range(20))
ARMS = ("orm", "prm")
EVERY = 5  # updates between reads
TARGET = 0.5  # the accuracy whose first crossing ``updates`` counts
EVAL_PROMPTS = 256
FAMILY = "central"


def shared_stage(out: Path, preset) -> dict[str, Path]:
    """The task's files (with the PRM's records) and the SFT policy, once; their paths."""
    from rlhfkit.config import config_from
    from rlhfkit.quickstart.stages import sft_stage
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files, write_jsonl
    from rlhfkit.trainers import sft

    task, p = get_task("arithmetic", seed=0), preset
    files = {
        "prm_train": out / "task" / "prm_train.jsonl",
        "prm_eval": out / "task" / "prm_eval.jsonl",
        "prompts_train": out / "task" / "prompts_train.jsonl",
        "prompts_eval": out / "task" / "prompts_eval.jsonl",
    }
    sft_dir = out / "sft" / "final"
    if (sft_dir / "config.json").is_file() and all(f.is_file() for f in files.values()):
        return {**files, "sft": sft_dir}
    made = prepare_task_files(task, out / "task", p.model, num_sft=p.sft_steps * p.sft_batch)
    write_jsonl(files["prm_train"], task.prm_records(p.prm_steps * p.prm_batch))
    write_jsonl(files["prm_eval"], task.prm_records(256, split="eval"))
    settings = {
        "seed": 0,
        "data.max_prompt_length": 16,
        "data.max_length": 16 + p.response_length,
        **sft_stage(made, p.sft_steps, p.sft_batch, p.sft_lr),
        "train.eval_steps": p.sft_steps,
        "train.log_steps": 50,
    }
    sft.train(config_from("sft", out / "sft", settings), overwrite=True)
    return {**files, "sft": sft_dir}


def reward_models(root: Path, shared: dict[str, Path], preset, seed: int) -> dict[str, Path]:
    """The seed's PRM and ORM (``root/prm``, ``root/orm``), trained once; their folders."""
    from rlhfkit.config import config_from
    from rlhfkit.quickstart.verifiable import train_orm
    from rlhfkit.tasks import get_task
    from rlhfkit.trainers import prm as prm_trainer

    p = preset
    if not (root / "prm" / "final" / "config.json").is_file():
        settings = {
            "seed": seed,
            "model.name_or_path": shared["sft"],
            "data.train_file": shared["prm_train"],
            "data.eval_file": shared["prm_eval"],
            "data.max_prompt_length": 16,
            "data.max_length": 16 + p.response_length,
            "train.max_steps": p.prm_steps,
            "train.batch_size": p.prm_batch,
            "train.learning_rate": p.prm_lr,
            "train.lr_schedule": "cosine",
            "train.save_steps": p.prm_steps,
            "train.eval_steps": p.prm_steps,
            "train.log_steps": 50,
        }
        prm_trainer.train(config_from("prm", root / "prm", settings), overwrite=True)
    if not (root / "orm" / "final" / "config.json").is_file():
        train_orm(root, shared["sft"], get_task("arithmetic", seed=0), p, seed, overwrite=True)
    return {"prm": root / "prm" / "final", "orm": root / "orm" / "final"}


def arm_settings(arm: str, shared: dict[str, Path], models: dict[str, Path], preset, seed: int) -> dict:
    """The GRPO run of ``arm``: the quickstart's settings with the arm's reward model as the only reward."""
    from rlhfkit.quickstart.verifiable import rl_overrides

    settings = rl_overrides(shared["sft"], shared["prompts_train"], preset, seed, "grpo")
    settings["online.reward_functions"] = "[]"
    if arm == "orm":
        settings["online.reward_model"] = models["orm"]
    elif arm == "prm":
        settings["online.process_reward_model"] = models["prm"]
    else:
        raise ValueError(f"unknown arm {arm!r}; the arms are {ARMS}")
    settings.update({"train.eval_steps": EVERY, "train.save_steps": preset.rollouts})
    return settings


def accuracy_reader(shared: dict[str, Path], preset):
    """``(policy) -> {"exact_match", "step_accuracy", "valid_rate"}``: greedy on the first 256 held-out
    prompts (``rlhfkit.quickstart.verifiable.greedy_figures``, as the quickstart measures a saved policy)."""
    from rlhfkit.data import TokenLimits, prepare_examples
    from rlhfkit.models import load_tokenizer
    from rlhfkit.quickstart.verifiable import greedy_figures
    from rlhfkit.tasks import get_task

    task = get_task("arithmetic", seed=0)
    tok = load_tokenizer(str(shared["sft"]))
    limits = TokenLimits(16, None, "left")
    examples = prepare_examples(str(shared["prompts_eval"]), "prompts", tok, limits)[:EVAL_PROMPTS]
    return lambda policy: greedy_figures(policy, tok, task, examples, preset.response_length)


def updates_to_reach(reads: list[dict], rollouts: int, target: float = TARGET) -> int:
    """The first update count whose read reaches ``target``; ``rollouts + EVERY`` when none does."""
    for r in reads:
        if r["exact_match"] >= target:
            return r["update"]
    return rollouts + EVERY


def run_arm(root: Path, arm: str, shared, models, preset, seed: int, args) -> dict:
    """One GRPO run of ``arm`` with its reads; its record, cached in ``root/ARM.json`` and ``--records``."""
    from rlhfkit.config import config_from
    from rlhfkit.trainers import online

    done = root / f"{arm}.json"
    kept = record_path(args, seed, arm)
    restore_record(done, kept)
    if done.is_file():
        record = json.loads(done.read_text())
        if record["rollouts"] != preset.rollouts:
            raise SystemExit(
                f"{done} ran {record['rollouts']} rollouts, not {preset.rollouts}: use another --out"
            )
        return record
    if args.report_only:
        return {}
    read, reads = accuracy_reader(shared, preset), []

    def hook(policy, step):
        figures = read(policy)
        reads.append({"update": step, **figures})
        return {f"eval/{k}": v for k, v in figures.items()}

    print(f"seed {seed}: GRPO on the {arm.upper()}, {preset.rollouts} rollouts", flush=True)
    clock = time.process_time()
    cfg = config_from("grpo", root / f"grpo-{arm}", arm_settings(arm, shared, models, preset, seed))
    online.train(cfg, overwrite=True, hooks=online.OnlineHooks(evaluate=hook))
    steps = sorted({r["update"] for r in reads})
    if steps != sorted({*range(0, preset.rollouts + 1, EVERY), preset.rollouts}):
        raise SystemExit(f"{root}/grpo-{arm}: reads at updates {steps}, not every {EVERY} from 0")
    reads = sorted({r["update"]: r for r in reads}.values(), key=lambda r: r["update"])
    record = {
        "seed": seed,
        "arm": arm,
        "commit": args.commit,
        "rollouts": preset.rollouts,
        "every": EVERY,
        "reads": reads,
        "accuracy": reads[-1]["exact_match"],
        "updates": updates_to_reach(reads, preset.rollouts),
        "cpu_seconds": time.process_time() - clock,
    }
    return write_record(done, record, kept)


def restore_record(done: Path, kept: Path | None) -> None:
    """A run finished in another sitting: its committed record ``kept`` copied to the cache ``done``."""
    if not done.is_file() and kept is not None and kept.is_file():
        done.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(kept, done)


def write_record(done: Path, record: dict, kept: Path | None) -> dict:
    """A finished run's ``record`` cached in ``done`` and copied to the committed ``kept``; the record."""
    done.write_text(json.dumps(record, indent=1))
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(done, kept)
    return record


def run_seed(seed: int, args, preset) -> dict:
    """Both arms of one seed (the shared stage and the reward models made once, where an arm must run)."""
    root = args.out / f"seed-{seed}"
    out, stages = {"seed": seed}, None
    for arm in ARMS:
        kept = record_path(args, seed, arm)
        if (root / f"{arm}.json").is_file() or (kept is not None and kept.is_file()) or args.report_only:
            out[arm] = run_arm(root, arm, None, None, preset, seed, args)
            continue
        if stages is None:
            shared = shared_stage(args.out, preset)
            stages = (shared, reward_models(root, shared, preset, seed))
        out[arm] = run_arm(root, arm, *stages, preset, seed, args)
    return out


def record_path(args, seed: int, arm: str) -> Path | None:
    """Where ``arm`` of ``seed`` is recorded (None without records)."""
    return args.records / f"seed-{seed}" / f"{arm}.json" if args.records else None


def values_of(results: list[dict], figure: str) -> tuple[list[int], list[float], list[float]]:
    """The seeds with both arms, and the ORM's (a) and the PRM's (b) ``figure`` per seed."""
    have = sorted((r for r in results if r.get("orm") and r.get("prm")), key=lambda r: r["seed"])
    return [r["seed"] for r in have], [r["orm"][figure] for r in have], [r["prm"][figure] for r in have]


def report(results: list[dict], plan_path: Path = PLAN) -> str:
    """Each registered comparison: per-seed PRM − ORM, the exact p after Holm over the plan's ``central`` family
    (members without data at p = 1, as the page counts them), and ``decide``'s verdict."""
    from rlhfkit.reporting.paired import Claim, decide, describe, holm, paired
    from rlhfkit.reporting.plan import load_plan

    plan = load_plan(plan_path)
    data = {}
    for cid in ("accuracy", "updates"):
        seeds, a, b = values_of(results, cid)
        if seeds:
            data[f"orm-prm.{cid}"] = (seeds, paired(a, b), a, b)
    members = plan.family_members()[FAMILY]
    adjusted = dict(
        zip(members, holm([data[k][1].exact_p if k in data else 1.0 for k in members]), strict=True)
    )
    lines = []
    for cid in ("accuracy", "updates"):
        key, planned = f"orm-prm.{cid}", plan.comparisons[f"orm-prm.{cid}"]
        head = f"{key}: b − a = ({planned.b}) − ({planned.a})"
        if key not in data:
            lines.append(f"{head}: no seed has run")
            continue
        seeds, p, a, b = data[key]
        word = decide(p, Claim(planned.direction, planned.margin), adjusted[key])
        note = "" if len(seeds) == planned.n else f" (the plan registers {planned.n}: not its test yet)"
        lines.append(
            f"{head}\n  seeds {seeds[0]}-{seeds[-1]}, n = {len(seeds)}{note}: {describe(p)}\n"
            f"  a: {[round(x, 3) for x in a]}\n  b: {[round(x, 3) for x in b]}\n"
            f"  Holm over '{FAMILY}' (the other members as far as this runner knows them, else p = 1): "
            f"p = {adjusted[key]:.3g}; claimed direction {planned.direction:+d}: {word}"
        )
    return "\n".join(lines)


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def seed_jobs(script: str, argv: list[str], seeds: list[int], jobs: int) -> bool:
    """Each seed in its own process of ``script`` (``argv`` + ``--seeds N --no-report --jobs 1``), ``jobs`` at a
    time, one torch thread each unless ``RLHFKIT_NUM_THREADS`` says otherwise; False (the others stopped) as soon
    as one fails."""
    env = {**os.environ, "RLHFKIT_NUM_THREADS": os.environ.get("RLHFKIT_NUM_THREADS", "1")}
    pending, running = list(seeds), []
    while pending or running:
        while pending and len(running) < jobs:
            child = [*argv, "--seeds", str(pending.pop(0)), "--no-report", "--jobs", "1"]
            running.append(subprocess.Popen([sys.executable, script, *child], env=env))
        finished = next((c for c in running if c.poll() is not None), None)
        if finished is None:
            time.sleep(2)
            continue
        running.remove(finished)
        if finished.returncode != 0:
            for c in running:
                c.terminate()
            print(f"a seed failed: {' '.join(finished.args)}", file=sys.stderr)
            return False
    return True


def add_run_arguments(p: argparse.ArgumentParser, records: Path) -> None:
    """The options a registered runner of seeds shares: which seeds, how many at once, where finished ones are
    recorded, the commit they run at, and report only."""
    p.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    p.add_argument("--jobs", type=int, default=1, help="seeds run at once, each in its own process")
    p.add_argument("--records", type=Path, default=None, help=f"finished runs kept here (default {records})")
    p.add_argument("--no-records", action="store_true", help="keep no records (a smoke or a pilot run)")
    p.add_argument("--commit", default=None, help="the commit the runs are at (default: git rev-parse HEAD)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)


def resolve_run_arguments(args, records: Path):
    """``args`` with ``records`` (None under ``--no-records``) and ``commit`` filled in."""
    args.records = None if args.no_records else (args.records or records)
    args.commit = args.commit or git_commit()
    return args


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", choices=("tiny", "smoke"), default="tiny")
    add_run_arguments(p, RECORDS)
    return resolve_run_arguments(p.parse_args(argv), RECORDS)


def main(argv=None) -> int:
    from rlhfkit.engine.threads import set_num_threads
    from rlhfkit.quickstart.verifiable import VERIFIABLE_PRESETS

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    preset = VERIFIABLE_PRESETS[args.preset]
    set_num_threads()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only and args.jobs > 1 and len(args.seeds) > 1:
        shared_stage(args.out, preset)  # once, before the seeds' processes start
        commit = ["--commit", args.commit] if args.commit else []
        if not seed_jobs(__file__, [*argv, *commit], args.seeds, args.jobs):
            return 1
        args.report_only = True  # every figure from the caches now
    results = [run_seed(seed, args, preset) for seed in args.seeds]
    if not args.no_report:
        print(report(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
