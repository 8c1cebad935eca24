"""What a user who leaves a run alone depends on, tried as a careless and as a hostile user would.

One table of cases run in-process through ``main(argv)``: each asserts the exit code, the one line that names
the problem, no traceback, and that no earlier output was damaged. Subprocesses only where a second process
is the point: signals, the run-folder lock, a kill.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhfkit.cli import main
from rlhfkit.engine import checkpoint as ckpt
from rlhfkit.engine import signals
from rlhfkit.engine.checkpoint import (
    MARKER,
    complete_checkpoints,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from rlhfkit.engine.folder import LOCK_FILE
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.errors import CheckpointError
from tests.helpers import tiny_llama, tiny_tokenizer
from tests.trainers.online.online_fixtures import online_cli_args, write_online_problem
from tests.trainers.sft_fixtures import PAIRS, sft_args, write_sft_problem

BAD_REWARDS = """
def huge(prompts, completions, **kwargs):
    return [1e300 for _ in completions]

def raising(prompts, completions, **kwargs):
    raise ValueError("the grader is down")
"""


@pytest.fixture(scope="module")
def problem(tmp_path_factory) -> dict[str, Path]:
    """An SFT problem, preference data, an online problem and its broken variants, written once."""
    root = tmp_path_factory.mktemp("reliability")
    paths = write_sft_problem(root / "sft")
    online = write_online_problem(root / "online")
    paths.update({f"online_{k}": v for k, v in online.items()})
    rows = [{"prompt": p, "chosen": c, "rejected": "no ."} for p, c in PAIRS if c != "no ."]
    paths["pairs"] = root / "pairs.jsonl"
    paths["pairs"].write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    (root / "bad_rewards.py").write_text(BAD_REWARDS)
    paths["bad_rewards"] = root / "bad_rewards.py"
    tokenizer = tiny_tokenizer()
    nan_rm = tiny_llama("scalar", seed=1, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        nan_rm.score.weight.fill_(float("nan"))
    nan_rm.save_pretrained(root / "nan_reward")
    tokenizer.save_pretrained(root / "nan_reward")
    paths["nan_reward"] = root / "nan_reward"
    other = tiny_llama("scalar", seed=1, vocab_size=len(tokenizer) + 20, pad_token_id=tokenizer.pad_token_id)
    other.save_pretrained(root / "other_vocab")  # no tokenizer files
    paths["other_vocab"] = root / "other_vocab"
    return paths


def sft(problem, out: Path, *extra: str) -> list[str]:
    return sft_args(
        problem, out, "train.max_steps=3", "train.save_steps=1", "logging.progress_bar=false", *extra
    )


def reward(problem, out: Path, data: Path, *extra: str) -> list[str]:
    config = out.parent / f"{out.name}.yaml"
    config.write_text("seed: 0\n")
    return [
        "train",
        "reward",
        "--config",
        str(config),
        f"output_dir={out}",
        f"model.name_or_path={problem['model']}",
        f"data.train_file={data}",
        "train.batch_size=4",
        "train.max_steps=2",
        "data.max_prompt_length=8",
        "data.max_length=24",
        "logging.progress_bar=false",
        *extra,
    ]


def ppo(problem, out: Path, *extra: str, reward_fn: str | None = "cat_count") -> list[str]:
    paths = {k.removeprefix("online_"): v for k, v in problem.items() if k.startswith("online_")}
    args = online_cli_args(paths, out, "train.max_steps=2", "logging.progress_bar=false", *extra)
    if reward_fn is None:  # no reward function: a reward model only (given in extra)
        args = [a for a in args if not a.startswith("online.reward_functions=")]
    return args


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes (to show that nothing was damaged), but the lock file, which
    holds the PID of whichever process last held it."""
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


@dataclass
class Case:
    """One way to break a run: ``args(problem, tmp)`` -> argv (after ``setup``), the exit code, a regex the
    one message line must match, and ``check(problem, tmp, err)`` for what must (not) be on disk."""

    name: str
    args: Callable[[dict, Path], list[str]]
    code: int
    message: str
    setup: Callable[[dict, Path], Any] | None = None
    check: Callable[[dict, Path, str], None] | None = None


def _no_final(problem, tmp, err):
    assert not (tmp / "run" / "final").exists() and not (tmp / "run" / "summary.json").exists()


