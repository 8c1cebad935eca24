"""On-policy distillation against its two alternatives, and its reverse KL against JSD (the ``distill`` family of
docs/experiments_plan.json, registered before these runs).

Per seed, on the built-in ``reviews`` task, the stages of ``rlhfkit quickstart --task distill``
(:mod:`rlhfkit.quickstart.distillation`: the task's files, the student's SFT policy, the teacher built by SFT and
PPO with the task's gold score as its rule reward), then four arms from the student's SFT policy:

- ``distill_reverse_kl``: ``rlhfkit train distill`` as the quickstart runs it (``distill.loss=reverse_kl``);
- ``distill_jsd``: the same with ``distill.loss=jsd``;
- ``sft_teacher``: SFT on the teacher's samples of the training prompts (at the distillation's temperature),
  as many response tokens as the teacher scored in ``distill_reverse_kl`` (its ``response_length/mean`` x
  responses per rollout, summed over rollouts), one pass, the distillation's batch and learning rate;
- ``ppo``: PPO on the gold score as the teacher was trained (its learning rate, the critic from the policy), for
  the distillation's rollouts of the distillation's batch: equal student updates.

Then the gold read the experiments page uses for a final policy: 4 responses at the distillation's temperature
to each held-out prompt, the same sampling seed for every policy of a seed (SFT student, teacher and the four
arms), with the standard error over prompts. The comparisons, b - a per seed:

- ``sft``:  ``distill_reverse_kl`` - ``sft_teacher``, claimed above 0;
- ``rl``:   ``distill_reverse_kl`` - ``ppo``, claimed above 0;
- ``loss``: ``distill_jsd`` - ``distill_reverse_kl``, claimed within the plan's 0.1 gold margin.

A seed's folder is ``OUT/seed-N/``; every stage whose output is there is not run again (a stage cut short is
started over), so an interrupted run continues. ``OUT/seed-N/figures.json`` holds the seed's figures, copied to
``examples/experiments/records/distill_evidence/seed-N.json``: the records are committed, so the seeds of a claim
can be run over several sittings on several machines (a seed with a record is not run again; ``--records DIR``
keeps them elsewhere). With ``--report-only`` the script prints the three comparisons
(:mod:`rlhfkit.reporting.paired`: paired, describe, and the page's rule ``decide`` under the plan, Holm over the
family's two directions) from the seeds that finished::

    RLHFKIT_NUM_THREADS=1 python examples/experiments/distill_evidence.py --out runs/distill-evidence --seeds 0 1 2
    python examples/experiments/distill_evidence.py --out runs/distill-evidence --report-only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
RECORDS = Path(__file__).resolve().parent / "records"  # finished seeds' figures, committed
ARMS = ("distill_reverse_kl", "distill_jsd", "sft_teacher", "ppo")
READS = ("sft", "teacher", *ARMS)  # every policy of a seed read on the same prompts with the same seed
# comparison id in the plan's claim "distill" -> (arm a, arm b): the difference read is b - a
COMPARISONS = {
    "sft": ("sft_teacher", "distill_reverse_kl"),
    "rl": ("ppo", "distill_reverse_kl"),
    "loss": ("distill_reverse_kl", "distill_jsd"),
}
SAMPLES_PER_PROMPT = 4


def cached_stage(folder: Path, done: Path, run) -> float:
    """Run ``run()`` unless ``done`` exists; a ``folder`` left by a run cut short is removed first. Seconds."""
    if done.exists():
        return 0.0
    if folder.exists():
        shutil.rmtree(folder)
    print(f"[{folder.parent.name}] {folder.name}", flush=True)
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def task_files(root: Path, seed: int, d) -> dict[str, Path]:
    """The quickstart's stage 1 (the task's files and the teacher's initial model), cached in ``files.json``."""
    from rlhfkit.quickstart.pipeline import PRESETS
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files

    record = root / "task" / "files.json"
    if record.is_file():
        return {k: Path(v) for k, v in json.loads(record.read_text()).items()}
    if (root / "task").exists():
        shutil.rmtree(root / "task")
    p, task = PRESETS[d.student], get_task("reviews", seed=seed)
    files = prepare_task_files(
        task,
        root / "task",
        p.model,
        num_sft=min(4096, p.sft_steps * p.sft_batch),
        num_sft_eval=min(256, d.num_eval_prompts),
    )
    files["teacher_init"] = root / "task" / "teacher_init"
    task.build_model(d.teacher.model, task.build_tokenizer(files["teacher_init"])).save_pretrained(
        files["teacher_init"]
    )
    record.write_text(json.dumps({k: str(v) for k, v in files.items()}))
    return files


