"""Overlapping rollouts learn as the synchronous loop does: PPO at ``online.max_staleness`` 1 against 0 (the
claim ``async-staleness`` of docs/experiments_plan.json, registered before these runs).

Per seed, on the built-in ``reviews`` task, the stages of ``rlhfkit quickstart`` up to the reward model as
:mod:`rlhfkit.quickstart.pipeline` builds them (the task's files, SFT, pairs sampled from the SFT policy and
labelled by the task's annotators, the reward model), then two arms of PPO from the SFT policy with the
quickstart's PPO settings (:func:`rlhfkit.quickstart.pipeline.ppo_settings`: GAE, the critic from the reward
model), each ``python -m rlhfkit train ppo`` under ``torchrun --nproc_per_node 2``, one torch thread a process:

- ``k0``: the synchronous loop, two data-parallel processes (``online.max_staleness=0``);
- ``k1``: process 0 trains and process 1 only samples (``online.max_staleness=1``,
  ``online.generation_processes=1``; docs/distributed.md, "Rollouts that overlap training"): every rollout after
  the first is sampled with the weights one update behind the trainer's.

Each arm's log must report the two processes it was launched on, and each arm's figures keep what its
``metrics.jsonl`` logged of the overlap (the mean of ``async/staleness_mean`` over the rollouts, its largest
``async/staleness_max``, the ``async/dropped`` samples summed; the synchronous arm logs none). Then the page's
4-sample read of the SFT policy and of both arms' final policies (4 responses at T = 0.7 to each held-out
prompt, the same sampling seed for every policy of a seed: distill_evidence.py's :func:`four_sample_read`), and
the registered comparison, ``k1 - k0`` per seed, claimed within the plan's 0.1 gold margin.

A seed's folder is ``OUT/seed-N/``; every stage whose output is there is not run again (a stage cut short is
started over), so an interrupted run continues. ``OUT/seed-N/figures.json`` holds the seed's figures with the
commit they were made at (``$ASYNC_STALENESS_COMMIT``, else the repository's HEAD); with ``--report-only`` the
script prints the comparison (:mod:`rlhfkit.reporting.paired`: paired, describe, and the page's rule ``decide``
under the plan) from the seeds that finished::

    python examples/experiments/async_staleness.py --out runs/async-staleness --seeds 0 1 2
    python examples/experiments/async_staleness.py --out runs/async-staleness --report-only
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_evidence import (  # noqa: E402
    cached_reads,
    cached_stage,
    evidence_main,
    four_sample_read,
    gold_table,
    run_commit,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"
CLAIM = "async-staleness"
PROCESSES = 2  # both arms: torchrun --nproc_per_node 2
# arm -> (online.max_staleness, online.generation_processes)
ARMS = {"k0": (0, 0), "k1": (1, 1)}
COMPARISON = ("k0", "k1")  # the plan's async-staleness.k1: the difference read is b - a = k1 - k0
READS = ("sft", *ARMS)  # every policy of a seed read on the same prompts with the same seed
READ_TEMPERATURE = 0.7
SMOKE_ROLLOUTS = 3  # --smoke: rollout 1 sampled with the first weights, 2 and 3 one version behind at k = 1


def quickstart_stages(root: Path, seed: int, p) -> dict[str, Path]:
    """The quickstart's stages 1-4 (:func:`rlhfkit.quickstart.pipeline.quickstart`) into ``root``, each cached:
    the paths of the task's files, the SFT policy and the reward model."""
    from rlhfkit.config import config_from
    from rlhfkit.quickstart.pipeline import reward_settings, sample_pairs, sft_settings
    from rlhfkit.rollout.pairs import FILES
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files
    from rlhfkit.trainers import reward, sft

    task = get_task("reviews", seed=seed)
    record = root / "task" / "files.json"

    def make_files():
        files = prepare_task_files(task, root / "task", p.model, num_sft_eval=min(256, p.num_eval_prompts))
        record.write_text(json.dumps({k: str(v) for k, v in files.items()}))

    cached_stage(root / "task", record, make_files)
    files = {k: Path(v) for k, v in json.loads(record.read_text()).items()}
    sft_dir = root / "sft" / "final"
    cached_stage(
        root / "sft",
        sft_dir,
        lambda: sft.train(config_from("sft", root / "sft", sft_settings(files, p, seed))),
    )
    pairs = {k: root / "pairs" / f for k, f in FILES.items()}
    cached_stage(root / "pairs", pairs["meta"], lambda: sample_pairs(root / "pairs", task, sft_dir, p, seed))
    rm_keys = reward_settings(sft_dir, pairs, p, seed)
    cached_stage(
        root / "reward",
        root / "reward" / "final",
        lambda: reward.train(config_from("reward", root / "reward", rm_keys)),
    )
    return {**files, "sft": sft_dir, "reward": root / "reward" / "final"}