def _diverged_sft(problem, tmp, err):
    _no_final(problem, tmp, err)
    # the step-1 checkpoint (before the run diverged) is intact, and named as the resume point
    assert [p.name for p in complete_checkpoints(tmp / "run" / "checkpoints")] == ["step-1"]
    verify_checkpoint(tmp / "run" / "checkpoints" / "step-1")
    assert "step-1, is left as it is" in err


def _skipped(problem, tmp, err):
    rows = read_metrics(tmp / "run" / "metrics.jsonl")
    assert [r["guard/skipped_steps"] for r in rows] == [0, 1, 2]
    assert rows[1]["loss"] is None  # logged, as null
    assert (tmp / "run" / "final" / "model.safetensors").is_file()  # from step 1's (finite) weights


def _finished(problem, tmp):
    assert main(sft(problem, tmp / "run")) == 0
    return tree(tmp / "run")


def _finished_untouched(problem, tmp, err):
    before = json.loads((tmp / "before.json").read_text())
    after = {k: v.hex() for k, v in tree(tmp / "run").items()}
    assert after == before


def _finish_and_remember(problem, tmp):
    files = _finished(problem, tmp)
    (tmp / "before.json").write_text(json.dumps({k: v.hex() for k, v in files.items()}))


def _killed_before_final(problem, tmp):
    assert main(sft(problem, tmp / "run")) == 0
    shutil.rmtree(tmp / "run" / "final")
    (tmp / "run" / "summary.json").unlink()


def _completed(problem, tmp, err):
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    rows = read_metrics(tmp / "run" / "metrics.jsonl")
    assert summary["steps"] == 3 and summary["train_loss"] == pytest.approx(rows[-1]["loss"])
    assert (tmp / "run" / "final" / "model.safetensors").is_file()


def _corrupt_newest(problem, tmp):
    assert main(sft(problem, tmp / "run")) == 0
    flip_byte(tmp / "run" / "checkpoints" / "step-3" / "model.model.safetensors")


def _truncated_newest(problem, tmp):
    assert main(sft(problem, tmp / "run")) == 0
    f = tmp / "run" / "checkpoints" / "step-3" / "optimizer.model.safetensors"
    f.write_bytes(f.read_bytes()[:-7])


