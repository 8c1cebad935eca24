"""`rlhfkit quickstart --task distill` at the smoke preset: the stages run, the summary's fields, each gold
figure read from its own policy (a direct HackingMeter read of each folder gives the same figures), the teacher
built by SFT -> PPO on the gold score or given by --teacher (its vocabulary checked first), and bad input refused."""

import json
import math
from dataclasses import replace

import pytest

from rlhfkit.cli import main
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.quickstart.distillation import DISTILL_PRESETS, PRESETS, gap_closed
from rlhfkit.quickstart.pipeline import HackingMeter
from rlhfkit.tasks import get_task
from tests.helpers import tiny_tokenizer


def write_teacher(folder, seed=5):
    """A fresh tiny model of the reviews task with its tokenizer: a teacher of the task's vocabulary."""
    task = get_task("reviews", seed=0)
    tokenizer = task.build_tokenizer(folder)
    task.build_model("tiny", tokenizer, seed=seed).save_pretrained(folder)
    return folder


def smoke_argv(teacher, out):
    """``rlhfkit quickstart --task distill --preset smoke --teacher TEACHER --out OUT``."""
    return [
        "quickstart",
        "--task",
        "distill",
        "--preset",
        "smoke",
        "--teacher",
        str(teacher),
        "--out",
        str(out),
    ]


def direct_read(out, folder, rm_dir=None):
    """The held-out figures of the policy in ``folder``, by a HackingMeter of the run's own files."""
    d = DISTILL_PRESETS["smoke"]
    meter = HackingMeter(
        get_task("reviews", seed=0),
        out / "sft" / "final",
        rm_dir,
        out / "task" / "prompts_eval.jsonl",
        replace(PRESETS[d.student], num_eval_prompts=d.num_eval_prompts),
        seed=0,
        temperature=d.temperature,
    )
    return meter.read(folder)


def test_quickstart_distill_smoke_with_a_given_teacher(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    teacher = write_teacher(tmp_path / "teacher")
    out = tmp_path / "qs"
    assert main(smoke_argv(teacher, out)) == 0
    printed = capsys.readouterr().out
    for stage in ("[task]", "[SFT]", "[distillation]", "[evaluation]"):
        assert stage in printed
    assert "[teacher SFT]" not in printed and not (out / "teacher_ppo").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["teacher_dir"] == str(teacher)
    assert set(summary["stage_seconds"]) == {"task", "sft", "distill", "evaluation"}
    assert summary["wall_seconds"] >= sum(summary["stage_seconds"].values()) > 0

    # the distillation ran from the student's SFT policy toward the given teacher
    config = (out / "distill" / "config.yaml").read_text()
    assert f"teacher_model: {teacher}" in config and f"name_or_path: {out / 'sft' / 'final'}" in config

    # each policy's figures are a direct read of its own folder (the three differ: a read of the wrong
    # folder is caught)
    folders = {"sft": out / "sft" / "final", "teacher": teacher, "distilled": out / "distill" / "final"}
    for name, folder in folders.items():
        assert summary["policies"][name] == pytest.approx(direct_read(out, folder)), name
    figures = [summary["policies"][name] for name in folders]
    assert figures[0] != figures[1] and figures[0] != figures[2] and figures[1] != figures[2]
    for name in folders:
        key = "distilled_gold" if name == "distilled" else f"{name}_gold"
        assert summary[key] == summary["policies"][name]["gold_mean"]

    kl = [row["distill/teacher_kl"] for row in read_metrics(out / "distill" / "metrics.jsonl")]
    assert len(kl) == DISTILL_PRESETS["smoke"].steps
    assert (summary["teacher_kl_start"], summary["teacher_kl_end"]) == (kl[0], kl[-1])
    report = (out / "report.md").read_text()
    assert "teacher gold" in report and "gap closed" in report and "distilled student gold" in report


@pytest.mark.long  # end to end, tens of seconds: CI's long step (the suite stays under 15 minutes)
def test_quickstart_distill_smoke_builds_its_teacher(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    out = tmp_path / "qs"
    assert main(["quickstart", "--task", "distill", "--preset", "smoke", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for stage in ("[teacher SFT]", "[teacher PPO]", "[distillation]"):
        assert stage in printed
    assert "[pairs]" not in printed and not (out / "reward").exists()
    summary = json.loads((out / "summary.json").read_text())
    teacher = out / "teacher_ppo" / "final"
    assert summary["teacher_dir"] == str(teacher)
    # the teacher: PPO from the teacher's own SFT (its preset's model, the critic from it) on the gold score
    ppo = (out / "teacher_ppo" / "config.yaml").read_text()
    assert f"name_or_path: {out / 'teacher_sft' / 'final'}" in ppo
    assert f"critic_model: {out / 'teacher_sft' / 'final'}" in ppo
    assert "rlhfkit.tasks.reviews:gold_reward" in ppo and "reward_model: null" in ppo
    rewards = [row["score/gold_reward"] for row in read_metrics(out / "teacher_ppo" / "metrics.jsonl")]
    assert len(rewards) == DISTILL_PRESETS["smoke"].teacher.ppo_rollouts
    assert (
        f"name_or_path: {out / 'task' / 'teacher_init'}" in (out / "teacher_sft" / "config.yaml").read_text()
    )
    assert f"teacher_model: {teacher}" in (out / "distill" / "config.yaml").read_text()
    for name, folder in (("teacher", teacher), ("distilled", out / "distill" / "final")):
        assert summary["policies"][name] == pytest.approx(direct_read(out, folder)), name
    assert set(summary["stage_seconds"]) == {
        "task",
        "sft",
        "teacher_sft",
        "teacher_ppo",
        "distill",
        "evaluation",
    }


def test_gap_closed_by_hand():
    assert gap_closed(1.0, 3.0, 2.5) == pytest.approx(0.75)
    assert gap_closed(1.0, 3.0, 0.5) == pytest.approx(-0.25)
    assert gap_closed(1.0, 3.0, 3.0) == pytest.approx(1.0)
    assert math.isnan(gap_closed(1.0, 1.0, 2.0)) and math.isnan(gap_closed(2.0, 1.0, 2.0))


def test_quickstart_distill_refuses_a_teacher_of_another_vocabulary(tmp_path, capsys):
    teacher = tmp_path / "teacher"
    tiny_tokenizer().save_pretrained(teacher)
    out = tmp_path / "qs"
    assert main(smoke_argv(teacher, out)) == 2
    err = capsys.readouterr().err
    assert "vocabulary" in err and str(teacher) in err and "Traceback" not in err
    assert not (out / "sft").exists()  # refused before any training


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "distill", "--teacher", "no/such/folder"], "folder not found"),
        (["--task", "reviews", "--teacher", "."], "--teacher is for --task distill"),
        (["--task", "distill", "--preset", "small"], "--task distill runs the presets"),
        (["--task", "distill", "--refresh-steps", "2"], "no reward-model refresh"),
    ],
)
def test_quickstart_distill_refuses_bad_options(tmp_path, capsys, args, message):
    code = main(["quickstart", "--out", str(tmp_path / "q"), *args])
    assert code == 2 and message in capsys.readouterr().err and not (tmp_path / "q").exists()
