"""Rollouts that overlap training (:mod:`rlhfkit.trainers.online.async_loop`), in one process: the synchronous
loop is unchanged with the keys at 0; the trainer keeps samples at most k versions old and takes the PPO ratio
against the log-probs they were drawn with. What a generator sends is built here by sampling from the actor
(the generator's own code, :func:`sample_rollout`), then the actor moves, as the trainer's would."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli import main
from rlhfkit.config import load_config
from rlhfkit.data import TokenLimits, prepare_examples
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.engine.transfer import weights_digest
from rlhfkit.models.sampling import processed_logits
from rlhfkit.trainers.online import async_loop, loop
from rlhfkit.trainers.online.async_loop import (
    AsyncTrainer,
    fresh_samples,
    generator_index,
    sampler_of,
    sampling_version,
)
from rlhfkit.trainers.online.collect import prompt_batch, sample_rollout, score_rollout, take_scores
from rlhfkit.trainers.online.context import StageClock
from rlhfkit.trainers.online.ppo_update import ppo_update
from rlhfkit.trainers.online.shaping import estimate_advantages, shape_rollout
from tests.trainers.online.online_fixtures import (
    make_context,
    online_cli_args,
    online_overrides,
    state,
    write_online_problem,
)


def test_staleness_zero_is_the_synchronous_loop_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path / "p")

    def untouched(*args, **kwargs):
        raise AssertionError("the synchronous loop reached the asynchronous one")

    for name in ("AsyncTrainer", "ProcessView", "generate_rollouts", "generator_index"):
        monkeypatch.setattr(loop, name, untouched)
    runs = {}
    for name, extra in [("plain", ()), ("zero", ("online.max_staleness=0", "online.generation_processes=0"))]:
        out = tmp_path / name
        assert main(online_cli_args(paths, out, "train.max_steps=2", *extra, kind="grpo")) == 0
        rows = read_metrics(out / "metrics.jsonl")
        runs[name] = (
            [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per"))} for r in rows],
            load_file(str(out / "final" / "model.safetensors")),
        )
    (plain_rows, plain_weights), (zero_rows, zero_weights) = runs["plain"], runs["zero"]
    assert len(plain_rows) == 2 and plain_rows == zero_rows
    assert not any(k.startswith("async/") for k in zero_rows[0])
    assert plain_weights.keys() == zero_weights.keys()
    assert all(torch.equal(plain_weights[k], zero_weights[k]) for k in plain_weights)


def test_the_schedule_samples_each_rollout_at_most_k_versions_behind():
    # k = 1, one generator: rollouts 1 and 2 from the starting weights, then s from version s - 2
    assert [sampling_version(s, 1) for s in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [sampling_version(s, 0) for s in range(1, 4)] == [0, 1, 2]  # k = 0 would be synchronous
    assert [sampler_of(s, 2) for s in range(1, 6)] == [0, 1, 0, 1, 0]
    for k in (1, 2, 3):  # trained after update s - 1: staleness s - 1 - version, at most k, k once it can be
        assert [s - 1 - sampling_version(s, k) for s in range(1, 8)] == [min(s - 1, k) for s in range(1, 8)]


def test_the_last_g_processes_generate():
    cfg = load_config(
        None,
        [
            "output_dir=o",
            "model.name_or_path=m",
            "data.train_file=d",
            "online.reward_model=r",
            "online.max_staleness=1",
            "online.generation_processes=2",
        ],
        "grpo",
    )
    launch = [SimpleNamespace(num_processes=3, process_index=i) for i in range(3)]
    assert [generator_index(cfg, a) for a in launch] == [None, 0, 1]


def test_fresh_samples_keeps_at_most_k_versions_old_and_counts_the_rest():
    versions = torch.tensor([5, 4, 3, 5, 2])
    keep, stats = fresh_samples(versions, version=5, k=1)
    assert keep.tolist() == [True, True, False, True, False]
    assert stats == {"async/staleness_mean": 1 / 3, "async/staleness_max": 1.0, "async/dropped": 2.0}
    keep, stats = fresh_samples(versions, version=5, k=3)
    assert keep.all() and stats["async/staleness_max"] == 3.0 and stats["async/dropped"] == 0.0
    _, stats = fresh_samples(torch.tensor([0, 0]), version=4, k=1)
    assert stats == {"async/staleness_mean": 0.0, "async/staleness_max": 0.0, "async/dropped": 2.0}


def _async_context(tmp_path, *extra, kind: str = "grpo"):
    """A ``kind`` (grpo) context of the async trainer (k = 1, one generator) with one epoch of one minibatch and
    the KL in the loss: the synchronous loop would take the old log-probs from the update's own forward there."""
    paths = write_online_problem(tmp_path)
    overrides = online_overrides(
        paths,
        tmp_path / "run",
        "online.max_staleness=1",
        "online.generation_processes=1",
        "online.ppo_epochs=1",
        "online.num_minibatches=1",
        "online.kl_in_loss=true",
        "train.micro_batch_size=8",
        *extra,
    )
    cfg = load_config(None, overrides, kind)
    ctx = make_context(cfg)
    examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))
    return ctx, examples


