"""Run folder: --resume / --overwrite rules, metrics.jsonl, summary.json, config on resume, sinks, progress."""

import io
import json
import sys
import types

import numpy as np
import pytest
import torch

from rlhfkit.config import load_config
from rlhfkit.engine.checkpoint import save_checkpoint
from rlhfkit.engine.folder import LOCK_FILE, RUN_MARKER, RunDir, prepare_output_dir
from rlhfkit.engine.metrics_writer import MetricsWriter, progress_bar, read_metrics
from rlhfkit.errors import ConfigError, UserError


def config(out, *extra, kind="sft"):
    return load_config(
        None, [f"output_dir={out}", "model.name_or_path=m", "data.train_file=d.jsonl", *extra], kind
    )


def test_output_dir_rules(tmp_path):
    run = tmp_path / "run"
    prepare_output_dir(run)
    assert (run / RUN_MARKER).is_file()
    prepare_output_dir(run)  # holds only the marker: still empty
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match=r"output folder .*run is not empty; pass --resume .* --overwrite"):
        prepare_output_dir(run)
    with pytest.raises(UserError, match="contradict"):
        prepare_output_dir(run, resume=True, overwrite=True)
    prepare_output_dir(run, resume=True)
    assert (run / "metrics.jsonl").exists()
    prepare_output_dir(run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == [RUN_MARKER, LOCK_FILE]  # the marker and the lock

    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    for flags in ({"overwrite": True}, {"resume": True}):
        with pytest.raises(UserError, match="not an rlhfkit run folder"):
            prepare_output_dir(foreign, **flags)
    assert (foreign / "thesis.tex").read_text() == "precious"
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is a file"):
        prepare_output_dir(tmp_path / "file")


def test_metrics_lines_are_flushed_and_plain_json(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.log(
        1,
        {
            "loss/policy": torch.tensor(0.5),
            "kl/mean": np.float32(0.25),
            "n": np.int64(3),
            "score/mean": float("nan"),
            "ok": True,
            "note": "x",
        },
    )
    first = (tmp_path / "metrics.jsonl").read_text()  # before close: flushed
    assert json.loads(first) == {
        "step": 1,
        "loss/policy": 0.5,
        "kl/mean": 0.25,
        "n": 3,
        "score/mean": None,
        "ok": True,
        "note": "x",
    }
    writer.log(2, {"loss/policy": 0.25})
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    with pytest.raises(ValueError, match="must not contain 'step'"):
        MetricsWriter(tmp_path / "m2.jsonl").log(1, {"step": 3})
    with pytest.raises(TypeError, match="'v': expected one number"):
        MetricsWriter(tmp_path / "m3.jsonl").log(1, {"v": torch.ones(2)})


def simulate(out, steps, crash_after=None, resume=False, save_every=2):
    """A trainer's bookkeeping: log step N, then checkpoint N; optionally die after logging crash_after."""
    model = torch.nn.Linear(2, 2)
    run = RunDir(out, resume, config=config(out))
    start = run.resume_step
    if not resume or run.resume_checkpoint is None:
        run.metrics.log(0, {"eval/score": 0.0})
    for step in range(start + 1, steps + 1):
        run.metrics.log(step, {"loss": 1.0 / step})
        if step == crash_after:
            run.metrics._file.write(f'{{"step": {step + 1}, "lo')  # killed mid-line
            run.metrics._file.flush()
            return run
        if step % save_every == 0:
            save_checkpoint(run.checkpoints_dir, step, {"m": model})
    run.write_summary({"final_loss": 1.0 / steps})
    run.close()
    return run


def test_resume_leaves_metrics_equal_to_an_uninterrupted_run(tmp_path):
    simulate(tmp_path / "a", 7)
    crashed = simulate(tmp_path / "b", 7, crash_after=5)
    crashed.close()
    assert [r["step"] for r in read_metrics(tmp_path / "b/metrics.jsonl")] == [0, 1, 2, 3, 4, 5]
    run = RunDir(tmp_path / "b", resume=True, config=config(tmp_path / "b"))
    assert run.resume_step == 4 and run.resume_checkpoint.name == "step-4"
    assert [r["step"] for r in read_metrics(tmp_path / "b/metrics.jsonl")] == [0, 1, 2, 3, 4]
    run.close()
    simulate(tmp_path / "b", 7, resume=True)
    assert (tmp_path / "a/metrics.jsonl").read_text() == (tmp_path / "b/metrics.jsonl").read_text()
    assert json.loads((tmp_path / "b/summary.json").read_text()) == {"final_loss": 1 / 7}


def test_resume_without_a_checkpoint_starts_over(tmp_path):
    simulate(tmp_path / "a", 3)
    simulate(tmp_path / "b", 3, crash_after=1)
    simulate(tmp_path / "b", 3, resume=True)
    assert (tmp_path / "a/metrics.jsonl").read_text() == (tmp_path / "b/metrics.jsonl").read_text()


def test_corrupt_metrics_line_is_named(tmp_path):
    run = tmp_path / "run"
    prepare_output_dir(run)
    (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match=r"metrics\.jsonl, line 2: not a metrics record"):
        RunDir(run, resume=True)


def test_resume_refuses_a_changed_configuration(tmp_path):
    out = tmp_path / "run"
    RunDir(out, config=config(out)).close()
    assert load_config(out / "config.yaml", [], "sft") == config(out)
    # Without a checkpoint a resume starts again from step 0: any change is fine (a run stopped by bad data
    # is rerun with the fixed file without --overwrite).
    RunDir(out, resume=True, config=config(out, "data.train_file=fixed.jsonl")).close()
    RunDir(out, resume=True, config=config(out)).close()
    save_checkpoint(out / "checkpoints", 1, {"m": torch.nn.Linear(2, 1)})
    with pytest.raises(ConfigError, match=r"train\.learning_rate: 1e-05 -> 0\.001.*--overwrite"):
        RunDir(out, resume=True, config=config(out, "train.learning_rate=1e-3"))
    RunDir(out, resume=True, config=config(out, "train.max_steps=500", "logging.progress_bar=false")).close()
    assert load_config(out / "config.yaml", [], "sft").train.max_steps == 500


def test_summary_is_strict_json(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_summary({"ppo": {"gold_mean": torch.tensor(1.5), "kl_mean": float("inf")}, "wall_seconds": 3})
    text = (tmp_path / "run/summary.json").read_text()
    assert json.loads(text) == {"ppo": {"gold_mean": 1.5, "kl_mean": None}, "wall_seconds": 3}
    run.close()


def test_other_processes_write_nothing(tmp_path):
    run = RunDir(tmp_path / "run", config=config(tmp_path / "run"), main_process=False)
    run.metrics.log(1, {"loss": 1.0})
    run.write_summary({"a": 1})
    run.close()
    assert not (tmp_path / "run").exists()


def test_progress_bar_is_quiet_unless_on_a_terminal(monkeypatch):
    assert progress_bar(range(3)).disable  # pytest: stderr is captured, and PYTEST_CURRENT_TEST is set

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    assert progress_bar(range(3)).disable  # still quiet under pytest
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    bar = progress_bar(total=4, desc="ppo", initial=1)
    assert not bar.disable
    bar.update(1)
    bar.close()
    assert "ppo" in stream.getvalue() and "2/4" in stream.getvalue()
    assert progress_bar(range(3), enabled=False).disable


def test_wandb_and_tensorboard_sinks(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, numbers, step):
            calls.append(("wandb", step, numbers))

        def finish(self):
            calls.append(("finish",))

    fake_wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or FakeRun())

    class FakeWriter:
        def __init__(self, log_dir, purge_step):
            calls.append(("tb", log_dir, purge_step))

        def add_scalar(self, key, value, step):
            calls.append(("scalar", key, value, step))

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter)
    )
    out = tmp_path / "run"
    cfg = config(out, "logging.wandb=true", "logging.tensorboard=true", "logging.wandb_project=p")
    run = RunDir(out, config=cfg)
    run.metrics.log(3, {"loss": 0.5, "note": "text", "ok": True})
    run.close()
    init = calls[1][1]
    run_id = json.loads((out / RUN_MARKER).read_text())["wandb_id"]
    assert calls[0] == ("tb", str(out / "tensorboard"), None)
    assert (
        init["project"] == "p"
        and init["name"] == "run"
        and init["id"] == run_id
        and init["resume"] == "allow"
    )
    assert init["config"]["logging"]["wandb"] is True
    assert ("scalar", "loss", 0.5, 3) in calls and ("wandb", 3, {"loss": 0.5}) in calls
    assert calls[-1] == ("finish",)
    calls.clear()
    RunDir(out, resume=True, config=cfg).close()  # no checkpoint: starts over, same W&B run, TB purged from 0
    assert calls[0] == ("tb", str(out / "tensorboard"), 1) and calls[1][1]["id"] == run_id

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ConfigError, match="logging.wandb is true, but wandb is not installed"):
        RunDir(tmp_path / "other", config=config(tmp_path / "other", "logging.wandb=true"))


def test_the_run_line_names_the_precision_the_run_computes_in(tmp_path, monkeypatch):
    """config.yaml's run line holds the precision (model.dtype, and what auto resolved to), which the report
    names."""
    from rlhfkit.config import read_run_info
    from rlhfkit.engine.accel import make_accelerator
    from rlhfkit.engine.folder import open_run

    accelerator = make_accelerator(cpu=True)
    for name, extra, expected in (("auto", (), "float32"), ("bf16", ("model.dtype=bfloat16",), "bfloat16")):
        open_run(config(tmp_path / name, *extra), accelerator)
        assert read_run_info(tmp_path / name / "config.yaml")["precision"] == expected, name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU with bf16: auto means bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    open_run(config(tmp_path / "gpu"), accelerator)
    assert read_run_info(tmp_path / "gpu" / "config.yaml")["precision"] == "bfloat16"
