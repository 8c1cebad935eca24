"""online.sampler=exact through the trainer's stage 1: a rollout's tokens are the same whatever
``online.rollout_batch_size`` and on one or two processes (torchrun, gloo), each row drawing from the stream of
its global prompt index and sample index (tests.distributed.sampler_worker); ``multinomial`` draws from
torch's generator, seeded per process, and differs between the two layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.sampler_worker import write_tokens
from tests.distributed.test_data_parallel import torchrun
from tests.trainers.online.online_fixtures import write_online_problem


def rows_of(out: Path) -> dict[tuple[int, int], list[int]]:
    """(prompt, sample) -> response tokens, over every process's file."""
    rows = {}
    for path in sorted(out.glob("tokens-*.json")):
        for row in json.loads(path.read_text()):
            rows[(row["prompt"], row["sample"])] = row["tokens"]
    return rows


def test_rollout_batch_size_does_not_change_the_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    write_online_problem(tmp_path / "data", reward_model=False)
    write_tokens(tmp_path / "data", tmp_path / "whole")
    write_tokens(tmp_path / "data", tmp_path / "pieces", "online.rollout_batch_size=5")
    whole = rows_of(tmp_path / "whole")
    assert len(whole) == 12 and sum(map(len, whole.values())) > 12 * 3
    assert rows_of(tmp_path / "pieces") == whole


@pytest.mark.slow
def test_one_and_two_processes_give_the_same_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    write_online_problem(tmp_path / "data", reward_model=False)
    for sampler in ("exact", "multinomial"):
        one, two = tmp_path / f"one-{sampler}", tmp_path / f"two-{sampler}"
        write_tokens(tmp_path / "data", one, f"online.sampler={sampler}")
        proc = torchrun(
            "-m",
            "tests.distributed.sampler_worker",
            str(tmp_path / "data"),
            str(two),
            f"online.sampler={sampler}",
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert len(list(two.glob("tokens-*.json"))) == 2
        same = rows_of(one) == rows_of(two)
        assert same == (sampler == "exact"), sampler