def _sent(ctx, examples, step: int, version: int) -> dict:
    """What the generator of rollout ``step`` sends, sampled from the actor as it stands (version ``version``)."""
    torch.manual_seed(0)
    rollout = sample_rollout(ctx, prompt_batch(ctx, examples, step), StageClock(), step)
    message = async_loop.rollout_message(rollout)  # the generator's own
    digest = weights_digest(ctx.roles.actor)
    return {
        **message,
        "step": step,
        "version": version,
        "idle_seconds": 0.5,
        "sample_seconds": 0.25,
        "digest": digest,
    }


def _move(model) -> None:
    """One update's worth of change to the trained weights (the trainer's next version)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))


def _trainer_stages(ctx, examples, step, message, monkeypatch):
    """Stage 1 of the async trainer (the message received), then scores, advantages and the update."""
    monkeypatch.setattr(async_loop, "recv_object", lambda src: message)
    trainer = AsyncTrainer(ctx)
    trainer.digests[message["version"]] = message["digest"]  # what the trainer sent as that version
    batch = prompt_batch(ctx, examples, step)
    rollout = trainer.collect(ctx, batch, StageClock(), step)
    take_scores(rollout, score_rollout(ctx, rollout, batch["records"]))
    shape_rollout(ctx, rollout, ctx.kl_ctl.value)
    rollout.advantages, rollout.returns = estimate_advantages(ctx, rollout)
    return trainer, rollout, ppo_update(ctx, rollout, step, train_actor=True)


def _logprobs_by_hand(actor, rollout, sampling) -> torch.Tensor:
    """(B, T) log pi(y_t) of the sampled tokens under the run's processing, one unpadded row at a time."""
    out = torch.zeros(rollout.mask.shape)
    with torch.no_grad():
        for i in range(rollout.batch_size):
            prompt = rollout.query_ids[i][rollout.query_mask[i].bool()]
            n = int(rollout.response_mask[i].sum())
            response = rollout.response_ids[i, :n]
            logits = actor(input_ids=torch.cat([prompt, response])[None]).logits
            logp = torch.log_softmax(processed_logits(logits, sampling)[0], -1)
            for t in range(n):
                out[i, t] = logp[len(prompt) + t - 1, response[t]]
    return out