def teacher_scored_tokens(run: Path) -> int:
    """Response tokens the teacher scored in a distillation run: per rollout ``response_length/mean`` x the
    rollout's responses (batch x group size), summed over the rollouts."""
    import yaml

    from rlhfkit.engine.metrics_writer import read_metrics

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    per_rollout = cfg["train"]["batch_size"] * cfg["online"]["group_size"]
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "response_length/mean" in r]
    return round(sum(r["response_length/mean"] * per_rollout for r in rows))


def teacher_samples(out: Path, teacher: Path, prompts: Path, budget: int, d, seed: int) -> dict:
    """The teacher's responses to the training prompts (in order, again from the start when they run out) at the
    distillation's temperature until the response tokens of the non-empty ones reach ``budget``; written as SFT
    records."""
    import torch

    from rlhfkit.data import TokenLimits, prepare_examples
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.quickstart.pipeline import PRESETS
    from rlhfkit.rollout.evaluate import sample_and_score

    tokenizer = load_tokenizer(str(teacher))
    model = load_causal_lm(str(teacher), frozen=True).eval()
    examples = prepare_examples(str(prompts), "prompts", tokenizer, TokenLimits(32, None, "left"))
    torch.manual_seed(seed)
    records, tokens, start, since_kept = [], 0, 0, 0
    while tokens < budget:
        if since_kept >= len(examples):
            raise RuntimeError(f"{teacher}: no non-empty response in a whole pass over {prompts}")
        chunk = [examples[(start + i) % len(examples)] for i in range(64)]
        start += 64
        since_kept += 64
        with torch.no_grad():
            got = sample_and_score(
                model,
                tokenizer,
                chunk,
                temperature=d.temperature,
                max_new_tokens=PRESETS[d.student].response_length,
            )
        for prompt, response, length in zip(got.prompts, got.responses, got.lengths, strict=True):
            if tokens >= budget:
                break
            if (
                not response.strip()
            ):  # an SFT record needs a completion (the stop token alone teaches nothing)
                continue
            since_kept = 0
            records.append({"prompt": prompt, "completion": response})
            tokens += int(length)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"rows": len(records), "tokens": tokens, "budget": budget}
    (out / "done.json").write_text(json.dumps(summary))
    return summary


def gold_read(policy: Path, root: Path, files: dict[str, Path], d, seed: int, eval_prompts: int) -> dict:
    """The page's 4-sample read of ``policy`` (:func:`four_sample_read`) at the distillation's temperature."""
    from rlhfkit.quickstart.pipeline import PRESETS

    return four_sample_read(
        policy, files["prompts_eval"], seed, d.temperature, PRESETS[d.student].response_length, eval_prompts
    )


def four_sample_read(
    policy: Path, prompts: Path, seed: int, temperature: float, max_new_tokens: int, eval_prompts: int = 0
) -> dict:
    """The page's 4-sample read: ``SAMPLES_PER_PROMPT`` responses to each held-out prompt of ``prompts`` (the
    first ``eval_prompts``; 0: all) at ``temperature``, scored by the reviews task's gold scorer, one sampling
    seed per training seed (``seed``), so every policy of a seed is read on the same prompts with the same
    seed; with the standard error over prompts."""
    import torch

    from rlhfkit.data import TokenLimits, prepare_examples
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.rollout.evaluate import prompt_standard_error, sample_and_score
    from rlhfkit.tasks import get_task

    task = get_task("reviews", seed=seed)
    tokenizer = load_tokenizer(str(policy))
    examples = prepare_examples(str(prompts), "prompts", tokenizer, TokenLimits(32, None, "left"))
    examples = examples[:eval_prompts] if eval_prompts else examples
    repeated = [x for x in examples for _ in range(SAMPLES_PER_PROMPT)]  # a prompt's samples side by side
    torch.manual_seed(10_000 + seed)  # the same sampling seed for every policy of this seed
    with torch.no_grad():
        got = sample_and_score(
            load_causal_lm(str(policy), frozen=True).eval(),
            tokenizer,
            repeated,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            gold_score=task.gold_score,
        )
    return {
        "gold": sum(got.gold) / len(got.gold),
        "gold_se": prompt_standard_error(got.gold, SAMPLES_PER_PROMPT),
        "length": sum(got.lengths) / len(got.lengths),
        "ended": sum(got.ended) / len(got.ended),
        "prompts": len(examples),
        "responses": len(got.gold),
        "samples_per_prompt": SAMPLES_PER_PROMPT,
    }


