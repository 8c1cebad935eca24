"""The PPO update's loss normaliser is the whole minibatch's, over every process: its value, asserted.

One process stands for several here: ``ctx.all_sum`` (the all-reduce of :func:`rlhfkit.engine.accel.all_sum`)
is replaced by one that adds what another process would (a known count), so a normaliser counted on this
process only shows as a wrong number, not only as a crash or a tolerance miss of a two-process run
(tests/distributed/test_data_parallel.py compares those).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhfkit.trainers.online import ppo_update as update_module
from tests.trainers.online.online_fixtures import make_context, online_config, write_online_problem
from tests.trainers.online.test_online import rollout_for_update

OTHER = 7.0  # what the other process holds of every minibatch: tokens (token-mean) or sequences (seq-mean)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_online_problem(tmp_path_factory.mktemp("normaliser"), reward_model=False)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_each_micro_batch_is_divided_by_the_whole_minibatchs_count_over_processes(
    paths, tmp_path, monkeypatch, mode
):
    cfg = online_config(
        paths,
        tmp_path / "run",
        f"online.loss_agg_mode={mode}",
        "online.ppo_epochs=2",
        "online.num_minibatches=1",
        "train.micro_batch_size=1",
        kind="grpo",
    )
    ctx = make_context(cfg)
    rollout = rollout_for_update(ctx)
    mask = rollout.mask.bool()
    local = float(mask.sum()) if mode == "token-mean" else float(mask.any(dim=-1).sum())
    assert local > 0
    ctx = dataclasses.replace(ctx, all_sum=lambda values: torch.as_tensor(values).detach().double() + OTHER)

    seen: list[tuple[float, int]] = []
    real = update_module.micro_batch_loss

    def spy(ctx_, mb, normalizer, *args, **kwargs):
        seen.append((normalizer, mb.mask.shape[0]))
        return real(ctx_, mb, normalizer, *args, **kwargs)

    monkeypatch.setattr(update_module, "micro_batch_loss", spy)
    update_module.ppo_update(ctx, rollout, step=1)
    rows = mask.shape[0]
    assert sum(n for _, n in seen) == 2 * rows  # every row, in one-row micro-batches, in both epochs
    assert {normalizer for normalizer, _ in seen} == {local + OTHER}