def test_the_ratio_of_a_stale_sample_is_taken_against_the_behaviour_policy(tmp_path, monkeypatch):
    ctx, examples = _async_context(tmp_path)
    message = _sent(ctx, examples, step=2, version=0)  # drawn by version 0 ...
    behaviour = message["logprobs"].clone()
    _move(ctx.roles.actor)  # ... trained by version 1: one version stale, kept
    current = _logprobs_by_hand(ctx.roles.actor, message_rollout(message), ctx.sampling)
    trainer, rollout, update = _trainer_stages(ctx, examples, 2, message, monkeypatch)
    mask = rollout.mask
    assert mask.any() and trainer.metrics["async/dropped"] == 0
    assert trainer.metrics["async/staleness_max"] == 1.0 and trainer.metrics["async/staleness_mean"] == 1.0
    assert trainer.metrics["async/generator_idle_seconds"] == 0.5
    assert trainer.metrics["async/generation_seconds"] == 0.25  # the generator's own seconds, as sent
    torch.testing.assert_close(rollout.logprobs, behaviour * mask)  # the old log-probs are the sampler's
    # the first (only) minibatch's ratio is pi_current / pi_behaviour, by hand: not 1
    expected = float(((current - behaviour).abs() * mask).max())
    assert expected > 1e-3
    got = update.metrics()["ratio/first_minibatch_max_logprob_diff"]
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_a_sample_two_versions_old_is_dropped_and_trains_nothing(tmp_path, monkeypatch):
    ctx, examples = _async_context(tmp_path)
    message = _sent(ctx, examples, step=3, version=0)  # rollout 3 is trained by version 2: 2 > k = 1
    assert message["mask"].any()
    _move(ctx.roles.actor)
    before = state(ctx.roles.actor)
    trainer, rollout, _ = _trainer_stages(ctx, examples, 3, message, monkeypatch)
    assert not rollout.mask.any() and float(rollout.entropy.abs().sum()) == 0.0
    assert trainer.metrics["async/dropped"] == rollout.batch_size
    after = state(ctx.roles.actor)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_rollout_with_other_prompts_than_its_step_is_refused(tmp_path, monkeypatch):
    ctx, examples = _async_context(tmp_path, "data.shuffle=true")
    message = _sent(ctx, examples, step=2, version=0)
    monkeypatch.setattr(async_loop, "recv_object", lambda src: message)
    batch = prompt_batch(ctx, examples, 1)
    if torch.equal(batch["query_ids"], message["query_ids"]):
        pytest.skip("steps 1 and 2 drew the same prompts")
    with pytest.raises(RuntimeError, match="rollout 1: the generator sent rollout 2"):
        AsyncTrainer(ctx).collect(ctx, batch, StageClock(), 1)


def test_samples_drawn_with_weights_the_trainer_never_sent_are_an_error(tmp_path, monkeypatch):
    ctx, examples = _async_context(tmp_path)
    message = _sent(ctx, examples, step=2, version=0)
    monkeypatch.setattr(async_loop, "recv_object", lambda src: message)
    trainer = AsyncTrainer(ctx)
    trainer.digests[0] = message["digest"] + 1.0  # version 0 as sent differs from what sampled
    with pytest.raises(
        RuntimeError, match="rollout 2: the generator sampled with other weights than the trainer's version 0"
    ):
        trainer.collect(ctx, prompt_batch(ctx, examples, 2), StageClock(), 2)


