"""Online RL trainer (PPO / GRPO / RLOO / REINFORCE++): the rollout to the token, the ratio before the first
update, missing-EOS masking, critic-free runs, hooks, micro-batch invariance, and a learning signal."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.algos import shape_rewards
from rlhfkit.cli import main
from rlhfkit.data import TokenLimits, prepare_examples
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.errors import ConfigError
from rlhfkit.rollout import truncate_at_stop
from rlhfkit.rollout.generation import Responses
from rlhfkit.trainers import online
from rlhfkit.trainers.online import OnlineHooks, collect
from rlhfkit.trainers.online.collect import prompt_batch, sample_rollout, score_rollout
from rlhfkit.trainers.online.context import stop_token_ids
from rlhfkit.trainers.online.ppo_update import ppo_update
from rlhfkit.trainers.online.shaping import estimate_advantages
from tests.trainers.online.online_fixtures import (
    make_context,
    online_cli_args,
    online_config,
    state,
    write_online_problem,
)


def rollout_for_update(ctx, step=1):
    """Stages 1-4 of rollout ``step``, as the loop runs them, with the actor's old log-probs read in stage 1
    (also where the update's own forward would give them: the tests read them before any update)."""
    examples = prepare_examples(ctx.cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))
    batch = prompt_batch(ctx, examples, step)
    rollout = sample_rollout(ctx, batch, step=step, actor_forward=True)
    rollout.scores, *_ = score_rollout(ctx, rollout, batch["records"])
    rollout.rewards, rollout.kl = shape_rewards(
        rollout.scores,
        rollout.logprobs,
        rollout.ref_logprobs,
        rollout.mask,
        ctx.kl_ctl.value,
        ctx.cfg.online.kl_estimator,
    )
    rollout.advantages, rollout.returns = estimate_advantages(ctx, rollout)
    return rollout


# ---------------------------------------------------------------------------------------------------------
# The rollout, to the token


def _hand_built_generation(tok, raw_rows):
    """A stand-in for generate_responses that 'samples' ``raw_rows`` (junk after the first EOS included)."""

    def fake(model, prompt_ids, prompt_mask, *, stop_token_ids, pad_token_id, **_):
        raw = torch.tensor(raw_rows)
        response_ids, mask, ended = truncate_at_stop(raw, stop_token_ids, pad_token_id)
        return Responses(
            torch.cat([prompt_ids, response_ids], 1),
            torch.cat([prompt_mask, mask.long()], 1),
            response_ids,
            mask,
            ended,
            prompt_ids.shape[1],
        )

    return fake


