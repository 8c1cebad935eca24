"""The on-policy distillation quickstart (``rlhfkit quickstart --task distill``): the reviews task's PPO policy
of the ``small`` model preset (the teacher) distilled into an SFT policy of the ``tiny`` preset (the student).

    rlhfkit quickstart --task distill [--out DIR] [--preset tiny|smoke] [--seed N] [--teacher POLICY_DIR]

Stages, each in its own run folder under ``DIR``:

1. ``task/``         the reviews task on disk (:func:`rlhfkit.tasks.files.prepare_task_files`): its tokenizer, a
                     fresh student of the ``tiny`` preset, SFT data, prompt splits; and ``teacher_init/``, a fresh
                     model of the teacher's preset with the same tokenizer;
2. ``sft/``          the student's SFT, as the reviews quickstart's (:func:`rlhfkit.quickstart.pipeline.sft_settings`);
3. the teacher, unless ``--teacher`` names one (then only its vocabulary is checked against the task's):
   ``teacher_sft/``  SFT of the teacher's preset model on the same corpus;
   ``teacher_ppo/``  PPO of that policy with the task's gold score as its rule reward
                     (:func:`rlhfkit.tasks.reviews.gold_reward`; the critic from the policy): the teacher.
                     A teacher trained against a learned reward model instead (pairs, reward model, PPO, as
                     the reviews quickstart) took longer than the quickstart's five minutes and ended at most
                     0.4 gold above the student (docs/quickstart-and-tasks.md); any PPO policy of the task's
                     vocabulary can be given with ``--teacher``;
4. ``distill/``      ``rlhfkit train distill`` from the student's SFT policy with the teacher as
                     ``online.teacher_model`` on the task's training prompts (the per-token reward
                     -(log pi - log pi_teacher), REINFORCE++'s reward-to-go at ``online.gamma``);
5. evaluation        the gold scorer on the SFT student, the teacher and the distilled student, each sampled at
                     the same temperature on the same held-out prompts (:class:`~rlhfkit.quickstart.pipeline.HackingMeter`);
6. report            ``summary.json`` and ``report.md``: the three gold scores, the share of the SFT-to-teacher
                     gap the distillation closed, the teacher KL at the first and the last rollout, stage seconds.

This module holds no training code: only configurations, the order of the stages, and the evaluation.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfkit.config import config_from
from rlhfkit.quickstart.pipeline import PRESETS, HackingMeter, Preset, ppo_settings, sft_settings
from rlhfkit.quickstart.stages import write_summary


@dataclass(frozen=True)
class DistillPreset:
    """One distillation quickstart: the student's reviews preset (its SFT, pairs and reward model), the
    teacher's schedule (a :class:`~rlhfkit.quickstart.pipeline.Preset` whose SFT and PPO fields are read), and the
    distillation's settings."""

    student: str
    teacher: Preset
    steps: int
    batch: int
    lr: float
    gamma: float
    temperature: float
    num_eval_prompts: int


def _teacher(base: str, model: str, sft: tuple[int, int, float], ppo: tuple[int, int, float]) -> Preset:
    """The teacher's schedule: ``base``'s reviews preset with ``model``, SFT (steps, batch, lr) and PPO
    (rollouts, batch, lr) of its own."""
    from dataclasses import replace

    (sft_steps, sft_batch, sft_lr), (rollouts, ppo_batch, ppo_lr) = sft, ppo
    return replace(
        PRESETS[base],
        model=model,
        sft_steps=sft_steps,
        sft_batch=sft_batch,
        sft_lr=sft_lr,
        ppo_rollouts=rollouts,
        ppo_batch=ppo_batch,
        ppo_lr=ppo_lr,
    )


TEACHER_REWARD = "rlhfkit.tasks.reviews:gold_reward"

# The teacher: 120 SFT steps of 32 bring the small model to well-formed reviews (gold 0.08, 99.6% valid on seed
# 0's held-out prompts), and 12 PPO rollouts of 32 on the gold score at a constant 2e-4 lift it to 1.96 (40
# rollouts: 2.15); 1 thread, the machine shared.
# gamma 0: each token's advantage is its own teacher term (Thinking Machines' recipe). At gamma 1 the summed
# reward-to-go pays a shorter response (fewer negative terms): on seed 3 the student learned to end at once
# (responses of 1 token, teacher KL 1.7 -> 4.4 nats/token, gold -2.9); at gamma 0 every seed 0-4 stayed
# well formed, teacher KL 1.3-1.7 -> 0.004-0.05 (docs/quickstart-and-tasks.md).
DISTILL_PRESETS: dict[str, DistillPreset] = {
    "tiny": DistillPreset(
        student="tiny",
        teacher=_teacher("tiny", "small", (120, 32, 1e-3), (12, 32, 2e-4)),
        steps=40,
        batch=32,
        lr=5e-4,
        gamma=0.0,
        temperature=0.7,
        num_eval_prompts=256,
    ),
    # For the test suite: every stage runs, none long enough to learn much (a tiny-preset teacher).
    "smoke": DistillPreset(
        student="smoke",
        teacher=_teacher("smoke", "tiny", (8, 16, 2e-3), (2, 8, 3e-5)),
        steps=2,
        batch=8,
        lr=1e-3,
        gamma=1.0,
        temperature=0.7,
        num_eval_prompts=16,
    ),
}


