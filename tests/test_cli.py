"""The `rlhfkit` command, in-process: exit codes, one-line errors, dispatch to the trainers."""

import importlib
import os
import subprocess
import sys

import pytest

from rlhfkit import cli, commands
from rlhfkit.config import KINDS
from rlhfkit.engine.folder import RUN_MARKER
from rlhfkit.errors import DataError


@pytest.fixture(autouse=True)
def no_thread_change(monkeypatch):
    """main() sets torch's thread count; record it instead, so that these tests leave it at 1."""
    calls = []
    monkeypatch.setattr("rlhfkit.engine.threads.set_num_threads", lambda *a: calls.append(a) or 1)
    return calls


@pytest.fixture
def fake(monkeypatch):
    """Point every command at a recording function."""
    calls = []

    def train(cfg, resume):
        calls.append(("train", cfg, resume))

    monkeypatch.setattr(commands, "trainer", lambda kind: train)
    monkeypatch.setattr(
        "rlhfkit.quickstart.pipeline.quickstart",
        lambda out_dir, preset, overwrite, **kw: calls.append(("quickstart", out_dir, preset, overwrite)),
    )
    monkeypatch.setattr(
        "rlhfkit.rollout.generate_cli.generate",
        lambda model, prompts, **kw: calls.append(("generate", model, prompts, kw)),
    )
    monkeypatch.setattr(
        "rlhfkit.reporting.report.write_reports",
        lambda run_dirs, out: calls.append(("report", run_dirs, out)) or [],
    )
    return calls


def config_file(tmp_path, out="run", extra=""):
    """A configuration whose files exist (the pre-flight reads them): one row that is an SFT and a prompt row;
    Hub names for the models, which nothing here loads."""
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    path = tmp_path / "cfg.yaml"
    path.write_text(
        f"output_dir: {tmp_path / out}\nmodel:\n  name_or_path: m\ndata:\n  train_file: {tmp_path / 'd.jsonl'}\n"
        f"online:\n  reward_model: rm\n{extra}"
    )
    return path


def error_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlhfkit: error: ") and "Traceback" not in err, err
    return err


def test_every_kind_has_a_trainer():
    for kind in KINDS:
        assert callable(commands.trainer(kind))