@pytest.mark.parametrize("pad", ["<pad>", "eos"])
def test_hand_built_rollout_puts_score_on_last_real_token_and_rewards_sum_to_score_minus_kl(
    tmp_path, monkeypatch, pad
):
    paths = write_online_problem(tmp_path, pad=pad, reward_model=False)
    kl_coef = 0.3
    cfg = online_config(
        paths,
        tmp_path / "run",
        f"online.kl_coef={kl_coef}",
        "online.missing_eos_score=-7",
        "online.temperature=0.7",
        reward="words",
    )
    ctx = make_context(cfg)
    tok = ctx.tokenizer
    eos = tok.eos_token_id
    assert (tok.pad_token_id == eos) == (pad == "eos")
    w = tok.convert_tokens_to_ids
    with torch.no_grad():  # a reference that differs from the actor, so that the KL is not 0
        for p in ctx.roles.reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompts = [[1, w("hello")], [1, w("the"), w("cat"), w("sat"), w("on")], [1, w("one"), w("two")]]
    raw = [
        [w("cat"), w("sat"), eos, w("dog"), eos, w("ran")],  # EOS at 2, junk after it
        [w("on"), w("a"), w("mat"), w("good"), w("bad"), w("yes")],  # no EOS: truncated
        [eos, w("hello"), w("world"), eos, eos, eos],
    ]  # EOS first
    monkeypatch.setattr(collect, "generate_responses", _hand_built_generation(tok, raw))
    width = max(map(len, prompts))
    query_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    query_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    records = [{"prompt": tok.decode(p[1:])} for p in prompts]
    batch = {
        "query_ids": query_ids,
        "query_mask": query_mask,
        "records": records,
        "group_ids": torch.arange(3),
    }

    rollout = sample_rollout(ctx, batch)
    lengths = [3, 6, 1]
    expected_mask = torch.tensor([[c < n for c in range(6)] for n in lengths])
    assert torch.equal(rollout.mask, expected_mask) and torch.equal(rollout.response_mask, expected_mask)
    assert rollout.ended.tolist() == [True, False, True]
    assert rollout.response_ids[0, 2] == eos and rollout.response_ids[2, 0] == eos  # EOS inside the mask
    # Log-probs at the sampling temperature, equal to the unpadded sequence's, read before each token, of the
    # distribution that was sampled: a pad distinct from EOS is suppressed there, so in the softmax too.
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        ids = torch.tensor([p + raw[i][:n]])
        with torch.no_grad():
            logits = ctx.roles.actor(ids).logits[0] / 0.7
        if tok.pad_token_id != eos:
            logits[:, tok.pad_token_id] = float("-inf")
        expected = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) - 1 + n].gather(
            1, ids[0, len(p) :, None]
        )[:, 0]
        assert torch.allclose(rollout.logprobs[i, :n], expected, atol=1e-5)
        assert (rollout.logprobs[i, n:] == 0).all() and (rollout.ref_logprobs[i, n:] == 0).all()

    scores, raw_scores, *_ = score_rollout(ctx, rollout, records)
    assert raw_scores.tolist() == [2.0, 6.0, 0.0]  # "cat sat", "on a mat good bad yes", ""
    assert scores.tolist() == [2.0, -7.0, 0.0]  # the truncated response gets missing_eos_score
    rewards, kl = shape_rewards(scores, rollout.logprobs, rollout.ref_logprobs, rollout.mask, kl_coef, "k1")
    expected_kl = (rollout.logprobs - rollout.ref_logprobs) * expected_mask
    assert torch.allclose(kl, expected_kl) and expected_kl.abs().sum() > 0
    for i, n in enumerate(lengths):
        assert rewards[i, n - 1] == pytest.approx(float(scores[i] - kl_coef * kl[i, n - 1]), abs=1e-6)
        assert (rewards[i, n:] == 0).all()
    assert torch.allclose(rewards.sum(1), scores - kl_coef * kl.sum(1), atol=1e-6)


def test_critic_starts_as_the_reward_models_normalised_score(tmp_path, monkeypatch):
    """values[:, t] = gain * head(column p0 + t - 1) + bias, with the reward model's stored normalisation."""
    from transformers import AutoModelForSequenceClassification

    paths = write_online_problem(tmp_path)
    rm = AutoModelForSequenceClassification.from_pretrained(paths["reward"])
    rm.config.rlhfkit_reward_gain, rm.config.rlhfkit_reward_bias = 2.0, -3.0
    rm.save_pretrained(paths["reward"])
    ctx = make_context(online_config(paths, tmp_path / "run", f"online.reward_model={paths['reward']}"))
    tok = ctx.tokenizer
    w, eos = tok.convert_tokens_to_ids, tok.eos_token_id
    raw = [[w("cat"), w("sat"), eos, 5], [w("on"), eos, 5, 5]]
    monkeypatch.setattr(collect, "generate_responses", _hand_built_generation(tok, raw))
    prompts = [[1, w("hello"), w("world")], [1, w("yes")]]
    batch = {
        "query_ids": torch.tensor([prompts[0], [tok.pad_token_id] + prompts[1]]),
        "query_mask": torch.tensor([[1, 1, 1], [0, 1, 1]]),
        "records": [{"prompt": "x"}] * 2,
        "group_ids": torch.arange(2),
    }
    rollout = sample_rollout(ctx, batch)
    _, _, parts, *_ = score_rollout(ctx, rollout, batch["records"])
    for i, (p, n) in enumerate(zip(prompts, [3, 2], strict=True)):
        ids = torch.tensor([p + raw[i][:n]])
        with torch.no_grad():
            head = rm.score(rm.model(ids).last_hidden_state)[0, :, 0]  # (L,)
        assert torch.allclose(rollout.values[i, :n], 2.0 * head[len(p) - 1 : len(p) - 1 + n] - 3.0, atol=1e-5)
        assert parts["reward_model"][i] == pytest.approx(
            float(2.0 * head[-1] - 3.0), abs=1e-5
        )  # same read-out