def distill_settings(
    sft_dir: Path, teacher_dir: Path, prompts: Path, d: DistillPreset, seed: int
) -> dict[str, Any]:
    """``rlhfkit train distill``'s keys: the student's SFT policy sampling on the training prompts, the teacher's
    per-token term its only reward."""
    p = PRESETS[d.student]
    return {
        "seed": seed,
        "model.name_or_path": sft_dir,
        "online.teacher_model": teacher_dir,
        "data.train_file": prompts,
        "data.max_prompt_length": 32,
        "online.response_length": p.response_length,
        "online.temperature": d.temperature,
        "online.gamma": d.gamma,
        "train.max_steps": d.steps,
        "train.batch_size": d.batch,
        "train.learning_rate": d.lr,
        "train.lr_schedule": "constant",
        "train.save_steps": d.steps,
        "train.eval_steps": d.steps,
        "train.log_steps": 1,
    }


def gold_ppo_settings(policy_dir: Path, prompts: Path, p: Preset, seed: int) -> dict[str, Any]:
    """The reviews quickstart's PPO keys (:func:`~rlhfkit.quickstart.pipeline.ppo_settings`: ``p``'s rollouts,
    batch, learning rate and response length, KL coefficient 0.1) from the policy in ``policy_dir`` with the
    task's gold score as the rule reward (:data:`TEACHER_REWARD`) in the reward model's place, the critic from
    the policy, a constant learning rate and one evaluation, at the end."""
    return {
        **ppo_settings(policy_dir, None, prompts, p, seed),
        "online.critic_model": policy_dir,
        "online.reward_functions": [TEACHER_REWARD],
        "train.lr_schedule": "constant",
        "train.eval_steps": p.ppo_rollouts,
    }


def build_teacher(
    out: Path, files: dict[str, Path], d: DistillPreset, seed: int
) -> tuple[Path, dict[str, float]]:
    """SFT -> PPO on the gold score of the teacher's preset model on the reviews task (module docstring, stage
    3); returns ``(teacher policy folder, {stage: seconds})``."""
    from rlhfkit.trainers import online, sft

    t_p, seconds = d.teacher, {}
    t = _stage("teacher SFT", f"the {t_p.model} model, {t_p.sft_steps} steps of {t_p.sft_batch} examples")
    teacher_files = {**files, "init_model": files["teacher_init"]}
    sft.train(config_from("sft", out / "teacher_sft", sft_settings(teacher_files, t_p, seed)))
    seconds["teacher_sft"] = time.perf_counter() - t

    t = _stage(
        "teacher PPO", f"{t_p.ppo_rollouts} rollouts of {t_p.ppo_batch} prompts, the gold score as reward"
    )
    # the teacher's schedule is the student's preset's (_teacher), its response length too
    settings = gold_ppo_settings(out / "teacher_sft" / "final", files["prompts_train"], t_p, seed)
    online.train(config_from("ppo", out / "teacher_ppo", settings))
    seconds["teacher_ppo"] = time.perf_counter() - t
    return out / "teacher_ppo" / "final", seconds


