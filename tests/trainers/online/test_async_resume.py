"""Resuming rollouts that overlap training (:class:`rlhfkit.trainers.online.async_loop.AsyncTrainer`): a
checkpoint keeps the weight versions the next rollouts are sampled with, and a resumed trainer sends each
generator exactly the versions the uninterrupted run would have, so every rollout is sampled with the same
weights; end to end under torchrun, a run whose generator is killed resumes to the uninterrupted run's metrics
and weights, bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.errors import ConfigError
from rlhfkit.trainers.online import async_loop
from rlhfkit.trainers.online.async_loop import AsyncTrainer, first_rollout, sampler_of, sampling_version
from tests.trainers.online.online_fixtures import online_cli_args, write_online_problem


def test_first_rollout_is_the_generators_first_after_the_checkpoint():
    assert [first_rollout(j, 0, 3) for j in range(3)] == [1, 2, 3]
    assert [first_rollout(j, 4, 3) for j in range(3)] == [7, 5, 6]  # 5 -> generator 1, 6 -> 2, 7 -> 0
    for g in (1, 2, 3):
        for resumed in range(6):
            for j in range(g):
                s = first_rollout(j, resumed, g)
                assert s > resumed and sampler_of(s, g) == j and s - g <= resumed


class Protocol:
    """An :class:`AsyncTrainer` over a one-weight model whose value is its version, with the sends recorded
    per generator instead of made."""

    def __init__(self, k: int, g: int, steps: int, monkeypatch) -> None:
        self.model = torch.nn.Linear(1, 1, bias=False)
        online = SimpleNamespace(max_staleness=k, generation_processes=g)
        self.ctx = SimpleNamespace(
            cfg=SimpleNamespace(online=online, train=SimpleNamespace(max_steps=steps)),
            roles=SimpleNamespace(actor=self.model),
        )
        self.messages: dict[int, list[tuple[int, float]]] = {j: [] for j in range(g)}

        def record(sender, tensors, version, dst):
            self.messages[dst - 1].append((version, float(tensors[0])))

        monkeypatch.setattr(async_loop.WeightSender, "send", record)
        self.trainer = AsyncTrainer(self.ctx)

    def at(self, version: int) -> None:
        with torch.no_grad():
            self.model.weight.fill_(float(version))

    def train(self, first: int, last: int) -> None:
        """Updates ``first .. last``: each leaves the weights of its version and publishes them."""
        for step in range(first, last + 1):
            self.at(step)
            self.trainer.publish(step)


def sampled_with(messages: list[tuple[int, float]], rollouts: range, k: int) -> dict[int, tuple[int, float]]:
    """What a generator that receives ``messages`` samples each rollout with, as ``generate_rollouts`` does
    (the first message at once, then more while its version is older than the rollout's); every message must
    be read by the end (one left over would be read in place of a later one)."""
    pending = iter(messages)
    version, value = next(pending)
    used = {}
    for s in rollouts:
        while version < sampling_version(s, k):
            version, value = next(pending)
        used[s] = (version, value)
    assert next(pending, None) is None, "a weight message no rollout reads"
    return used


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("g", [1, 2, 3])
def test_a_resumed_trainer_sends_each_generator_the_uninterrupted_runs_weights(k, g, monkeypatch):
    steps = 7
    for resumed in range(steps + 1):
        before = Protocol(k, g, steps, monkeypatch)
        before.at(0)
        before.trainer.start()
        before.train(1, resumed)
        assert len(before.trainer.kept) <= k + 1  # versions no checkpoint needs are let go
        state = before.trainer.checkpoint_state(resumed)
        assert sorted(int(v) for v in state["async_versions"]) == before.trainer.needed(resumed)

        after = Protocol(k, g, steps, monkeypatch)  # fresh processes: the generators hold nothing
        after.at(resumed)  # the actor as the checkpoint restores it
        after.trainer.start(resumed, state)
        after.train(resumed + 1, steps)
        for j in range(g):
            rollouts = range(first_rollout(j, resumed, g), steps + 1, g)
            used = sampled_with(after.messages[j], rollouts, k)
            expected = {s: (sampling_version(s, k), float(sampling_version(s, k))) for s in rollouts}
            assert used == expected, (k, g, resumed, j)
        # the versions the generators are told of are the ones whose digest the trainer checks
        sent = {v for msgs in after.messages.values() for v, _ in msgs}
        assert sent <= set(after.trainer.digests)


def test_a_checkpoint_without_the_needed_versions_is_a_named_error(monkeypatch):
    protocol = Protocol(1, 1, 6, monkeypatch)
    protocol.at(3)
    with pytest.raises(ConfigError, match=r"checkpoint of rollout 3 holds no weights of version\(s\) 2"):
        protocol.trainer.start(3, {"step": 3})  # a synchronous run's checkpoint, or another max_staleness


def test_versions_of_another_shape_are_a_named_error(monkeypatch):
    protocol = Protocol(1, 1, 6, monkeypatch)
    protocol.at(3)
    with pytest.raises(ConfigError, match="version 2 are not the shape"):
        protocol.trainer.start(3, {"async_versions": {"2": [torch.zeros(2, 2)]}})


ASYNC = (
    "online.max_staleness=1",
    "online.generation_processes=1",
    "model.lora_rank=4",
    "model.lora_alpha=8",
    "train.save_steps=2",
    "train.max_steps=5",
)


def _run_rows(out) -> list[dict]:
    """The logged rows without wall times (which no two runs share)."""
    skip = ("time/", "tokens_per", "async/trainer_idle", "async/generator_idle", "async/weight_transfer")
    skip += ("async/generation_seconds",)
    return [
        {k: v for k, v in r.items() if not k.startswith(skip)} for r in read_metrics(out / "metrics.jsonl")
    ]


@pytest.mark.long  # three torchrun launches, a minute or more: CI's long step
def test_a_run_whose_generator_is_killed_resumes_to_the_uninterrupted_run(tmp_path):
    from tests.trainers.online.test_async_launch import launch

    problem = write_online_problem(tmp_path / "problem")
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    code, err, _ = launch("none", online_cli_args(problem, whole, *ASYNC, kind="grpo"))
    assert code == 0, err[-4000:]
    code, err, _ = launch("generator", online_cli_args(problem, broken, *ASYNC, kind="grpo"), at=5)
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("rlhfkit: stopped:")]
    assert len(lines) == 1, err[-4000:]
    assert not (broken / "final").exists() and any((broken / "checkpoints").glob("step-*"))
    code, err, _ = launch("none", [*online_cli_args(problem, broken, *ASYNC, kind="grpo"), "--resume"])
    assert code == 0, err[-4000:]
    assert _run_rows(broken) == _run_rows(whole)
    files = sorted(p.name for p in (whole / "final").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (broken / "final").glob("*.safetensors"))
    for name in files:
        a, b = (load_file(str(out / "final" / name)) for out in (whole, broken))
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