def cached_reads(root: Path, policies: dict[str, Path], read) -> dict[str, dict]:
    """``read(policy)`` of each of ``policies`` (name -> folder), in order, each cached in
    ``root/reads/NAME.json``."""
    reads = {}
    for name, policy in policies.items():
        path = root / "reads" / f"{name}.json"
        if not path.is_file():
            print(f"[{root.name}] gold read of {name}", flush=True)
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps(read(policy)))
        reads[name] = json.loads(path.read_text())
    return reads


def run_seed(out: Path, seed: int, preset: str, eval_prompts: int) -> dict:
    """Every stage of one seed (module docstring) into ``out/seed-N``; returns and writes its figures."""
    from rlhfkit.config import config_from
    from rlhfkit.quickstart.distillation import (
        DISTILL_PRESETS,
        build_teacher,
        distill_settings,
        gold_ppo_settings,
    )
    from rlhfkit.quickstart.pipeline import PRESETS, sft_settings
    from rlhfkit.trainers import online, sft

    d = DISTILL_PRESETS[preset]
    p = PRESETS[d.student]
    root = out / f"seed-{seed}"
    root.mkdir(parents=True, exist_ok=True)
    seconds = {}
    start = time.perf_counter()
    files = task_files(root, seed, d)
    sft_dir = root / "sft" / "final"
    seconds["sft"] = cached_stage(
        root / "sft",
        sft_dir,
        lambda: sft.train(config_from("sft", root / "sft", sft_settings(files, p, seed))),
    )
    teacher = root / "teacher_ppo" / "final"

    def make_teacher():
        shutil.rmtree(root / "teacher_sft", ignore_errors=True)
        build_teacher(root, files, d, seed)

    seconds["teacher"] = cached_stage(root / "teacher_ppo", teacher, make_teacher)
    for loss in ("reverse_kl", "jsd"):
        folder = root / f"distill_{loss}"
        settings = {
            **distill_settings(sft_dir, teacher, files["prompts_train"], d, seed),
            "distill.loss": loss,
        }
        seconds[folder.name] = cached_stage(
            folder, folder / "final", lambda f=folder, s=settings: online.train(config_from("distill", f, s))
        )
    budget = teacher_scored_tokens(root / "distill_reverse_kl")
    samples = root / "teacher_samples"
    seconds["teacher_samples"] = cached_stage(
        samples,
        samples / "done.json",
        lambda: teacher_samples(samples, teacher, files["prompts_train"], budget, d, seed),
    )
    made = json.loads((samples / "done.json").read_text())
    sft_keys = {
        "seed": seed,
        "model.name_or_path": sft_dir,
        "data.train_file": samples / "train.jsonl",
        "data.max_prompt_length": 32,
        "data.max_length": 32 + p.response_length,
        "train.max_steps": max(1, math.ceil(made["rows"] / d.batch)),  # one pass over the teacher's samples
        "train.batch_size": d.batch,
        "train.learning_rate": d.lr,
        "train.lr_schedule": "constant",
        "train.save_steps": max(1, math.ceil(made["rows"] / d.batch)),
        "train.log_steps": 10,
    }
    seconds["sft_teacher"] = cached_stage(
        root / "sft_teacher",
        root / "sft_teacher" / "final",
        lambda: sft.train(config_from("sft", root / "sft_teacher", sft_keys)),
    )
    # PPO as the teacher was trained (its learning rate), at the distillation's rollouts and batch
    rl = replace(p, ppo_rollouts=d.steps, ppo_batch=d.batch, ppo_lr=d.teacher.ppo_lr)
    ppo_keys = gold_ppo_settings(sft_dir, files["prompts_train"], rl, seed)
    seconds["ppo"] = cached_stage(
        root / "ppo", root / "ppo" / "final", lambda: online.train(config_from("ppo", root / "ppo", ppo_keys))
    )
    policies = {"sft": sft_dir, "teacher": teacher, **{arm: root / arm / "final" for arm in ARMS}}
    reads = cached_reads(root, policies, lambda policy: gold_read(policy, root, files, d, seed, eval_prompts))
    figures = {
        "seed": seed,
        "preset": preset,
        "commit": run_commit(),
        "reads": reads,
        "teacher_scored_tokens": budget,
        "sft_teacher_tokens": made["tokens"],
        "sft_teacher_rows": made["rows"],
        "stage_seconds": seconds,
        "wall_seconds": time.perf_counter() - start,
    }
    (root / "figures.json").write_text(json.dumps(figures, indent=1))
    return figures