def quickstart_distill(
    out_dir: str | Path, preset: str = "tiny", seed: int = 0, teacher: str | Path | None = None
) -> dict[str, Any]:
    """Run every stage into ``out_dir`` (module docstring); ``teacher``: a PPO policy folder to distil from
    instead of training one (its vocabulary must be the task's). Returns the summary."""
    from rlhfkit.models import check_teacher_vocabulary
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files
    from rlhfkit.trainers import online, sft

    d = DISTILL_PRESETS[preset]
    p = PRESETS[d.student]
    out = Path(out_dir)
    start, seconds = time.perf_counter(), {}
    task = get_task("reviews", seed=seed)

    t = _stage(
        "task", f"'{task.name}', student {p.model}, teacher {d.teacher.model if teacher is None else teacher}"
    )
    files = prepare_task_files(
        task,
        out / "task",
        p.model,
        num_sft=min(4096, p.sft_steps * p.sft_batch),  # 4096 as the reviews quickstart's, fewer for smoke
        num_sft_eval=min(256, d.num_eval_prompts),
    )
    if teacher is None:
        files["teacher_init"] = out / "task" / "teacher_init"
        tokenizer = task.build_tokenizer(files["teacher_init"])
        task.build_model(d.teacher.model, tokenizer).save_pretrained(files["teacher_init"])
    else:  # refused before any training: the teacher scores the student's token ids
        check_teacher_vocabulary(str(files["init_model"]), str(teacher))
    seconds["task"] = time.perf_counter() - t

    t = _stage("SFT", f"the student ({p.model}), {p.sft_steps} steps of {p.sft_batch} examples")
    sft.train(config_from("sft", out / "sft", sft_settings(files, p, seed)))
    sft_dir = out / "sft" / "final"
    seconds["sft"] = time.perf_counter() - t

    if teacher is None:
        teacher, teacher_seconds = build_teacher(out, files, d, seed)
        seconds.update(teacher_seconds)
    teacher = Path(teacher)

    t = _stage("distillation", f"{d.steps} rollouts of {d.batch} prompts, teacher {teacher}")
    online.train(
        config_from(
            "distill", out / "distill", distill_settings(sft_dir, teacher, files["prompts_train"], d, seed)
        )
    )
    seconds["distill"] = time.perf_counter() - t

    t = _stage(
        "evaluation", f"SFT student, teacher, distilled student on {d.num_eval_prompts} held-out prompts"
    )
    meter = HackingMeter(
        task, sft_dir, None, files["prompts_eval"], _eval_preset(d), seed, temperature=d.temperature
    )
    policies = {"sft": sft_dir, "teacher": teacher, "distilled": out / "distill" / "final"}
    figures = {name: meter.read(folder) for name, folder in policies.items()}
    seconds["evaluation"] = time.perf_counter() - t

    summary = {
        "task": "reviews",
        "preset": preset,
        "seed": seed,
        "teacher_dir": str(teacher),
        "policies": figures,
        "sft_gold": figures["sft"]["gold_mean"],
        "teacher_gold": figures["teacher"]["gold_mean"],
        "distilled_gold": figures["distilled"]["gold_mean"],
        "gap_closed": gap_closed(
            figures["sft"]["gold_mean"], figures["teacher"]["gold_mean"], figures["distilled"]["gold_mean"]
        ),
        **teacher_kl(out / "distill"),
        "stage_seconds": seconds,
        "wall_seconds": time.perf_counter() - start,
    }
    return write_summary(out, summary, "on-policy distillation", format_distill(summary))


def _stage(name: str, detail: str) -> float:
    print(f"[{name}] {detail}", flush=True)
    return time.perf_counter()


def _eval_preset(d: DistillPreset) -> Preset:
    """The student's preset with the distillation's number of held-out prompts (what the meter reads)."""
    from dataclasses import replace

    return replace(PRESETS[d.student], num_eval_prompts=d.num_eval_prompts)


def gap_closed(sft_gold: float, teacher_gold: float, distilled_gold: float) -> float:
    """(distilled - SFT) / (teacher - SFT): 0 where the student started, 1 at the teacher's gold; NaN when
    the teacher is not above the SFT student (no gap to close)."""
    gap = teacher_gold - sft_gold
    return (distilled_gold - sft_gold) / gap if gap > 0 else math.nan


def teacher_kl(run_dir: Path) -> dict[str, float]:
    """``distill/teacher_kl`` (nats per token) at the distillation's first and last logged rollout."""
    from rlhfkit.engine.metrics_writer import read_metrics

    values = [
        row["distill/teacher_kl"]
        for row in read_metrics(run_dir / "metrics.jsonl")
        if "distill/teacher_kl" in row
    ]
    if not values:
        return {"teacher_kl_start": math.nan, "teacher_kl_end": math.nan}
    return {"teacher_kl_start": values[0], "teacher_kl_end": values[-1]}


def format_distill(summary: dict[str, Any]) -> str:
    """The summary as a small table for the terminal and ``report.md``."""
    rows = [
        ("SFT student gold (held out)", f"{summary['sft_gold']:.3f}"),
        ("teacher gold", f"{summary['teacher_gold']:.3f}"),
        ("distilled student gold", f"{summary['distilled_gold']:.3f}"),
        ("SFT-to-teacher gap closed", f"{summary['gap_closed']:.2f}"),
        ("teacher KL, nats/token (start -> end)",
         f"{summary['teacher_kl_start']:.3f} -> {summary['teacher_kl_end']:.3f}"),
        ("stage seconds", ", ".join(f"{k} {v:.0f}" for k, v in summary["stage_seconds"].items())),
        ("wall seconds", f"{summary['wall_seconds']:.0f}"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name.ljust(width)}  {value}" for name, value in rows)
