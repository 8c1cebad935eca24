"""benchmarks/distill_vs_trl.py: what the harness makes of runs, and its rlhfkit side on tiny models.

TRL is not installed here (the harness builds its own virtual environment), so its worker is not run; the rlhfkit
worker runs a real `train distill` of a tiny student toward a tiny teacher (both built here), and the teacher's
`rlhfkit train sft` runs on the tiny student.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.examples.loader import ROOT, load_example, spy_generate
from tests.helpers import tiny_llama, tiny_tokenizer

bench = load_example("distill_vs_trl", ROOT / "benchmarks")


def fake_run(seconds: float, rss: float, teacher: float) -> dict:
    share = dict(zip(bench.PHASES, (0.4, 0.2, 0.15, 0.2, 0.01, 0.04), strict=True))
    return dict(
        seconds=seconds,
        phases={p: seconds * f for p, f in share.items()},
        peak_rss_mib=rss,
        matmul_flops=1e11,
        teacher_seconds=teacher,
    )


def test_compare_rotates_the_order_and_takes_medians(monkeypatch):
    calls = []
    seconds = {"rlhfkit": iter([20.0, 24.0, 18.0]), "trl": iter([30.0, 40.0, 36.0])}
    teacher = {"rlhfkit": iter([1.0, 3.0, 2.0]), "trl": iter([5.0, 4.0, 6.0])}

    def measure(a, system):
        calls.append(system)
        rss = 2000.0 if system == "rlhfkit" else 4000.0
        return fake_run(next(seconds[system]), rss, next(teacher[system])) | (
            {"teacher_kl": 0.5} if system == "rlhfkit" else {}
        )

    monkeypatch.setattr(bench, "measure", measure)
    a = bench.parse_args(
        ["run", "--prompts", "16", "--response-length", "32", "--loss", "jsd", "--jsd-beta", "0.3"]
    )
    r = bench.compare(a)
    assert calls == ["rlhfkit", "trl", "trl", "rlhfkit", "rlhfkit", "trl"]
    assert r["rlhfkit"]["seconds"] == 20.0 and r["trl"]["seconds"] == 36.0
    assert r["rlhfkit"]["tokens_per_second"] == pytest.approx(16 * 32 / 20.0)
    assert r["speedup"] == pytest.approx(36.0 / 20.0) and r["rss_ratio"] == pytest.approx(0.5)
    assert r["rlhfkit"]["teacher_seconds"] == 2.0 and r["trl"]["teacher_seconds"] == 5.0
    assert r["trl_beta"] == 0.3 and r["rlhfkit"]["teacher_kl"] == 0.5 and "teacher_kl" not in r["trl"]
    text = bench.report(r)
    assert "**1.80x**" in text and "**0.50x**" in text and "TRL beta=0.3" in text


def test_the_teacher_seconds_are_the_windows_mean_per_step():
    timer = bench.DistillTimer()
    for teacher in (1.0, 3.0, 4.0, 10.0):  # the teacher's seconds so far at the start of steps 1..4
        timer.teacher = teacher
        timer.mark()
    assert timer.window(1, 3)["teacher_seconds"] == pytest.approx((10.0 - 3.0) / 2)
    assert timer.window(0, 1)["teacher_seconds"] == pytest.approx(2.0)


def test_trl_beta_for_each_loss():
    # both reverse KLs are TRL's full-vocabulary reverse KL; the JSD keeps its mixture weight
    assert bench.trl_beta("reverse_kl", 0.5) == 1.0
    assert bench.trl_beta("full_reverse_kl", 0.5) == 1.0
    assert bench.trl_beta("jsd", 0.25) == 0.25


def test_smoke_sizes_and_the_window_needs_three_steps():
    a = bench.parse_args(["run", "--smoke", "--prompts", "64"])
    assert (a.prompts, a.response_length, a.steps, a.micro_batch, a.repeats) == (2, 4, 3, 2, 1)
    with pytest.raises(SystemExit):
        bench.parse_args(["run", "--steps", "2"])


def write_models(root):
    """A tiny student (seed 0) and a teacher of the same vocabulary with other weights (seed 5), chat template."""
    tok = tiny_tokenizer(pad="eos", chat_template=True)
    folders = {}
    for name, seed in (("student", 0), ("teacher", 5)):
        model = tiny_llama(seed=seed, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        folders[name] = root / name
    return folders


def worker_args(work, folders, **sizes) -> argparse.Namespace:
    args = ["worker", "--system", "rlhfkit", "--work", str(work), "--threads", "1"]
    args += ["--model", str(folders["student"]), "--teacher", str(folders["teacher"])]
    for key, value in sizes.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return bench.parse_args(args)


def test_rlhfkit_worker_times_the_teacher_forces_the_length_and_unpatches(tmp_path, monkeypatch, capsys):
    from rlhfkit.models import head_chunks
    from rlhfkit.trainers.online import context

    folders = write_models(tmp_path)
    work = tmp_path / "inputs"
    bench.grpo.prepare(work, folders["student"])
    calls, stops = spy_generate(monkeypatch)
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    before = (head_chunks.chunked_readout, context.build_roles)
    bench.run_worker(worker_args(work, folders, steps=3, prompts=2, response_length=5, micro_batch=2))
    result = json.loads(capsys.readouterr().out.split("RESULT ")[-1])
    lengths = [n for call in calls for n in call]
    assert lengths and set(lengths) == {5}  # 3 steps x 2 responses, never stopped early
    assert len(lengths) == 6
    # because the only stop token is one the sampler never emits (a random model's 5 tokens alone would not show it)
    pad = tiny_tokenizer(pad="eos").pad_token_id
    assert all(ids == [pad] and pad in suppressed for ids, suppressed in stops)
    assert result["peak_rss_mib"] > 0 and result["threads"] == 1 and result["loss"] == "reverse_kl"
    assert 0 < result["teacher_seconds"] <= result["phases"]["no-grad forwards"]
    assert result["teacher_kl"] != 0.0  # another model: the sampled term is not 0
    for phase in bench.PHASES[:-1]:
        assert result["phases"][phase] > 0, phase
    assert sum(result["phases"].values()) == pytest.approx(result["seconds"])
    assert (head_chunks.chunked_readout, context.build_roles) == before


def test_a_run_that_trains_nothing_is_an_error(tmp_path, monkeypatch):
    """A teacher equal to the student: the sampled term is 0, the student does not move, and the worker says so
    (as it would for a distill.loss that this rlhfkit accepts and does not train)."""
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    folders = write_models(tmp_path)
    folders["teacher"] = folders["student"]
    work = tmp_path / "inputs"
    bench.grpo.prepare(work, folders["student"])
    a = worker_args(work, folders, steps=3, prompts=2, response_length=3, micro_batch=2)
    with pytest.raises(SystemExit, match="the student did not move"):
        bench.worker_rlhfkit(a, tmp_path, bench.DistillTimer())
    # the run had the comparison's settings
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["kind"] == "distill" and config["distill"]["loss"] == "reverse_kl"
    assert config["model"]["lora_rank"] == 16 and config["model"]["lora_alpha"] == 32
    assert config["online"]["teacher_model"] == str(folders["student"])
    assert config["online"]["response_length"] == 3 and config["online"]["temperature"] == 1.0
    assert config["train"]["batch_size"] == 2 and config["online"]["group_size"] == 1
    assert config["train"]["lr_schedule"] == "constant" and config["train"]["learning_rate"] == 1e-5


def test_a_worker_process_gives_its_result_line_or_its_output():
    def child(code: str) -> list[str]:
        return [sys.executable, "-c", "import json, sys; print('noise'); " + code]

    two = child(
        "print('RESULT ' + json.dumps({'seconds': 1.0})); print('RESULT ' + json.dumps({'seconds': 1.5}))"
    )
    assert bench.grpo.run_child(two, dict(os.environ), "ok") == {"seconds": 1.5}  # the last line
    failing = child("print('half done'); sys.exit('broken here')")
    with pytest.raises(SystemExit, match="(?s)rlhfkit failed \\(exit 1\\).*half done.*broken here"):
        bench.grpo.run_child(failing, dict(os.environ), "rlhfkit")
    # a result line does not hide a process that then fails
    late = child("print('RESULT ' + json.dumps({'seconds': 1.0})); sys.exit('at exit')")
    with pytest.raises(SystemExit, match="(?s)trl failed \\(exit 1\\).*at exit"):
        bench.grpo.run_child(late, dict(os.environ), "trl")


def test_the_teacher_is_a_fine_tuned_copy_with_the_students_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    folders = write_models(tmp_path)
    teacher = bench.make_teacher(folders["student"], tmp_path / "sft-teacher", steps=2)
    assert not (tmp_path / "sft-teacher.sft").exists()
    student_w = load_file(str(folders["student"] / "model.safetensors"))
    teacher_w = load_file(str(teacher / "model.safetensors"))
    assert student_w.keys() == teacher_w.keys()
    assert all(student_w[k].shape == teacher_w[k].shape for k in student_w)
    assert any(not torch.equal(student_w[k], teacher_w[k]) for k in student_w)  # trained: not the student
    assert (
        json.loads((teacher / "tokenizer.json").read_text())["model"]["vocab"]
        == json.loads((folders["student"] / "tokenizer.json").read_text())["model"]["vocab"]
    )
    # done once: a second call leaves the folder as it is
    stamp = (teacher / "model.safetensors").stat().st_mtime_ns
    assert bench.make_teacher(folders["student"], tmp_path / "sft-teacher", steps=2) == teacher
    assert (teacher / "model.safetensors").stat().st_mtime_ns == stamp