def _resumed_from_step2(problem, tmp, err):
    assert "resuming from the previous complete checkpoint" in err and "step-2" in err
    rows = read_metrics(tmp / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    verify_checkpoint(tmp / "run" / "checkpoints" / "step-4")


def _symlinked_final(problem, tmp):
    assert main(sft(problem, tmp / "run", "train.max_steps=2")) == 0
    victim = tmp / "victim"
    victim.mkdir()
    (victim / "config.json").write_text("precious")
    shutil.rmtree(tmp / "run" / "final")
    (tmp / "run" / "final").symlink_to(victim)


def _victim_untouched(problem, tmp, err):
    assert [p.name for p in (tmp / "victim").iterdir()] == ["config.json"]
    assert (tmp / "victim" / "config.json").read_text() == "precious"


def _huge_prompt(problem, tmp):
    write(tmp / "huge.jsonl", [{"prompt": "hello " * 2_000_000, "completion": "world ."}])


def _full_disk(problem, tmp):
    def no_space(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    return no_space


CASES = [
    Case(
        "sft learning rate 1e30: stops at the first non-finite step",
        lambda p, t: sft(p, t / "run", "train.learning_rate=1e30"),
        3,
        r"rlhfkit: stopped: step 2: non-finite loss, gradient norm; .*no final/",
        check=_diverged_sft,
    ),
    Case(
        "sft learning rate 1e30 with skip_nonfinite_steps: skipped and counted",
        lambda p, t: sft(p, t / "run", "train.learning_rate=1e30", "train.skip_nonfinite_steps=5"),
        0,
        r"rlhfkit: warning: step 3: non-finite loss, gradient norm; skipped .*2 of 5 used",
        check=_skipped,
    ),
    Case(
        "sft learning rate 1e30, one skip allowed: stops when it is used",
        lambda p, t: sft(p, t / "run", "train.learning_rate=1e30", "train.skip_nonfinite_steps=1"),
        3,
        r"step 3: non-finite loss.*all 1 skips of train.skip_nonfinite_steps are used",
        check=_no_final,
    ),
    Case(
        "preference row with a NaN margin",
        lambda p, t: reward(
            p,
            t / "run",
            write(t / "nan.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c", "margin": math_nan()}]),
        ),
        2,
        r"nan.jsonl, line 1, field 'margin': must be a finite number",
        check=_no_final,
    ),
    Case(
        "reward.margin=.nan",
        lambda p, t: reward(p, t / "run", p["pairs"], "reward.margin=.nan"),
        2,
        r"reward.margin .*: must be a finite number, got nan",
    ),
    Case(
        "chosen == rejected",
        lambda p, t: reward(
            p,
            t / "run",
            write(
                t / "same.jsonl",
                [
                    {"prompt": "a", "chosen": "b", "rejected": "c"},
                    {"prompt": "a", "chosen": "b", "rejected": "b"},
                ],
            ),
        ),
        2,
        r"same.jsonl, line 2, field 'rejected': is the same as chosen",
    ),
    Case(
        "online.kl_coef=.inf",
        lambda p, t: ppo(p, t / "run", "online.kl_coef=.inf"),
        2,
        r"online.kl_coef .*: must be a finite number, got inf",
    ),
    Case(
        "online.missing_eos_score=.nan",
        lambda p, t: ppo(p, t / "run", "online.missing_eos_score=.nan"),
        2,
        r"online.missing_eos_score .*: must be a finite number, got nan",
    ),
    Case(
        "a reward function's 1e300 (inf in float32)",
        lambda p, t: [
            *ppo(p, t / "run", reward_fn=None),
            f"online.reward_functions=[{p['bad_rewards']}:huge]",
        ],
        2,
        r"reward function 'huge' returned 1e\+300 .*at most 3.4e\+38",
    ),
    Case(
        "a reward function that raises",
        lambda p, t: [
            *ppo(p, t / "run", reward_fn=None),
            f"online.reward_functions=[{p['bad_rewards']}:raising]",
        ],
        2,
        r"rollout 1: reward function 'raising' raised ValueError: the grader is down",
    ),
    Case(
        "a reward model that returns NaN",
        lambda p, t: ppo(p, t / "run", f"online.reward_model={p['nan_reward']}", reward_fn=None),
        3,
        r"rollout 1: non-finite reward-model score",
        check=_no_final,
    ),
    Case(
        "diverging PPO (learning rate 1e30): stopped, no multinomial error",
        lambda p, t: ppo(
            p, t / "run", "train.learning_rate=1e30", "train.max_grad_norm=null", "train.max_steps=3"
        ),
        3,
        r"rollout [12]: non-finite ",
        check=_no_final,
    ),
    Case(
        "a reward model folder without tokenizer files and another vocabulary size",
        lambda p, t: ppo(p, t / "run", f"online.reward_model={p['other_vocab']}", reward_fn=None),
        2,
        r"online.reward_model: .*other_vocab has no tokenizer files and a vocabulary of 58 tokens",
    ),
    Case(
        "a 12 MB prompt line",
        lambda p, t: [*sft(p, t / "run"), f"data.train_file={t / 'huge.jsonl'}", "data.eval_file=null"],
        2,
        r"huge.jsonl, line 1, field 'prompt': is at least \d+ tokens, longer than max_prompt_length=16",
        setup=_huge_prompt,
    ),
    Case(
        "--resume of a finished run: summary and final/ left as they are",
        lambda p, t: [*sft(p, t / "run"), "--resume"],
        0,
        r"rlhfkit: .*run is a finished run \(step 3\); nothing to resume",
        setup=_finish_and_remember,
        check=_finished_untouched,
    ),
    Case(
        "--resume after a kill between the last checkpoint and final/",
        lambda p, t: [*sft(p, t / "run"), "--resume"],
        0,
        r"",
        setup=_killed_before_final,
        check=_completed,
    ),
    Case(
        "a flipped byte in the newest checkpoint",
        lambda p, t: [*sft(p, t / "run", "train.max_steps=4"), "--resume"],
        0,
        r"checkpoint .*step-3: corrupt: model.model.safetensors does not match its checksum in COMPLETE; not used",
        setup=_corrupt_newest,
        check=_resumed_from_step2,
    ),
    Case(
        "a truncated file in the newest checkpoint",
        lambda p, t: [*sft(p, t / "run", "train.max_steps=4"), "--resume"],
        0,
        r"checkpoint .*step-3: not a complete rlhfkit checkpoint \(a file listed in COMPLETE is missing or truncated\)",
        setup=_truncated_newest,
        check=_resumed_from_step2,
    ),
    Case(
        "a `final` symlink to another folder",
        lambda p, t: [*sft(p, t / "run"), "--resume"],
        2,
        r"run/final is a symbolic link \(to .*victim\); rlhfkit does not write through links",
        setup=_symlinked_final,
        check=_victim_untouched,
    ),
    Case(
        "generate --out into a missing folder",
        lambda p, t: [
            "generate",
            "--model",
            str(p["model"]),
            "--prompts",
            str(p["train"]),
            "--out",
            str(t / "no" / "x.jsonl"),
        ],
        2,
        r"--out .*no/x.jsonl: its folder .*no does not exist",
    ),
]