def arm_settings(arm: str, stage: dict[str, Path], p, seed: int) -> dict:
    """The dotted keys of one arm: the quickstart's PPO from the SFT policy against the reward model, and the
    arm's staleness and generation processes."""
    from rlhfkit.quickstart.pipeline import ppo_settings

    k, generators = ARMS[arm]
    keys = ppo_settings(stage["sft"], stage["reward"], stage["prompts_train"], p, seed)
    return {**keys, "online.max_staleness": k, "online.generation_processes": generators}


def launch_argv(config: Path) -> list[str]:
    """``python -m rlhfkit train ppo --config CONFIG`` under ``torchrun --nproc_per_node PROCESSES``."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={PROCESSES}"]
    return [
        sys.executable,
        *torchrun,
        "-m",
        "rlhfkit",
        "train",
        "ppo",
        "--config",
        str(config),
        "--overwrite",
    ]


def launched_processes(log: Path) -> int:
    """The processes a run reports on its first line (``rlhfkit: ppo on N processes (torchrun ...``)."""
    found = re.search(r"^rlhfkit: ppo on (\d+) process", log.read_text(errors="replace"), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{log}: no 'rlhfkit: ppo on N processes' line; the run did not start")
    return int(found.group(1))


def overlap_figures(metrics: Path) -> dict:
    """What a run logged of the overlap: the mean of ``async/staleness_mean`` over its rollouts, the largest
    ``async/staleness_max``, the ``async/dropped`` samples summed, and the rollouts that logged them (None each,
    0 rollouts, where none did: the synchronous loop)."""
    from rlhfkit.engine.metrics_writer import read_metrics

    rows = [r for r in read_metrics(metrics) if "async/staleness_mean" in r]
    if not rows:
        return {"staleness_mean": None, "staleness_max": None, "dropped": None, "overlap_rollouts": 0}
    return {
        "staleness_mean": sum(r["async/staleness_mean"] for r in rows) / len(rows),
        "staleness_max": max(r["async/staleness_max"] for r in rows),
        "dropped": sum(r["async/dropped"] for r in rows),
        "overlap_rollouts": len(rows),
    }


def run_arm(root: Path, arm: str, keys: dict) -> dict:
    """Train one arm as a torchrun subprocess into ``root/ARM`` (its configuration ``ARM.yaml`` and output
    ``ARM.log`` beside it); check the processes its log reports; write and return its figures (``ARM.json``)."""
    import rlhfkit
    from rlhfkit.config import config_from
    from rlhfkit.config.parse import read_run_info, save_config

    folder = root / arm
    config = root / f"{arm}.yaml"
    save_config(config_from("ppo", folder, keys), config)
    log = root / f"{arm}.log"
    argv = launch_argv(config)
    print(f"[{root.name}] {arm}: {' '.join(argv[1:])}", flush=True)
    env = {**os.environ, "RLHFKIT_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    # the processes run the rlhfkit this script imported (a checkout's src/, not another installed copy)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(rlhfkit.__file__).resolve().parents[1]), *filter(None, [env.get("PYTHONPATH")])]
    )
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{arm} exited with {done.returncode} (log {log}):\n{tail}")
    processes = launched_processes(log)
    if processes != PROCESSES:
        raise RuntimeError(f"{log}: the run reports {processes} processes, launched with {PROCESSES}")
    k, generators = ARMS[arm]
    run = read_run_info(folder / "config.yaml") or {}
    figures = {
        "arm": arm,
        "max_staleness": k,
        "generation_processes": generators,
        "processes": processes,
        "threads_per_process": run.get("threads_per_process"),
        "seconds": seconds,
        **overlap_figures(folder / "metrics.jsonl"),
    }
    (root / f"{arm}.json").write_text(json.dumps(figures, indent=1))
    return figures


def run_seed(out: Path, seed: int, preset: str, eval_prompts: int) -> dict:
    """Every stage of one seed (module docstring) into ``out/seed-N``; returns and writes its figures."""
    from dataclasses import replace

    from rlhfkit.quickstart.pipeline import PRESETS

    p = PRESETS[preset]
    if preset == "smoke":
        p = replace(p, ppo_rollouts=SMOKE_ROLLOUTS)
    root = out / f"seed-{seed}"
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    stage = quickstart_stages(root, seed, p)
    arms = {}
    for arm in ARMS:
        keys = arm_settings(arm, stage, p, seed)
        cached_stage(root / arm, root / f"{arm}.json", lambda a=arm, k=keys: run_arm(root, a, k))
        arms[arm] = json.loads((root / f"{arm}.json").read_text())
    policies = {"sft": stage["sft"], **{arm: root / arm / "final" for arm in ARMS}}  # in READS' order
    reads = cached_reads(
        root,
        policies,
        lambda policy: four_sample_read(
            policy, stage["prompts_eval"], seed, READ_TEMPERATURE, p.response_length, eval_prompts
        ),
    )
    figures = {
        "seed": seed,
        "preset": preset,
        "commit": run_commit("ASYNC_STALENESS_COMMIT"),
        "reads": reads,
        "arms": arms,
        "wall_seconds": time.perf_counter() - start,
    }
    (root / "figures.json").write_text(json.dumps(figures, indent=1))
    return figures


def _logged(value, digits: int = 2) -> str:
    return "not logged" if value is None else f"{value:.{digits}f}"


def report(results: list[dict], plan_path: Path = DOCS / "experiments_plan.json") -> str:
    """The registered comparison over the seeds given: per-seed gold of each policy and each arm's overlap
    figures, then k1 - k0 paired by seed (:func:`rlhfkit.reporting.paired.describe`) and the page's verdict
    under the plan's margin."""
    from rlhfkit.reporting.paired import Claim, decide, describe, paired
    from rlhfkit.reporting.plan import load_plan

    planned = load_plan(plan_path).comparisons[f"{CLAIM}.k1"]
    results = sorted(results, key=lambda r: r["seed"])
    gold = {name: [r["reads"][name]["gold"] for r in results] for name in READS}
    lines = gold_table(results, gold)
    lines += ["", "| arm | staleness, mean per seed | dropped samples per seed |", "|---|---|---|"]
    for arm in ARMS:
        staleness = " / ".join(_logged(r["arms"][arm]["staleness_mean"]) for r in results)
        dropped = " / ".join(_logged(r["arms"][arm]["dropped"], 0) for r in results)
        lines.append(f"| {arm} | {staleness} | {dropped} |")
    a, b = COMPARISON
    compared = paired(gold[a], gold[b])
    word = decide(compared, Claim(planned.direction, planned.margin))
    lines += ["", f"- {CLAIM}.k1 ({b} - {a}): {describe(compared)} -> {word}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return evidence_main(
        argv, __doc__, run_seed, report, "async_staleness.md", f", {SMOKE_ROLLOUTS} rollouts"
    )


if __name__ == "__main__":
    sys.exit(main())
