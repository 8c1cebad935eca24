"""benchmarks/distill_vs_trl.py: what the harness makes of runs, and its rlhfkit side on tiny models.

TRL is not installed here (the harness builds its own virtual environment), so its worker is not run; the rlhfkit
worker runs a real `train distill` of a tiny student toward a tiny teacher (both built here), and the teacher's
`rlhfkit train sft` runs on the tiny student.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.examples.loader import ROOT, load_example
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
    import importlib
    import pkgutil

    import rlhfkit.trainers
    from rlhfkit.models import head_chunks
    from rlhfkit.rollout import generation
    from rlhfkit.trainers.online import context

    folders = write_models(tmp_path)
    work = tmp_path / "inputs"
    bench.grpo.prepare(work, folders["student"])
    lengths = []
    generate = generation.generate_responses

    def spy(*args, **kwargs):
        out = generate(*args, **kwargs)
        lengths.extend(out.mask.sum(1).tolist())
        return out

    for info in pkgutil.walk_packages(rlhfkit.trainers.__path__, "rlhfkit.trainers."):
        module = importlib.import_module(info.name)
        if getattr(module, "generate_responses", None) is generate:
            monkeypatch.setattr(module, "generate_responses", spy)
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    before = (head_chunks.chunked_readout, context.build_roles)
    bench.run_worker(worker_args(work, folders, steps=3, prompts=2, response_length=5, micro_batch=2))
    result = json.loads(capsys.readouterr().out.split("RESULT ")[-1])
    assert lengths and set(lengths) == {5}  # 3 steps x 2 responses, never stopped early
    assert len(lengths) == 6
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