def math_nan() -> float:
    return float("nan")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reliability_case(case: Case, problem, tmp_path, capsys):
    if case.setup is not None:
        case.setup(problem, tmp_path)
    capsys.readouterr()
    code = main(case.args(problem, tmp_path))
    err = capsys.readouterr().err
    assert code == case.code, err
    assert "Traceback" not in err, err
    lines = [
        line for line in err.splitlines() if line.startswith("rlhfkit: ") and "rlhfkit: sft on" not in line
    ]
    if case.code != 0:  # exactly one line says why it stopped
        stops = [line for line in lines if line.startswith(("rlhfkit: error: ", "rlhfkit: stopped: "))]
        assert len(stops) == 1, err
    if case.message:
        assert any(re.search(case.message, line) for line in lines), err
    if case.check is not None:
        case.check(problem, tmp_path, err)


def test_a_full_disk_is_one_line(problem, tmp_path, capsys, monkeypatch):
    """ENOSPC while a checkpoint is written: one line, exit 1, and no half-written checkpoint left."""

    def no_space(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ckpt, "_fsync", no_space)
    assert main(sft(problem, tmp_path / "run")) == 1
    err = capsys.readouterr().err
    assert "rlhfkit: error: No space left on device while writing " in err and "Traceback" not in err
    assert complete_checkpoints(tmp_path / "run" / "checkpoints") == []


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: a save that fails at each file in turn leaves the previous checkpoint the resume point


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_save_that_fails_at_each_file_in_turn_resumes_from_the_previous_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    model, optimizer = _model_and_optimizer(0)
    save_checkpoint(root, 1, {"m": model}, {"m": optimizer}, trainer_state={"x": 1})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    writers = {"save_model": ckpt.save_model, "save_file": ckpt.save_file}
    real_write_text = Path.write_text
    failures = 0
    for fail_at in range(1, 50):
        calls = {"n": 0}

        def counted(real, calls=calls, fail_at=fail_at):
            def wrapper(*args, **kwargs):
                calls["n"] += 1
                if calls["n"] == fail_at:
                    raise OSError(errno.EIO, "injected write failure")
                return real(*args, **kwargs)

            return wrapper

        for name, real in writers.items():
            monkeypatch.setattr(ckpt, name, counted(real))
        monkeypatch.setattr(Path, "write_text", counted(real_write_text))
        try:
            save_checkpoint(root, 2, {"m": model}, {"m": optimizer}, trainer_state={"x": 2})
        except OSError:
            failures += 1
            monkeypatch.undo()
            assert resume_checkpoint(root).name == "step-1"  # the failed save left nothing usable
            fresh, fresh_opt = _model_and_optimizer(1)
            assert load_checkpoint(resume_checkpoint(root), {"m": fresh}, {"m": fresh_opt})["x"] == 1
            assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)
            continue
        monkeypatch.undo()
        break
    assert failures >= 6  # model, optimizer (json + tensors), scheduler-free rng and state files, marker
    assert resume_checkpoint(root).name == "step-2" and not list(root.glob(".tmp-*"))