def test_missing_eos_mask_leaves_truncated_responses_out(tmp_path, monkeypatch):
    paths = write_online_problem(tmp_path, reward_model=False)
    cfg = online_config(paths, tmp_path / "run", "online.missing_eos=mask", reward="words")
    ctx = make_context(cfg)
    tok = ctx.tokenizer
    w, eos = tok.convert_tokens_to_ids, tok.eos_token_id
    raw = [[w("cat"), eos, 5, 5], [w("on"), w("a"), w("mat"), w("yes")]]
    monkeypatch.setattr(collect, "generate_responses", _hand_built_generation(tok, raw))
    batch = {
        "query_ids": torch.tensor([[1, w("hello")]] * 2),
        "query_mask": torch.ones(2, 2, dtype=torch.long),
        "records": [{"prompt": "hello"}] * 2,
        "group_ids": torch.tensor([0, 0]),
    }
    rollout = sample_rollout(ctx, batch)
    assert rollout.mask.tolist() == [[True, True, False, False], [False] * 4]
    assert rollout.response_mask[1].all()  # the reward model still reads the truncated response
    rollout.scores, raw_scores, *_ = score_rollout(ctx, rollout, batch["records"])
    assert raw_scores.tolist() == [1.0, 4.0]
    rollout.rewards, rollout.kl = shape_rewards(
        rollout.scores, rollout.logprobs, rollout.ref_logprobs, rollout.mask, 0.1
    )
    assert (rollout.rewards[1] == 0).all()
    ctx.cfg.online.advantage_estimator = "rloo"  # a group of two: the masked response must not be a baseline
    advantages, _ = estimate_advantages(ctx, rollout)
    assert (advantages == 0).all()  # alone in its group, the kept response has no baseline either


# ---------------------------------------------------------------------------------------------------------
# The PPO ratio before any update: exactly 1 (dropout off in all four roles, padding-independent positions)