def run_commit(env: str = "DISTILL_EVIDENCE_COMMIT") -> str | None:
    """The commit the figures were made at: ``$env`` (a copy of the code outside git), else the repository's
    HEAD."""
    if os.environ.get(env):
        return os.environ[env]
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or None


def gold_table(results: list[dict], gold: dict[str, list[float]]) -> list[str]:
    """The lines of the per-policy table of a report: ``gold`` per policy, one value per seed of ``results``."""
    lines = [f"Seeds {[r['seed'] for r in results]}: held-out gold, 4 samples per prompt.", ""]
    lines += ["| policy | gold, mean | per seed |", "|---|---|---|"]
    return lines + [
        f"| {name} | {sum(v) / len(v):.3f} | {' / '.join(f'{x:.2f}' for x in v)} |"
        for name, v in gold.items()
    ]


def report(results: list[dict], plan_path: Path = DOCS / "experiments_plan.json") -> str:
    """The three comparisons over the seeds given: per-seed gold of each arm, then each comparison's paired
    difference (:func:`rlhfkit.reporting.paired.describe`) and the page's verdict under the plan (Holm over the
    family's directional comparisons)."""
    from rlhfkit.reporting.paired import Claim, decide, describe, holm, paired
    from rlhfkit.reporting.plan import load_plan

    plan = load_plan(plan_path)
    results = sorted(results, key=lambda r: r["seed"])
    gold = {name: [r["reads"][name]["gold"] for r in results] for name in READS}
    lines = gold_table(results, gold)
    compared = {cid: paired(gold[a], gold[b]) for cid, (a, b) in COMPARISONS.items()}
    directional = [cid for cid in COMPARISONS if plan.comparisons[f"distill.{cid}"].direction != 0]
    corrected = dict(zip(directional, holm([compared[c].exact_p for c in directional]), strict=True))
    lines.append("")
    for cid, (a, b) in COMPARISONS.items():
        planned = plan.comparisons[f"distill.{cid}"]
        word = decide(compared[cid], Claim(planned.direction, planned.margin), corrected.get(cid))
        holm_p = f"; Holm p = {corrected[cid]:.3g}" if cid in corrected else ""
        lines.append(f"- distill.{cid} ({b} - {a}): {describe(compared[cid])}{holm_p} -> {word}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return evidence_main(argv, __doc__, run_seed, report, "distill_evidence.md")


def evidence_main(argv: list[str] | None, doc: str, run_seed, report, name: str, smoke: str = "") -> int:
    """The command line of a registered runner: ``run_seed(out, seed, preset, eval_prompts)`` for each seed
    (unless ``--report-only``), then ``report(results)`` of the seeds whose ``figures.json`` exists, printed and
    written to ``OUT/name``. ``smoke``: what ``--smoke`` changes besides the quickstart's smoke preset."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (one folder per seed in it)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    p.add_argument(
        "--smoke", action="store_true", help=f"the quickstart's smoke preset{smoke}, 8 held-out prompts"
    )
    p.add_argument(
        "--eval-prompts", type=int, default=None, help="held-out prompts read (default: all; smoke 8)"
    )
    p.add_argument("--report-only", action="store_true", help="only the comparisons, from the finished seeds")
    p.add_argument(
        "--records",
        type=Path,
        default=None,
        help="folder of the finished seeds' figures, one seed-N.json each, read before running a seed (default: "
        "examples/experiments/records/RUNNER/, committed with the code; none with --smoke)",
    )
    args = p.parse_args(argv)
    preset = "smoke" if args.smoke else "tiny"
    eval_prompts = args.eval_prompts if args.eval_prompts is not None else (8 if args.smoke else 0)
    records = args.records
    if records is None and not args.smoke:
        records = RECORDS / Path(name).stem
    for seed in args.seeds:
        figures = args.out / f"seed-{seed}" / "figures.json"
        record = records / f"seed-{seed}.json" if records else None
        if record is not None and record.is_file():
            if not figures.is_file():  # finished elsewhere: its record stands for the run
                figures.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(record, figures)
            continue
        if not args.report_only:
            run_seed(args.out, seed, preset, eval_prompts)
        if record is not None and figures.is_file():
            record.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(figures, record)
    results = [
        json.loads(path.read_text())
        for seed in args.seeds
        if (path := args.out / f"seed-{seed}" / "figures.json").is_file()
    ]
    if not results:
        print(f"no finished seed in {args.out}", file=sys.stderr)
        return 1
    text = report(results)
    (args.out / name).write_text(text, encoding="utf-8")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
