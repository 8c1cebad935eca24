"""Resume: a PPO run killed with SIGKILL after its N/2 checkpoint and resumed ends bit-identical to an
uninterrupted run (weights, optimizers, metrics), also with a half-written checkpoint left behind."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli import main
from rlhfkit.engine.checkpoint import checkpoint_step, latest_checkpoint
from rlhfkit.engine.metrics_writer import read_metrics
from tests.trainers.online.online_fixtures import online_cli_args, write_online_problem


def _same_files(a, b, names):
    for name in names:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert x.keys() == y.keys(), name
        for key in x:
            assert torch.equal(x[key], y[key]), f"{name}: {key}"


@pytest.mark.slow
def test_killed_then_resumed_run_is_bit_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path)
    # Adaptive KL, a decaying learning rate and a critic warm-up: every piece of state must come back.
    extra = (
        "train.max_steps=6",
        "train.save_steps=3",
        f"online.reward_model={paths['reward']}",
        "online.kl_target=0.5",
        "online.kl_horizon=50",
        "train.lr_schedule=linear",
        "online.critic_warmup_steps=1",
    )
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(online_cli_args(paths, full, *extra, reward="slow_cat_count")) == 0

    args = online_cli_args(paths, part, *extra, reward="slow_cat_count")
    env = {
        **os.environ,
        "RLHFKIT_NUM_THREADS": "1",  # the source under test first, as in this process
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), os.getcwd()) if p),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhfkit.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 180
    while (
        latest_checkpoint(part / "checkpoints") is None
        and proc.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    assert checkpoint_step(latest_checkpoint(part / "checkpoints")) == 3 and not (part / "final").exists()

    # What a kill while writing the next checkpoint leaves: a temporary folder, and (worse) a step folder
    # whose files are cut short and whose marker is missing. Neither may be resumed from.
    ckpt = part / "checkpoints"
    shutil.copytree(ckpt / "step-3", ckpt / "step-4")
    (ckpt / "step-4" / "COMPLETE").unlink()
    with open(ckpt / "step-4" / "model.actor.safetensors", "r+b") as f:
        f.truncate(100)
    (ckpt / ".tmp-step-5").mkdir()
    (ckpt / ".tmp-step-5" / "model.actor.safetensors").write_bytes(b"partial")

    assert main([*args, "--resume"]) == 0
    _same_files(full / "final", part / "final", ["model.safetensors"])
    _same_files(full / "final_critic", part / "final_critic", ["model.safetensors"])
    _same_files(
        full / "checkpoints" / "step-6",
        part / "checkpoints" / "step-6",
        [
            "model.actor.safetensors",
            "model.critic.safetensors",
            "optimizer.actor.safetensors",
            "optimizer.critic.safetensors",
        ],
    )

    def timeless(rows):
        return [
            {k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_second"}
            for r in rows
        ]

    rows_full, rows_part = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in rows_full] == [1, 2, 3, 4, 5, 6]
    assert timeless(rows_full) == timeless(rows_part)
    assert len({r["kl_coef"] for r in rows_full}) > 1  # the adaptive controller moved (and was restored)