@pytest.mark.parametrize("policy", ["llama", "gpt2-dropout"])
def test_new_and_old_logprobs_agree_on_first_minibatch_of_every_epoch_with_lr_zero(tmp_path, policy):
    paths = write_online_problem(tmp_path, policy=policy)
    cfg = online_config(
        paths,
        tmp_path / "run",
        "online.ppo_epochs=3",
        "online.num_minibatches=2",
        f"online.reward_model={paths['reward']}",
    )
    ctx = make_context(cfg)
    roles = [ctx.roles.actor, ctx.roles.reference, ctx.roles.critic, ctx.roles.reward_model]
    for model in roles:
        drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
        assert all(m.p == 0.0 for m in drops) and (policy == "llama" or drops)
    for optimizer in ctx.optimizers.values():
        for group in optimizer.param_groups:
            group["lr"] = 0.0
    rollout = rollout_for_update(ctx)
    assert (rollout.query_mask == 0).any()  # left-padded prompts
    result = ppo_update(ctx, rollout, step=1)
    assert len(result.first_minibatch_logprob_diff) == 3
    assert max(result.first_minibatch_logprob_diff) < 1e-5
    means = result.stats.means(ctx)
    assert means["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert means["clipfrac"] == 0.0


def test_ratio_check_detects_dropout_when_it_is_left_on(tmp_path):
    """The negative control of the test above: with dropout kept, the first minibatch's ratio is not 1."""
    paths = write_online_problem(tmp_path, policy="gpt2-dropout", reward_model=False)
    ctx = make_context(
        online_config(paths, tmp_path / "run", "model.disable_dropout=false", "online.ppo_epochs=1")
    )
    for group in ctx.optimizers["actor"].param_groups:
        group["lr"] = 0.0
    result = ppo_update(ctx, rollout_for_update(ctx), step=1)
    assert result.first_minibatch_logprob_diff[0] > 1e-3


def _ragged_generation(tok, lengths):
    """A stand-in for generate_responses whose i-th response ends with EOS after ``lengths[i % len]`` tokens
    (0 = no EOS: truncated), so that a minibatch holds responses of different lengths."""
    w = tok.convert_tokens_to_ids
    words = [w(x) for x in ("cat", "dog", "mat", "one", "two", "yes", "good", "bad")]

    def fake(model, prompt_ids, prompt_mask, *, stop_token_ids, pad_token_id, max_new_tokens, **_):
        rows = []
        for i in range(prompt_ids.shape[0]):
            n = lengths[i % len(lengths)]
            row = [words[(i + j) % len(words)] for j in range(max_new_tokens)]
            if n:
                row[n - 1] = tok.eos_token_id
            rows.append(row)
        return _hand_built_generation(tok, rows)(
            model, prompt_ids, prompt_mask, stop_token_ids=stop_token_ids, pad_token_id=pad_token_id
        )

    return fake


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_size_does_not_change_the_update(tmp_path, monkeypatch, mode):
    """Whole-minibatch normaliser in every aggregation mode: one pass of 8 responses of different lengths,
    micro-batches of 4, 2 and 1 give the same gradient (SGD, lr 1) to actor and critic. A mean of per-micro-batch means
    (or per-micro-batch token counts) differs as soon as the lengths differ."""
    paths = write_online_problem(tmp_path)
    deltas = []
    rollout = None
    for micro in (4, 2, 1):
        cfg = online_config(
            paths,
            tmp_path / f"run{micro}",
            f"online.reward_model={paths['reward']}",
            f"train.micro_batch_size={micro}",
            "online.ppo_epochs=1",
            "online.num_minibatches=1",
            f"online.loss_agg_mode={mode}",
            "train.max_grad_norm=null",
        )
        ctx = make_context(cfg)
        monkeypatch.setattr(collect, "generate_responses", _ragged_generation(ctx.tokenizer, [1, 6, 3, 0]))
        for name, model in ctx.trained.items():
            ctx.optimizers[name] = torch.optim.SGD(model.parameters(), lr=1.0)
        rollout = rollout if rollout is not None else rollout_for_update(ctx)
        assert sorted(rollout.mask.sum(1).tolist()) == [
            1,
            1,
            3,
            3,
            6,
            6,
            6,
            6,
        ]  # ragged: 1, 6, 3 and 6 (no EOS)
        before = {name: state(model) for name, model in ctx.trained.items()}
        ppo_update(ctx, rollout, step=1)
        deltas.append(
            {
                f"{name}.{k}": v - before[name][k]
                for name, model in ctx.trained.items()
                for k, v in state(model).items()
            }
        )
    assert {k.split(".")[0] for k in deltas[0]} == {"actor", "critic"}
    assert any(d.abs().max() > 1e-4 for k, d in deltas[0].items() if k.startswith("actor."))
    assert any(d.abs().max() > 1e-4 for k, d in deltas[0].items() if k.startswith("critic."))
    for other in deltas[1:]:
        for key, delta in deltas[0].items():
            assert torch.allclose(delta, other[key], atol=1e-6), key


# ---------------------------------------------------------------------------------------------------------
# Whole runs (in-process)


def test_all_truncated_batch_under_mask_changes_nothing_and_logs_no_nan(tmp_path, monkeypatch):
    paths = write_online_problem(tmp_path)
    real = collect.generate_responses

    def never_eos(model, prompt_ids, prompt_mask, *, sampling, stop_token_ids, **kwargs):
        never = dataclasses.replace(sampling, suppress_ids=(*sampling.suppress_ids, *stop_token_ids))
        return real(model, prompt_ids, prompt_mask, stop_token_ids=stop_token_ids, sampling=never, **kwargs)

    monkeypatch.setattr(collect, "generate_responses", never_eos)
    out = tmp_path / "run"
    cfg = online_config(
        paths,
        out,
        "online.missing_eos=mask",
        f"online.reward_model={paths['reward']}",
        "train.max_steps=2",
        "train.weight_decay=0.1",
    )
    online.train(cfg)
    initial = load_file(str(paths["policy"] / "model.safetensors"))
    final = load_file(str(out / "final" / "model.safetensors"))
    assert all(torch.equal(initial[k], final[k]) for k in initial)
    critic_initial = load_file(str(paths["reward"] / "model.safetensors"))
    critic_final = load_file(str(out / "final_critic" / "model.safetensors"))
    assert all(torch.equal(critic_initial[k], critic_final[k]) for k in critic_initial)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert all(v is not None for v in row.values()), row  # NaN / inf would be written as null
        assert row["response/ended_frac"] == 0 and row["response/trained_frac"] == 0
        assert row["update/skipped_minibatches"] == 2 * 2  # every minibatch of every epoch


@pytest.mark.parametrize(
    "kind, extra, reward",
    [
        ("grpo", ("online.kl_estimator=k3",), "cat_count"),
        ("rloo", ("online.score_clip=0.5",), "words"),
        ("ppo", ("online.advantage_estimator=reinforce_pp", "online.ent_coef=0.01"), "cat_count"),
    ],
)
def test_critic_free_estimators_run_without_a_critic(tmp_path, monkeypatch, kind, extra, reward):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")  # the command line would take every core
    paths = write_online_problem(tmp_path, reward_model=False)
    out = tmp_path / "run"
    assert (
        main(
            online_cli_args(
                paths, out, "train.max_steps=2", "online.kl_coef=0.2", *extra, kind=kind, reward=reward
            )
        )
        == 0
    )
    marker = json.loads((out / "checkpoints" / "step-2" / "COMPLETE").read_text())
    assert marker["models"] == ["actor"] and marker["optimizers"] == ["actor"]
    assert not (out / "final_critic").exists()
    initial = load_file(str(paths["policy"] / "model.safetensors"))
    final = load_file(str(out / "final" / "model.safetensors"))
    assert any(not torch.equal(initial[k], final[k]) for k in initial)
    for row in read_metrics(out / "metrics.jsonl"):
        assert "loss/value" not in row and "values/mean" not in row and "loss/policy" in row
        assert "value/explained_variance" not in row
        # stage 3 as logged: per-response reward = score - kl_coef * KL (nothing masked here)
        assert row["reward/mean"] == pytest.approx(row["score/mean"] - 0.2 * row["kl/mean"], abs=1e-6)
        assert row["kl/mean"] >= 0 or "online.kl_estimator=k3" not in extra  # k3 is never negative
        if "online.score_clip=0.5" in extra:  # words: about 5 per response, clipped to 0.5
            assert row["score/raw_mean"] > 1.0 and row["score/mean"] <= 0.5
        assert ("loss/entropy" in row) == ("online.ent_coef=0.01" in extra)


def test_resume_restores_the_random_streams_a_reward_function_draws_from(tmp_path):
    """The trainer's own draws are functions of (seed, step), but a reward function may draw from ``random``
    and ``numpy``: a run stopped after its step-2 checkpoint and resumed must give the uninterrupted run's
    scores and weights, so the checkpoint must carry (and resume restore) those generators' states."""
    paths = write_online_problem(tmp_path, reward_model=False)
    full, part = tmp_path / "full", tmp_path / "part"
    args = ("train.save_steps=2",)
    online.train(online_config(paths, full, "train.max_steps=4", *args, reward="noisy_cat_count"))
    online.train(online_config(paths, part, "train.max_steps=2", *args, reward="noisy_cat_count"))
    import random

    import numpy

    (
        random.seed(12345),
        numpy.random.seed(12345),
    )  # what a new process would hold: anything but the saved state
    online.train(
        online_config(paths, part, "train.max_steps=4", *args, reward="noisy_cat_count"), resume=True
    )

    def strip(rows):
        return [
            {k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_second"}
            for r in rows
        ]

    rows_full, rows_part = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in rows_part] == [1, 2, 3, 4]
    assert len({r["score/mean"] for r in rows_full}) == 4  # the noise is in the scores
    assert strip(rows_full) == strip(rows_part)
    a, b = (
        load_file(str(full / "final" / "model.safetensors")),
        load_file(str(part / "final" / "model.safetensors")),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_actor_and_critic_step_at_their_own_learning_rates(tmp_path):
    """One AdamW step moves every parameter with a gradient by about its learning rate (m / sqrt(v) = sign(g) on
    the first step; no weight decay, constant schedule): the actor's largest move is train.learning_rate and
    the critic's online.critic_learning_rate, ten times larger here."""
    paths = write_online_problem(tmp_path)
    cfg = online_config(
        paths,
        tmp_path / "run",
        f"online.reward_model={paths['reward']}",
        "online.ppo_epochs=1",
        "online.num_minibatches=1",
        "train.learning_rate=1e-3",
        "online.critic_learning_rate=1e-2",
        "train.weight_decay=0.0",
        "train.warmup_steps=0",
    )
    ctx = make_context(cfg)
    rollout = rollout_for_update(ctx)
    before = {name: state(model) for name, model in ctx.trained.items()}
    ppo_update(ctx, rollout, step=1)
    for name, lr in (("actor", 1e-3), ("critic", 1e-2)):
        moved = max(float((v - before[name][k]).abs().max()) for k, v in state(ctx.trained[name]).items())
        assert moved == pytest.approx(lr, rel=0.02), (name, moved)


def test_evaluate_hook_is_logged_and_leaves_training_unchanged_and_critic_warms_up_first(tmp_path):
    paths = write_online_problem(tmp_path)
    calls = []

    def evaluate(policy, step):
        calls.append((step, policy.training))
        return {"probe/mean": float(torch.rand(()))}  # draws from the global RNG on purpose

    finals = []
    for name, hooks, evals in (
        ("with", OnlineHooks(evaluate=evaluate), [f"data.eval_file={paths['prompts']}"]),
        ("without", None, []),
    ):
        out = tmp_path / name
        cfg = online_config(
            paths,
            out,
            f"online.reward_model={paths['reward']}",
            "train.max_steps=3",
            "train.eval_steps=2",
            "train.save_steps=1",
            "online.critic_warmup_steps=1",
            *evals,
        )
        online.train(cfg, hooks=hooks)
        finals.append(load_file(str(out / "final" / "model.safetensors")))
    assert calls == [(0, False), (2, False), (3, False)]
    rows = read_metrics(tmp_path / "with" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [("probe/mean" in r) for r in rows] == [True, False, True, True]
    # data.eval_file: the built-in held-out figures, one response per prompt at the training temperature
    assert [("eval/score/mean" in r) for r in rows] == [True, False, True, True]
    assert rows[0]["eval/kl/mean"] == 0.0 and rows[3]["eval/kl/mean"] != 0.0  # the policy has moved by then
    assert 0 < rows[3]["eval/response_length/mean"] <= 6
    # the critic's explained variance and the gradient norms, for the report's health panel
    assert all(r["value/explained_variance"] <= 1.0 and r["grad_norm/critic"] > 0 for r in rows[1:])
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    # Critic warm-up: after rollout 1 only the critic has moved.
    step1 = tmp_path / "with" / "checkpoints" / "step-1"
    actor1, critic1 = (
        load_file(str(step1 / "model.actor.safetensors")),
        load_file(str(step1 / "model.critic.safetensors")),
    )
    initial = load_file(str(paths["policy"] / "model.safetensors"))
    assert all(torch.equal(initial[k], actor1[k]) for k in initial)
    reward = load_file(str(paths["reward"] / "model.safetensors"))
    assert any(not torch.equal(reward[k], critic1[k]) for k in reward)
    assert "loss/policy" not in rows[1] and "loss/value" in rows[1] and "loss/policy" in rows[2]


class ShiftingRewardModel:
    """A reward-model 'refresh' that nudges the head and counts its calls (its state is checkpointed)."""

    def __init__(self):
        self.calls = []

    def __call__(self, policy, reward_model, step):
        assert not policy.training and not any(p.requires_grad for p in reward_model.parameters())
        with torch.no_grad():
            reward_model.score.weight.mul_(1.5)
        self.calls.append(step)
        return {"refresh/calls": len(self.calls)}

    def state_dict(self):
        return {"calls": list(self.calls)}

    def load_state_dict(self, saved):
        self.calls = list(saved["calls"])


def test_reward_model_refresh_hook_is_checkpointed_and_resumes(tmp_path):
    paths = write_online_problem(tmp_path)
    args = (
        f"online.reward_model={paths['reward']}",
        "train.save_steps=2",
        "online.critic_learning_rate=3e-3",
        "refresh.every=2",
    )
    full, part = ShiftingRewardModel(), ShiftingRewardModel()
    online.train(
        online_config(paths, tmp_path / "full", "train.max_steps=4", *args),
        hooks=OnlineHooks(refresh_reward_model=full),
    )
    online.train(
        online_config(paths, tmp_path / "part", "train.max_steps=2", *args),
        hooks=OnlineHooks(refresh_reward_model=part),
    )
    resumed = ShiftingRewardModel()
    online.train(
        online_config(paths, tmp_path / "part", "train.max_steps=4", *args),
        resume=True,
        hooks=OnlineHooks(refresh_reward_model=resumed),
    )
    assert full.calls == [2, 4] and resumed.calls == [2, 4]  # the hook's own state came back
    marker = json.loads((tmp_path / "full" / "checkpoints" / "step-2" / "COMPLETE").read_text())
    assert marker["models"] == ["actor", "critic", "reward_model"]
    for name in ("actor", "critic", "reward_model"):
        a = load_file(str(tmp_path / "full" / "checkpoints" / "step-4" / f"model.{name}.safetensors"))
        b = load_file(str(tmp_path / "part" / "checkpoints" / "step-4" / f"model.{name}.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    reward = load_file(str(tmp_path / "full" / "checkpoints" / "step-4" / "model.reward_model.safetensors"))
    initial = load_file(str(paths["reward"] / "model.safetensors"))
    assert torch.allclose(reward["score.weight"], initial["score.weight"] * 2.25)
    rows = read_metrics(tmp_path / "part" / "metrics.jsonl")
    assert [r.get("refresh/calls") for r in rows] == [None, 1, None, 2]


@pytest.mark.slow
@pytest.mark.learning
def test_ppo_learns_a_toy_reward(tmp_path, learning_seed, learning_figures):
    """+1 per 'cat' token: the mean score rises far above the random policy's (a learning signal, not a benchmark)."""
    paths = write_online_problem(tmp_path, reward_model=False, seed=learning_seed)
    out = tmp_path / "run"
    cfg = online_config(
        paths,
        out,
        f"seed={learning_seed}",
        "train.max_steps=24",
        "train.learning_rate=3e-3",
        "train.batch_size=8",
        "train.micro_batch_size=null",
        "online.group_size=2",
        "online.num_minibatches=1",
        "online.ppo_epochs=4",
        "online.kl_coef=0.01",
        "online.missing_eos=none",
        "online.critic_learning_rate=3e-3",
        "train.save_steps=100",
    )
    online.train(cfg)
    scores = [r["score/mean"] for r in read_metrics(out / "metrics.jsonl")]
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    learning_figures(score_first=first, score_last=last, score_rise=last - first)
    assert last > first + 2.0, scores  # from ~0.1 to ~6 (of 6 tokens) on this seed


def test_reward_weights_weigh_the_trained_score(tmp_path):
    """online.reward_weights in stage 2: the score is sum_i w_i * f_i of the functions' own (logged) parts."""
    paths = write_online_problem(tmp_path, reward_model=False)
    cfg = online_config(
        paths,
        tmp_path / "run",
        f"online.reward_functions=[{paths['rewards']}:cat_count, {paths['rewards']}:words]",
        "online.reward_weights=[2.0, -0.5]",
        "online.missing_eos=none",
    )
    ctx = make_context(cfg)
    examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))
    batch = prompt_batch(ctx, examples, 1)
    scores = score_rollout(ctx, sample_rollout(ctx, batch, step=1), batch["records"])
    cats, words = scores.parts["cat_count"], scores.parts["words"]
    assert words.abs().sum() > 0  # the responses have words: the weight of words shows
    torch.testing.assert_close(scores.scores, 2.0 * cats - 0.5 * words)


# ---------------------------------------------------------------------------------------------------------
# Configuration


def test_stop_token_and_config_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path, reward_model=False)
    ctx_cfg = online_config(paths, tmp_path / "a", "online.stop_token=.")
    from rlhfkit.models import load_tokenizer

    tok = load_tokenizer(str(paths["policy"]))
    assert stop_token_ids(ctx_cfg, tok) == [tok.eos_token_id, tok.convert_tokens_to_ids(".")]
    with pytest.raises(ConfigError, match="online.stop_token"):
        stop_token_ids(online_config(paths, tmp_path / "b", "online.stop_token='hello world'"), tok)
    code = main(online_cli_args(paths, tmp_path / "c", "online.critic_model=x", kind="grpo"))
    assert code == 2 and "online.critic_model" in capsys.readouterr().err
    code = main(online_cli_args(paths, tmp_path / "d", reward="missing_fn"))
    err = capsys.readouterr().err
    assert code == 2 and "online.reward_functions[0]" in err and "missing_fn" in err