def test_corrupt_checkpoint_contents_are_a_named_error_not_a_traceback(tmp_path):
    """A checkpoint whose marker predates checksums (sizes only) with a damaged JSON file of the same size."""
    model, optimizer = _model_and_optimizer(0)
    path = save_checkpoint(tmp_path, 1, {"m": model}, {"m": optimizer})
    marker = json.loads((path / MARKER).read_text())
    del marker["sha256"]
    (path / MARKER).write_text(json.dumps(marker))
    state = path / "trainer_state.json"
    state.write_text("{" + "x" * (state.stat().st_size - 1))
    with pytest.raises(CheckpointError, match=r"step-1: cannot be read \(JSONDecodeError"):
        load_checkpoint(path, {"m": model}, {"m": optimizer})


def test_checkpoints_and_final_are_never_written_from_non_finite_weights(tmp_path):
    from rlhfkit.errors import NonFiniteError
    from rlhfkit.models import save_hf_folder

    tokenizer = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.model.norm.weight[0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"step-1, model 'actor': not written.*model.norm.weight"):
        save_checkpoint(tmp_path / "checkpoints", 1, {"actor": model})
    assert not (tmp_path / "checkpoints" / "step-1").exists()
    with pytest.raises(NonFiniteError, match="final: not written"):
        save_hf_folder(model, tokenizer, tmp_path / "final")
    assert not (tmp_path / "final").exists()


# ----------------------------------------------------------------------------------------------------------
# Subprocesses: the lock, signals