class _SlowSender:
    """A :class:`~rlhfkit.engine.transfer.WeightSender` whose send takes 50 ms; records where it sent what."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []

    def send(self, tensors, version: int, dst: int) -> None:
        time.sleep(0.05)
        self.sent.append((version, dst))


def test_the_weight_transfer_seconds_are_the_trainers_time_in_publish_and_0_when_nothing_is_sent(tmp_path):
    ctx, _ = _async_context(tmp_path, "train.max_steps=4")
    trainer = AsyncTrainer(ctx)
    trainer.sender = _SlowSender()
    trainer.publish(2)  # version 2 samples rollout 2 + 1 + k = 4, on the one generator (process 1)
    assert trainer.sender.sent == [(2, 1)]
    assert 0.05 <= trainer.metrics["async/weight_transfer_seconds"] < 5
    trainer.publish(3)  # rollout 5 is past train.max_steps: nothing is sent, nothing is timed
    assert trainer.sender.sent == [(2, 1)] and trainer.metrics["async/weight_transfer_seconds"] == 0.0


def test_with_a_critic_the_trainer_reads_the_values_of_a_received_rollout(tmp_path, monkeypatch):
    """PPO with a critic: the generator sends no values (it holds no trained critic); the trainer's critic
    reads them when the rollout arrives, as the synchronous stage 1 would from the same critic."""
    ctx, examples = _async_context(tmp_path, kind="ppo")
    assert ctx.roles.critic is not None
    message = _sent(ctx, examples, step=2, version=0)
    assert "values" not in message
    batch = prompt_batch(ctx, examples, 2)
    torch.manual_seed(0)
    synchronous = sample_rollout(ctx, batch, StageClock(), 2)  # the same tokens, read in one process
    assert torch.equal(synchronous.response_ids, message["response_ids"])
    with torch.no_grad():  # the critic the trainer holds differs from the one the rollout started with
        for p in ctx.roles.critic.parameters():
            p.add_(0.01)
    monkeypatch.setattr(async_loop, "recv_object", lambda src: message)
    trainer = AsyncTrainer(ctx)
    trainer.digests[0] = message["digest"]
    rollout = trainer.collect(ctx, batch, StageClock(), 2)
    torch.manual_seed(0)
    now = sample_rollout(ctx, batch, StageClock(), 2)  # the synchronous stage 1 with the moved critic
    assert rollout.values is not None and rollout.mask.any()
    torch.testing.assert_close(rollout.values, now.values, rtol=0, atol=0)
    assert not torch.allclose(rollout.values, synchronous.values)  # the trainer's critic, now
    assert float(rollout.values[~rollout.mask].abs().sum()) == 0.0


def test_distillation_overlaps_with_the_teachers_log_probs_read_by_the_generator(tmp_path, monkeypatch):
    """`train distill`: the generator's teacher reads the sampled tokens as the reference does and the log-probs
    travel with the rollout; the trainer takes them (a stale sample's cleared with its mask)."""
    from tests.trainers.online.test_distill import distill_overrides, write_teacher

    paths = write_online_problem(tmp_path / "p")
    teacher = write_teacher(tmp_path, paths)
    extra = ("online.max_staleness=1", "online.generation_processes=1")
    cfg = load_config(None, distill_overrides(paths, tmp_path / "run", teacher, *extra), "distill")
    ctx = make_context(cfg)
    examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))
    assert ctx.roles.teacher is not None
    message = _sent(ctx, examples, step=2, version=0)
    batch = prompt_batch(ctx, examples, 2)
    torch.manual_seed(0)
    synchronous = sample_rollout(ctx, batch, StageClock(), 2)  # the same tokens, read in one process
    assert torch.equal(message["teacher_logprobs"], synchronous.teacher_logprobs)
    for step, kept in ((2, True), (3, False)):  # rollout 3 is trained by version 2: 2 versions stale
        message = _sent(ctx, examples, step=step, version=0)
        monkeypatch.setattr(async_loop, "recv_object", lambda src, message=message: message)
        trainer = AsyncTrainer(ctx)
        trainer.digests[0] = message["digest"]
        rollout = trainer.collect(ctx, prompt_batch(ctx, examples, step), StageClock(), step)
        expected = message["teacher_logprobs"] * rollout.mask
        assert bool(rollout.mask.any()) == kept
        torch.testing.assert_close(rollout.teacher_logprobs, expected, rtol=0, atol=0)
        assert kept or float(rollout.teacher_logprobs.abs().sum()) == 0.0


def message_rollout(message):
    """The message as a rollout (for reading it by hand)."""
    return async_loop.received_rollout(message, torch.zeros(message["mask"].shape[0]), "cpu")
