"""The forwards' layout (rlhfkit.trainers.online.layout): length-sorted micro-batches inside unchanged
minibatches, shared by stage 1 and the update's first epoch, so that the first PPO ratio is exactly 1 in bf16
as in fp32."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.trainers.online import OnlineHooks, collect, train
from rlhfkit.trainers.online.context import model_inputs
from rlhfkit.trainers.online.layout import (
    local_minibatches,
    micro_batches,
    old_logprobs_from_update,
    row_lengths,
)
from rlhfkit.trainers.online.ppo_update import ppo_update
from tests.trainers.online.online_fixtures import make_context, online_config, write_online_problem
from tests.trainers.online.test_online import _ragged_generation, rollout_for_update


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_micro_batches_sort_each_minibatch_by_length_and_keep_its_rows(tmp_path, kind):
    """PPO (GAE) sorts rows; the group estimators sort whole groups, by their longest row, and keep a
    group's rows next to each other (a micro-batch reads their prompt once)."""
    paths = write_online_problem(tmp_path, reward_model=False)
    cfg = online_config(
        paths,
        tmp_path / "run",
        "train.batch_size=8",
        "train.micro_batch_size=3",
        "online.num_minibatches=2",
        kind=kind,
    )
    ctx = make_context(cfg)  # 8 prompts x 2 = 16 rows, minibatches of 8, micro-batches of 3, 3, 2
    lengths = torch.randint(1, 40, (16,), generator=torch.Generator().manual_seed(0))
    for epoch in (0, 1):
        layout = micro_batches(ctx, 3, epoch, lengths)
        for micros, rows in zip(layout, local_minibatches(ctx, 3, epoch), strict=True):
            assert [len(m) for m in micros] == [3, 3, 2]
            joined = torch.cat(micros)
            assert sorted(joined.tolist()) == sorted(rows.tolist())  # the same rows: the same normaliser
            if kind == "ppo":
                assert (lengths[joined].diff() >= 0).all()  # sorted, so each micro-batch trims its padding
                continue
            g = ctx.cfg.online.group_size
            assert g == 2
            longest = lengths.view(-1, g).amax(1)  # a group sorts by its longest row
            assert (longest[joined // g].diff() >= 0).all()
            assert (joined.view(-1, g) // g == (joined.view(-1, g) // g)[:, :1]).all()  # groups together


def test_without_groups_rows_sort_by_their_own_length(tmp_path):
    paths = write_online_problem(tmp_path, reward_model=False)
    cfg = online_config(
        paths,
        tmp_path / "run",
        "train.batch_size=8",
        "online.group_size=1",
        "train.micro_batch_size=3",
        "online.num_minibatches=1",
    )
    ctx = make_context(cfg)
    lengths = torch.randint(1, 40, (8,), generator=torch.Generator().manual_seed(0))
    (micros,) = micro_batches(ctx, 3, 0, lengths)
    joined = torch.cat(micros)
    assert sorted(joined.tolist()) == list(range(8))
    assert (lengths[joined].diff() >= 0).all()


def test_a_process_without_rows_of_a_minibatch_gets_no_micro_batch(tmp_path):
    """A process may hold no row of a minibatch (ppo_update then runs a zero-weighted pass): its layout
    must be an empty list, not one empty micro-batch (torch splits an empty tensor into one empty piece)."""
    paths = write_online_problem(tmp_path, reward_model=False)
    ctx = make_context(online_config(paths, tmp_path / "run", "online.num_minibatches=2"))
    monkey = dataclasses.replace(ctx, accelerator=_Rank(ctx.accelerator, 0, 4))  # 8 rows: 2 of 8 here
    layouts = [micro_batches(monkey, step, 0, torch.arange(2)) for step in range(1, 9)]
    assert any(micros == [] for layout in layouts for micros in layout)
    assert all(all(len(m) for m in micros) for layout in layouts for micros in layout)


class _Rank:
    """An accelerator that says it is process ``index`` of ``count``."""

    def __init__(self, accelerator, index, count):
        self._inner, self.process_index, self.num_processes = accelerator, index, count

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_length_sorting_removes_padding_columns(tmp_path, monkeypatch):
    """Eight responses of 1, 6, 3 and 1 tokens (twice) in micro-batches of 2: sorted, the four short ones take
    two micro-batches one column wide; in the shuffled order, short and long ones would share micro-batches.
    (Without groups: a group sorts by its longest row, test_micro_batches_sort_each_minibatch_by_length...)"""
    paths = write_online_problem(tmp_path, reward_model=False)
    cfg = online_config(
        paths,
        tmp_path / "run",
        "online.num_minibatches=1",
        "train.micro_batch_size=2",
        "online.group_size=1",
        "train.batch_size=8",
    )
    ctx = make_context(cfg)
    monkeypatch.setattr(collect, "generate_responses", _ragged_generation(ctx.tokenizer, [1, 6, 3, 1]))
    rollout = rollout_for_update(ctx)
    widths = []
    for rows in micro_batches(ctx, 1, 0, rollout.response_mask.sum(1))[0]:
        mb = rollout.select(rows)
        widths.append(model_inputs(mb.query_ids, mb.query_mask, mb.response_ids, mb.response_mask)[3])
    assert widths == [1, 1, 3, 6]


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_stage_one_reads_the_rows_of_the_updates_first_epoch_micro_batches(tmp_path, monkeypatch, kind):
    """The actor's forwards of stage 1 get exactly the inputs of the update's first-epoch forwards: the same
    rows, in the same micro-batches and order, cut to the same columns. (The first ratio being 1 cannot show
    another order in float32 on this CPU: the read-out's rounding happens not to depend on it.)"""
    import rlhfkit.trainers.online.ppo_update as update_module

    paths = write_online_problem(tmp_path, reward_model=False)
    cfg = online_config(paths, tmp_path / "run", "train.learning_rate=0", kind=kind, reward="words")
    ctx = make_context(cfg)  # 8 responses, 2 minibatches of 4 per epoch, micro-batches of 2, 2 epochs
    monkeypatch.setattr(collect, "generate_responses", _ragged_generation(ctx.tokenizer, [1, 6, 3, 0, 2]))
    reads = []

    def recording(module):
        real = module.response_readout

        def readout(model, ids, attn, start, *args, **kwargs):
            if model is not ctx.roles.reference:  # the actor's (stage 1: unwrapped; update: as trained)
                reads.append((ids.clone(), attn.clone(), start))
            return real(model, ids, attn, start, *args, **kwargs)

        monkeypatch.setattr(module, "response_readout", readout)

    recording(collect)
    recording(update_module)
    rollout = rollout_for_update(ctx)
    stage_one, reads[:] = list(reads), []
    ppo_update(ctx, rollout, step=1)
    first_epoch = reads[: len(stage_one)]
    assert len(stage_one) == 4 and len(reads) == 2 * len(stage_one)  # 4 micro-batches an epoch
    for (ids, attn, start), (ids_u, attn_u, start_u) in zip(stage_one, first_epoch, strict=True):
        assert torch.equal(ids, ids_u) and torch.equal(attn, attn_u) and start == start_u
    # the layout tested is neither the rollout's plain chunks nor the second epoch's (either would differ)
    lengths = row_lengths(rollout.query_mask, rollout.response_mask)
    layouts = [[r.tolist() for micros in micro_batches(ctx, 1, e, lengths) for r in micros] for e in (0, 1)]
    assert layouts[0] != [[0, 1], [2, 3], [4, 5], [6, 7]] and layouts[0] != layouts[1]


@pytest.mark.parametrize(
    "dtype, kind, lora",
    [
        ("bfloat16", "ppo", False),
        ("bfloat16", "grpo", False),
        ("bfloat16", "ppo", True),
        ("float32", "ppo", False),
        ("float32", "grpo", False),
    ],
)
def test_first_ratio_is_exactly_one_before_any_update(tmp_path, monkeypatch, dtype, kind, lora):
    """At learning rate 0 the first minibatch's log-probs equal the old ones bit for bit: stage 1 runs the
    update's first-epoch micro-batches (ragged lengths, micro-batches of 2 of minibatches of 4, not the
    rollout's chunks) with the same attention kernel with and without grad."""
    paths = write_online_problem(tmp_path, reward_model=False)
    extra = ["model.lora_rank=4"] if lora else []
    cfg = online_config(
        paths,
        tmp_path / "run",
        f"model.dtype={dtype}",
        "train.learning_rate=0",
        "online.ppo_epochs=1",
        "online.num_minibatches=1",
        *extra,
        kind=kind,
        reward="words",
    )
    ctx = make_context(cfg)
    monkeypatch.setattr(collect, "generate_responses", _ragged_generation(ctx.tokenizer, [1, 6, 3, 0]))
    result = ppo_update(ctx, rollout_for_update(ctx), step=1)
    assert result.first_minibatch_logprob_diff == [0.0]
    assert result.metrics()["ratio/first_minibatch_max_logprob_diff"] == 0.0


def test_the_update_forward_gives_the_old_logprobs_of_a_one_epoch_run(tmp_path, monkeypatch):
    """One epoch of one minibatch with the KL in the loss: the update's own forward gives the old log-probs,
    detached (online.old_logprobs_from_update), so the actor's no-grad forward of stage 1 is gone; the run is
    the one with that forward, bit for bit (the first ratio is exactly 1 either way): weights, losses, KL,
    entropy."""
    paths = write_online_problem(tmp_path, reward_model=False)
    calls = []
    real = collect.response_readout

    def counted(model, *args, **kwargs):
        calls.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(collect, "response_readout", counted)
    runs = {}
    for fused in (True, False):
        out = tmp_path / f"run-{fused}"
        cfg = online_config(
            paths,
            out,
            "train.max_steps=2",
            "online.ppo_epochs=1",
            "online.num_minibatches=1",
            "online.kl_in_loss=true",
            "online.kl_coef=0.1",
            "online.ent_coef=0.01",
            f"online.old_logprobs_from_update={str(fused).lower()}",
            kind="grpo",
        )
        calls.clear()
        train(cfg, hooks=OnlineHooks(evaluate_at_start=False))
        rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss/policy" in r]
        runs[fused] = len(calls), rows, load_file(out / "final" / "model.safetensors")
    (fused_calls, fused_rows, fused_weights), (plain_calls, plain_rows, plain_weights) = (
        runs[True],
        runs[False],
    )
    assert plain_calls == 2 * fused_calls > 0  # actor and reference, against the reference alone
    keys = ("loss/policy", "loss/kl", "loss/entropy", "kl/mean", "entropy/mean", "approx_kl", "score/mean")
    assert len(fused_rows) == len(plain_rows) == 2
    for a, b in zip(fused_rows, plain_rows, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert (
            a["ratio/first_minibatch_max_logprob_diff"] == b["ratio/first_minibatch_max_logprob_diff"] == 0.0
        )
        assert a["entropy/mean"] > 0
    assert fused_rows[0]["kl/mean"] == 0 != fused_rows[1]["kl/mean"]  # the actor has moved from the reference
    assert fused_weights.keys() == plain_weights.keys()
    assert all(torch.equal(fused_weights[k], plain_weights[k]) for k in fused_weights)


def test_the_entropy_bonus_moves_the_weights_and_the_entropy_metric_does_not(tmp_path):
    """Without an entropy bonus the update reads the entropies as values only (no graph, no backward
    recompute); with one they carry its gradient. One rollout each: the same entropies are read, and only the
    bonus changes the weights."""
    paths = write_online_problem(tmp_path, reward_model=False)
    runs = {}
    for coef in ("0", "0.5"):
        out = tmp_path / f"run-{coef}"
        cfg = online_config(
            paths, out, "train.max_steps=1", "online.ppo_epochs=1", f"online.ent_coef={coef}", kind="grpo"
        )
        train(cfg, hooks=OnlineHooks(evaluate_at_start=False))
        row = next(r for r in read_metrics(out / "metrics.jsonl") if "loss/policy" in r)
        runs[coef] = row, load_file(out / "final" / "model.safetensors")
    (row0, weights0), (row5, weights5) = runs["0"], runs["0.5"]
    assert row0["entropy/mean"] == row5["entropy/mean"] > 0 and "loss/entropy" in row5
    assert any(not torch.equal(weights0[k], weights5[k]) for k in weights0)


@pytest.mark.parametrize(
    "extra, step, expected",
    [
        ((), 1, True),
        (("online.ppo_epochs=2",), 1, False),
        (("online.num_minibatches=2",), 1, False),
        (("online.kl_in_loss=false",), 1, False),  # -kl_coef * kl_t in the reward needs them first
        (("online.kl_in_loss=false", "online.kl_coef=0"), 1, True),
        (("online.kl_in_loss=false", "online.kl_coef=0", "online.kl_target=6"), 1, False),
        (("online.critic_warmup_steps=2",), 2, False),  # ppo: the actor is not trained yet
        (("online.critic_warmup_steps=2",), 3, True),
        (("online.old_logprobs_from_update=false",), 1, False),
    ],
)
def test_old_logprobs_come_from_the_update_only_where_nothing_reads_them_first(
    tmp_path, extra, step, expected
):
    paths = write_online_problem(tmp_path, reward_model=False)
    one_epoch = ("online.ppo_epochs=1", "online.num_minibatches=1", "online.kl_in_loss=true")
    kind = "ppo" if any("warmup" in e for e in extra) else "grpo"
    ctx = make_context(online_config(paths, tmp_path / "run", *one_epoch, *extra, kind=kind))
    assert old_logprobs_from_update(ctx, step) is expected