def test_help(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("train", "quickstart", "generate", "report"):
        assert command in out
    assert cli.main(["train", "ppo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--resume" in out and "online.kl_estimator (k1|k2|k3, default: 'k1')" in out
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "grpo: model, data, train, online, logging" in out and "online.kl_estimator" not in out
    for command in ("quickstart", "generate", "report"):
        assert cli.main([command, "--help"]) == 0
    assert cli.main(["--version"]) == 0


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["train"],
        ["train", "kto", "--config", "x"],
        ["train", "sft"],
        ["train", "sft", "--config", "c", "--resume", "--overwrite"],
        ["fly"],
        ["generate", "--model", "m", "--prompts", "p", "--greedy", "--temperature", "1"],
        ["report"],
        ["train", "sft", "--config", "c", "notakey"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "usage: rlhfkit" in capsys.readouterr().err


def test_train_dispatch_with_overrides(tmp_path, fake, no_thread_change):
    path = config_file(tmp_path)
    assert (
        cli.main(["train", "grpo", "train.learning_rate=3e-6", "--config", str(path), "online.kl_coef=0.1"])
        == 0
    )
    ((_, cfg, resume),) = fake
    assert cfg.kind == "grpo" and cfg.online.advantage_estimator == "grpo" and cfg.online.group_size >= 2
    assert cfg.train.learning_rate == 3e-6 and cfg.online.kl_coef == 0.1 and resume is False
    assert (tmp_path / "run" / RUN_MARKER).is_file()
    assert no_thread_change == [()]  # set once, before the trainer runs
    for kind, estimator in (("ppo", "gae"), ("rloo", "rloo")):
        fake.clear()
        assert cli.main(["train", kind, "--config", str(path), "--overwrite"]) == 0
        assert fake[0][1].online.advantage_estimator == estimator


def test_occupied_output_folder(tmp_path, fake, capsys):
    path = config_file(tmp_path)
    assert cli.main(["train", "sft", "--config", str(path)]) == 0
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert cli.main(["train", "sft", "--config", str(path)]) == 2
    assert "is not empty; pass --resume" in error_line(capsys)
    assert len(fake) == 1 and (tmp_path / "run" / "metrics.jsonl").exists()
    assert cli.main(["train", "sft", "--config", str(path), "--resume"]) == 0
    assert fake[-1][2] is True and (tmp_path / "run" / "metrics.jsonl").exists()
    assert cli.main(["train", "sft", "--config", str(path), "--overwrite"]) == 0
    assert fake[-1][2] is False and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_config_errors_are_one_line(tmp_path, fake, capsys):
    path = config_file(tmp_path, extra="train:\n  bach_size: 4\n")
    assert cli.main(["train", "sft", "--config", str(path)]) == 2
    err = error_line(capsys)
    assert str(path) in err and "train.bach_size" in err and "did you mean 'train.batch_size'" in err
    assert cli.main(["train", "sft", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "config file not found" in error_line(capsys)
    assert cli.main(["train", "sft", "--config", str(config_file(tmp_path)), "model.dtype=fp8"]) == 2
    assert "model.dtype" in error_line(capsys)
    assert not fake


def test_bugs_keep_their_traceback(tmp_path, monkeypatch):
    broken = tmp_path / "broken_trainer.py"
    broken.write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(commands, "trainer", lambda kind: importlib.import_module("broken_trainer").train)
    with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_not_installed"):
        cli.main(["train", "sft", "--config", str(config_file(tmp_path))])

    def crash(cfg, resume):
        raise RuntimeError("a bug")

    monkeypatch.setattr(commands, "trainer", lambda kind: crash)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["train", "sft", "--config", str(config_file(tmp_path)), "--overwrite"])


def test_user_errors_from_a_trainer(tmp_path, monkeypatch, capsys):
    def bad_data(cfg, resume):
        raise DataError("d.jsonl", "'prompt' is empty", line=3, field="prompt")

    monkeypatch.setattr(commands, "trainer", lambda kind: bad_data)
    assert cli.main(["train", "sft", "--config", str(config_file(tmp_path))]) == 2
    assert error_line(capsys) == "rlhfkit: error: d.jsonl, line 3, field 'prompt': 'prompt' is empty\n"


def test_quickstart_generate_report(tmp_path, fake, capsys):
    assert cli.main(["quickstart", "--out", str(tmp_path / "q"), "--preset", "small"]) == 0
    assert fake[-1] == ("quickstart", str(tmp_path / "q"), "small", False)
    (tmp_path / "q" / "summary.json").write_text("{}")
    assert cli.main(["quickstart", "--out", str(tmp_path / "q")]) == 2
    assert "is not empty" in error_line(capsys)
    assert cli.main(["quickstart", "--out", str(tmp_path / "q"), "--overwrite"]) == 0

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert cli.main(["generate", "--model", "m", "--prompts", str(prompts), "--greedy"]) == 0
    assert fake[-1] == (
        "generate",
        "m",
        str(prompts),
        {
            "out": None,
            "temperature": 0.0,
            "max_new_tokens": 64,
            "seed": 0,
            "reward_model": None,
            "hf_decode": "dynamic",
            "sampler": "exact",
            "backend": "hf",
            "reward_functions": [],
        },
    )
    assert cli.main(["generate", "--model", "m", "--prompts", str(prompts), "--backend", "vllm"]) == 0
    assert fake[-1][3]["backend"] == "vllm"
    assert cli.main(["generate", "--model", "m", "--prompts", str(prompts), "--hf-decode", "static"]) == 0
    assert fake[-1][3]["hf_decode"] == "static"
    assert cli.main(["generate", "--model", "m", "--prompts", str(prompts), "--sampler", "multinomial"]) == 0
    assert fake[-1][3]["sampler"] == "multinomial"
    assert cli.main(["generate", "--model", "m", "--prompts", str(prompts), "--backend", "sglang"]) == 2
    assert "invalid choice: 'sglang'" in capsys.readouterr().err
    assert cli.main(["generate", "--model", "m", "--prompts", str(prompts), "--out", "o.jsonl"]) == 0
    assert fake[-1][3]["temperature"] == 0.7 and fake[-1][3]["out"] == "o.jsonl"
    assert cli.main(["generate", "--model", "m", "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert "prompts file not found" in error_line(capsys)
    assert cli.main(["generate", "--model", "m", "--prompts", str(prompts), "--temperature", "-1"]) == 2
    assert "--temperature must be >= 0" in error_line(capsys)

    assert cli.main(["report", str(tmp_path / "q")]) == 0
    assert fake[-1] == ("report", [str(tmp_path / "q")], None)
    assert cli.main(["report", str(tmp_path / "q"), str(tmp_path), "--out", "c.html"]) == 0
    assert fake[-1] == ("report", [str(tmp_path / "q"), str(tmp_path)], "c.html")
    assert cli.main(["report", str(tmp_path / "q"), str(tmp_path / "nowhere")]) == 2
    assert "run folder not found" in error_line(capsys)


def test_subprocess_user_error_has_no_traceback(tmp_path):
    """The real entry point, once: exit code 2 and a single line on stderr."""
    env = {**os.environ, "RLHFKIT_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "rlhfkit.cli", "train", "sft", "--config", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr == f"rlhfkit: error: config file not found: {tmp_path / 'missing.yaml'}\n"


def test_label_pairs_takes_model_like_generate_and_still_reads_policy(tmp_path, monkeypatch, capsys):
    calls = []

    def label_pairs(policy, out, **kw):
        calls.append((policy, out))
        info = {"pairs": 1, "file": "f", "bayes_ceiling": None}
        return {"train": info, "eval": info, "seconds": {"total": 0.0}}

    monkeypatch.setattr("rlhfkit.rollout.pairs.label_pairs", label_pairs)
    policy = tmp_path / "policy"
    policy.mkdir()
    assert cli.main(["label-pairs", "--model", str(policy), "--out", str(tmp_path / "a")]) == 0
    assert calls[-1] == (str(policy), str(tmp_path / "a")) and "warning" not in capsys.readouterr().err
    assert cli.main(["label-pairs", "--policy", str(policy), "--out", str(tmp_path / "b")]) == 0
    assert calls[-1] == (str(policy), str(tmp_path / "b"))
    assert "rlhfkit: warning: --policy is now --model" in capsys.readouterr().err
    for command in ("generate", "label-pairs"):
        assert cli.main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert "--model DIR" in out and "--out" in out


def test_reinforce_pp_is_reachable_from_train_ppo(tmp_path, fake, capsys):
    path = config_file(tmp_path)
    assert cli.main(["train", "ppo", "--config", str(path), "online.advantage_estimator=reinforce_pp"]) == 0
    assert fake[-1][1].online.advantage_estimator == "reinforce_pp"
    assert cli.main(["train", "ppo", "--help"]) == 0
    assert "REINFORCE++ is ppo with online.advantage_estimator=reinforce_pp" in " ".join(
        capsys.readouterr().out.split()
    )