def _env() -> dict[str, str]:
    env = {**os.environ, "RLHFKIT_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), os.getcwd()]))
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def test_a_second_writer_is_refused_naming_the_first_and_a_kill_releases_the_lock(problem, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(sft(problem, out, "train.max_steps=2")) == 0
    before = tree(out)
    from rlhfkit.engine import folder

    assert not folder.holds_lock(out)  # main() let go of it when the command ended
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from rlhfkit.engine.folder import lock_run_folder as l; l({str(out)!r}); print('held', flush=True); import time; time.sleep(60)",
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        assert main([*sft(problem, out, "train.max_steps=3"), "--resume"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another rlhfkit process (PID {holder.pid})" in err and "Traceback" not in err
        assert main([*sft(problem, out), "--overwrite"]) == 2
        assert tree(out) == before  # neither rewrote metrics.jsonl nor touched a checkpoint
    finally:
        holder.kill()
        holder.wait()
    assert main([*sft(problem, out, "train.max_steps=3"), "--resume"]) == 0  # the kill released it


def test_sigterm_during_a_step_finishes_it_checkpoints_it_and_exits_143(
    problem, tmp_path, capsys, monkeypatch
):
    """In-process: the signal arrives while step 2 is logged; step 3's check sees it, step 3 is checkpointed."""
    from rlhfkit.engine.metrics_writer import MetricsWriter

    real_log = MetricsWriter.log

    def log_then_signal(self, step, metrics):
        record = real_log(self, step, metrics)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return record

    monkeypatch.setattr(MetricsWriter, "log", log_then_signal)
    out = tmp_path / "run"
    assert main(sft(problem, out, "train.max_steps=10", "train.save_steps=100")) == 143
    err = capsys.readouterr().err
    assert "Traceback" not in err and "SIGTERM received: finishing the current step" in err
    assert "rlhfkit: stopped: SIGTERM received; stopped after step 3, which is checkpointed" in err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-3"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the command
    monkeypatch.undo()
    assert main([*sft(problem, out, "train.max_steps=4"), "--resume"]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_a_signal_finishes_the_step_checkpoints_it_and_exits_128_plus_the_signal(
    problem, tmp_path, capsys, sig
):
    """Ctrl-C on a real process: one line, no traceback, exit 130, the last step checkpointed. While it
    runs, a --resume of its folder is refused, naming its PID."""
    out = tmp_path / "run"
    args = sft(problem, out, "train.max_steps=100000", "train.save_steps=100000")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhfkit.cli", *args], env=_env(), stderr=subprocess.PIPE, text=True
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().count("\n") >= 2:
            break
        time.sleep(0.2)
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    refused = capsys.readouterr().err
    assert f"is in use by another rlhfkit process (PID {proc.pid})" in refused, refused
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and err.count("rlhfkit: stopped: ") == 1, err
    last = read_metrics(metrics)[-1]["step"]
    assert f"{signal.Signals(sig).name} received; stopped after step {last}, which is checkpointed" in err
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == [f"step-{last}"]


def test_a_second_signal_stops_at_once(monkeypatch):
    exits = []
    monkeypatch.setattr(signals.os, "_exit", exits.append)
    with signals.graceful_stop():
        signals._handler(signal.SIGTERM, None)
        assert signals.requested() == signal.SIGTERM and exits == []
        signals._handler(signal.SIGTERM, None)
        assert exits == [143]
    assert signals.requested() is None


def _worker_with_rank(parent: int, rank: str, timeout: float = 60) -> int:
    """The PID of the child of ``parent`` (torchrun) whose environment says RANK=``rank``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                status = (entry / "status").read_text()
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))
            if ppid == parent and f"RANK={rank}".encode() in environ:
                return int(entry.name)
        time.sleep(0.2)
    raise AssertionError(f"no worker with RANK={rank} under {parent}")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through /proc")
def test_under_two_processes_a_signal_to_one_stops_both_after_the_same_step(problem, tmp_path):
    """SIGTERM to rank 1 only: the guard's all-reduce carries the stop, both processes finish the same step,
    rank 0 checkpoints it, both exit 143 with the same line."""
    out = tmp_path / "run"
    args = sft(problem, out, "train.max_steps=100000", "train.save_steps=100000")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "rlhfkit.cli",
            *args,
        ],
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            if metrics.is_file() and metrics.read_text().count("\n") >= 2:
                break
            time.sleep(0.2)
        os.kill(_worker_with_rank(proc.pid, "1"), signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    last = read_metrics(out / "metrics.jsonl")[-1]["step"]
    stopped = [line for line in err.splitlines() if "rlhfkit: stopped: " in line]
    assert len(stopped) == 2, err  # one per process, the same step
    assert all(f"stopped after step {last}, which is checkpointed" in line for line in stopped), err
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == [f"step-{last}"]
    assert "exitcode  : 143" in err, err  # torchrun reports the first to end (its own report has a traceback)


def test_installed_versions_meet_the_security_floors_of_pyproject():
    """SECURITY.md's floors (torch >= 2.6 for CVE-2025-32434, transformers >= 5.3 for CVE-2026-4372) are in
    pyproject.toml, and what this environment runs satisfies them."""
    from importlib.metadata import version

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    requirements = pytest.importorskip("packaging.requirements")
    Requirement = requirements.Requirement

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    floors = {r.name: r for r in map(Requirement, project["dependencies"])}
    assert floors["torch"].specifier.contains("2.6.0") and not floors["torch"].specifier.contains("2.5.1")
    assert floors["transformers"].specifier.contains("5.3.0")
    assert not floors["transformers"].specifier.contains("5.2.9")
    for name in ("torch", "transformers"):
        installed = version(name).split("+")[0]
        assert floors[name].specifier.contains(installed, prereleases=True), (name, installed)


@pytest.mark.parametrize("truncation", ["error", "right"])
def test_a_huge_prompt_is_measured_on_a_bounded_prefix(monkeypatch, truncation):
    """No text longer than PREFIX_CHARS_PER_TOKEN * (max_prompt_length + 2) characters is tokenised for a
    prompt far over the limit, and "right" truncation gives what cutting the whole prompt's ids gives."""
    from rlhfkit.data import tokenize
    from rlhfkit.data.records import FieldError

    tokenizer = tiny_tokenizer()
    prompt = "the cat sat on a mat . " * 10_000  # 230 kB, 200 x the characters a 16-token check reads
    whole = tokenize._ids(tokenizer, prompt, special=True)
    longest = []
    real_ids = tokenize._ids
    monkeypatch.setattr(
        tokenize, "_ids", lambda tok, text, special: longest.append(len(text)) or real_ids(tok, text, special)
    )
    if truncation == "error":
        with pytest.raises(FieldError, match=r"is at least \d+ tokens, longer than max_prompt_length=16"):
            tokenize.encode_prompt(tokenizer, prompt, 16, truncation)
    else:
        assert tokenize.encode_prompt(tokenizer, prompt, 16, truncation) == whole[:16]
    assert max(longest) <= tokenize.PREFIX_CHARS_PER_TOKEN * 18
