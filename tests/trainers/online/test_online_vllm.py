"""The online trainers with ``online.generation_backend=vllm``: the keys reach the engine, the logprob gap
(hand-computed) and its stop, truncated importance sampling in the policy loss, a model the engine cannot
run refused at start-up; and, where vLLM is installed, a GRPO run that logs the gap and the weight sync,
stops with one named line when the engine dies or holds stale weights (the newest checkpoint intact), and
resumes to the weights of an uninterrupted run."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli import main
from rlhfkit.config import load_config
from rlhfkit.errors import ConfigError, GenerationEngineError
from rlhfkit.models import load_tokenizer
from tests.helpers import tiny_llama
from tests.trainers.online.online_fixtures import (
    make_context,
    online_cli_args,
    online_config,
    write_online_problem,
)

needs_vllm = (
    pytest.mark.skipif(  # CI sets RLHFKIT_REQUIRE_VLLM=1 where it installed vLLM: never skipped there
        importlib.util.find_spec("vllm") is None and not os.environ.get("RLHFKIT_REQUIRE_VLLM"),
        reason="vLLM is not installed (./setup.sh vllm, or pip install 'rlhfkit[vllm]')",
    )
)
VLLM = ("online.generation_backend=vllm", "online.vllm_max_model_len=64")


def engine_problem(root, reward_model: bool = False):
    """The online fixture's problem with a policy of head size 32 (one vLLM's CPU attention runs)."""
    paths = write_online_problem(root, reward_model=reward_model)
    tokenizer = load_tokenizer(str(paths["policy"]))
    model = tiny_llama(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
    )
    model.save_pretrained(paths["policy"])
    return paths


def test_rollout_correction_needs_the_engine(tmp_path):
    paths = write_online_problem(tmp_path, reward_model=False)
    with pytest.raises(ConfigError, match="online.rollout_correction"):
        online_config(paths, tmp_path / "a", "online.rollout_correction=tis", kind="grpo")
    online_config(paths, tmp_path / "b", "online.rollout_correction=tis", *VLLM, kind="grpo")


def test_engine_keys_reach_the_engine_settings(tmp_path, monkeypatch):
    import rlhfkit.rollout.vllm_engine as vllm_engine
    from rlhfkit.trainers.online.engine_rollout import start_engine

    seen = {}
    monkeypatch.setattr(
        vllm_engine, "VLLMEngine", lambda model, settings, where: seen.update(s=settings, w=where)
    )
    paths = write_online_problem(tmp_path, reward_model=False)
    assert start_engine(online_config(paths, tmp_path / "a", kind="grpo"), None) is None  # hf: no engine
    cfg = online_config(
        paths,
        tmp_path / "b",
        "online.generation_backend=vllm",
        "online.vllm_kv_cache_gib=3",
        "online.vllm_kv_cache_dtype=fp8",
        "seed=7",
        kind="grpo",
    )
    start_engine(cfg, None)
    assert seen["s"] == vllm_engine.EngineSettings(
        "float32", 3, "fp8", 16 + 6, seed=7
    )  # max_prompt + response
    assert str(paths["policy"]) in seen["w"]
    start_engine(
        dataclasses.replace(cfg, online=dataclasses.replace(cfg.online, vllm_max_model_len=99)), None
    )
    assert seen["s"].max_model_len == 99
    refreshed = online_config(
        paths,
        tmp_path / "c",
        "online.generation_backend=vllm",
        "refresh.every=2",
        "refresh.max_new_tokens=30",
    )
    start_engine(refreshed, None)
    assert seen["s"].max_model_len == 16 + 30  # the refresh's longer responses fit too


def test_logprob_gap_hand_computed_and_its_stop(tmp_path):
    from rlhfkit.trainers.online.engine_rollout import check_logprob_gap

    paths = write_online_problem(tmp_path, reward_model=False)
    cfg = online_config(paths, tmp_path / "a", *VLLM, "online.vllm_max_logprob_gap=0.3", kind="grpo")
    ctx = make_context(cfg)
    mask = torch.tensor([[True, True], [True, False]])
    rollout = SimpleNamespace(
        engine_logprobs=torch.tensor([[-1.1, -0.5], [-0.8, float("nan")]]),  # junk where masked
        logprobs=torch.tensor([[-1.0, -1.0], [-1.0, 5.0]]),
        mask=mask,
    )
    gap = check_logprob_gap(ctx, rollout)  # |0.1|, |0.5|, |0.2| -> mean 0.8 / 3, max 0.5
    assert gap["generation/logprob_gap/mean"] == pytest.approx(0.8 / 3)
    assert gap["generation/logprob_gap/max"] == pytest.approx(0.5)
    strict = dataclasses.replace(
        ctx, cfg=dataclasses.replace(cfg, online=dataclasses.replace(cfg.online, vllm_max_logprob_gap=0.25))
    )
    with pytest.raises(
        GenerationEngineError,
        match=r"generation/logprob_gap/mean = 0.2667 nats > online.vllm_max_logprob_gap = 0.25",
    ):
        check_logprob_gap(strict, rollout)
    assert check_logprob_gap(ctx, SimpleNamespace(engine_logprobs=None)) == {}  # hf: nothing


def test_a_nonfinite_gap_stops_the_run_naming_the_gap(tmp_path):
    """NaN > limit is False: a NaN gap must still stop the run, by its name, saying which side is not finite."""
    from rlhfkit.trainers.online.engine_rollout import check_logprob_gap

    paths = write_online_problem(tmp_path, reward_model=False)
    ctx = make_context(online_config(paths, tmp_path / "a", *VLLM, kind="grpo"))
    mask = torch.tensor([[True, True], [True, False]])
    for engine_value, trainer_value, side in (
        (float("nan"), -1.0, "1 of the engine's log-probs"),
        (-1.0, float("-inf"), "1 of the trainer's log-probs"),
    ):
        rollout = SimpleNamespace(
            engine_logprobs=torch.tensor([[-1.0, engine_value], [-1.0, 0.0]]),
            logprobs=torch.tensor([[-1.0, trainer_value], [-1.0, 0.0]]),
            mask=mask,
        )
        with pytest.raises(GenerationEngineError) as stop:
            check_logprob_gap(ctx, rollout, round_=2)
        message = str(stop.value)
        assert message.startswith("generation/logprob_gap/mean = ")
        assert "(dynamic sampling round 2) is not a finite number" in message and side in message
    masked_nan = SimpleNamespace(  # NaN where the mask is off is no gap at all
        engine_logprobs=torch.tensor([[-1.0, -1.0], [-1.0, float("nan")]]),
        logprobs=torch.tensor([[-1.0, -1.0], [-1.0, -1.0]]),
        mask=mask,
    )
    assert check_logprob_gap(ctx, masked_nan)["generation/logprob_gap/mean"] == 0.0


@pytest.mark.parametrize(
    "keys, needed",
    [
        (("online.vllm_max_model_len=21",), "data.max_prompt_length + online.response_length = 22"),
        (
            ("online.vllm_max_model_len=30", "refresh.every=2", "refresh.max_new_tokens=20"),
            "data.max_prompt_length + refresh.max_new_tokens = 36",
        ),
    ],
    ids=["response", "refresh"],
)
def test_an_engine_length_below_prompt_plus_response_is_refused_at_start_up(tmp_path, keys, needed):
    """A cap below the longest prompt + response would have the engine cut responses with no stop token."""
    paths = write_online_problem(tmp_path, reward_model=False)
    with pytest.raises(ConfigError, match=rf"^online.vllm_max_model_len .*{re.escape(needed)}"):
        online_config(paths, tmp_path / "a", "online.generation_backend=vllm", *keys, kind="grpo")
    online_config(paths, tmp_path / "b", "online.generation_backend=vllm", "online.vllm_max_model_len=22")
    online_config(paths, tmp_path / "c", "online.vllm_max_model_len=8", kind="grpo")  # hf: no engine


class CopyEngine:
    """An engine in vLLM's place that samples with Hugging Face ``generate`` from its own copy of the weights
    it was last given (so a skipped sync samples from stale weights, as vLLM would), and counts its calls.
    ``offset``: call number -> nats added to the engine log-probs of that generate call (a planted gap)."""

    def __init__(self, offset: dict[int, float] | None = None):
        self.model, self.loads, self.calls, self.offset = None, 0, 0, offset or {}

    def load_weights(self, model):
        import copy

        self.model, self.loads = copy.deepcopy(model), self.loads + 1

    def generate(self, prompt_ids, prompt_mask, *, seeds, **kwargs):
        from rlhfkit.rollout import generate_responses

        self.calls += 1
        out = generate_responses(self.model, prompt_ids, prompt_mask, return_logprobs=True, **kwargs)
        shift = self.offset.get(self.calls, 0.0)
        out.sampled_logprobs = torch.where(out.mask, out.sampled_logprobs + shift, 0.0)
        return out

    def close(self):
        pass


HALF_CONSTANT = '''
def half_constant(prompts, completions, **kwargs):
    """The response's length for prompts of odd length, 1.0 for the others (those groups never spread)."""
    return [float(len(c)) if len(p) % 2 else 1.0 for p, c in zip(prompts, completions)]
'''


def _dynamic_run(tmp_path, monkeypatch, engine, name):
    """A grpo run of 2 rollouts with dynamic sampling, whose engine is ``engine``: its metrics rows."""
    import rlhfkit.trainers.online.loop as loop
    from rlhfkit.engine.metrics_writer import read_metrics
    from rlhfkit.trainers.online import OnlineHooks, train

    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    monkeypatch.setattr(loop, "start_engine", lambda cfg, actor, episodes=None: engine)
    paths = write_online_problem(tmp_path / "problem", reward_model=False)
    rewards = tmp_path / "half.py"
    rewards.write_text(HALF_CONSTANT)
    out = tmp_path / name
    cfg = online_config(
        paths,
        out,
        *VLLM,
        f"online.reward_functions=[{rewards}:half_constant]",
        "online.dynamic_sampling=true",
        "online.missing_eos=none",
        "train.max_steps=2",
        kind="grpo",
    )
    train(cfg, hooks=OnlineHooks(evaluate_at_start=False))
    return [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]


def test_dynamic_sampling_loads_the_engine_once_per_rollout(tmp_path, monkeypatch):
    """The actor does not move between sampling rounds: one weight load per rollout, not one per round."""
    engine = CopyEngine()
    rows = _dynamic_run(tmp_path, monkeypatch, engine, "once")
    rounds = sum(r["groups/sampling_rounds"] for r in rows)
    assert len(rows) == 2 and rounds >= 1  # extra rounds were sampled
    assert engine.calls == len(rows) + rounds  # stage 1 and every round generated from the engine
    assert engine.loads == len(rows)  # ... which was loaded once per rollout
    for r in rows:  # the rounds sampled from the weights of this rollout, not the previous one's
        assert r["generation/logprob_gap/mean"] < 1e-4


def test_every_sampling_rounds_gap_is_checked(tmp_path, monkeypatch):
    """An engine whose log-probs are off in the first extra round only (call 2) stops the run there."""
    engine = CopyEngine(offset={2: 1.0})
    with pytest.raises(GenerationEngineError, match=r"(?s)dynamic sampling round 1.*vllm_max_logprob_gap"):
        _dynamic_run(tmp_path, monkeypatch, engine, "gap")
    assert engine.calls == 2


@pytest.mark.parametrize("cap, weight", [(1.5, 1.5), (3.0, 2.0)])
def test_tis_weights_the_policy_loss_by_the_capped_ratio(tmp_path, cap, weight):
    from rlhfkit.algos.masked import fill_masked
    from rlhfkit.trainers.online.collect import prompt_batch, sample_rollout
    from rlhfkit.trainers.online.context import StatSums
    from rlhfkit.trainers.online.ppo_update import micro_batch_loss

    paths = write_online_problem(tmp_path, reward_model=False)
    runs = {}
    for correction in ("none", "tis"):
        cfg = online_config(
            paths,
            tmp_path / correction,
            *VLLM,
            f"online.rollout_correction={correction}",
            f"online.rollout_correction_cap={cap}",
            kind="grpo",
        )
        ctx = make_context(cfg)  # no engine is started here: hf samples, the engine's log-probs are planted
        texts = ("hello", "a mat", "one two", "yes")
        examples = [{"prompt_ids": ctx.tokenizer(p)["input_ids"], "record": {"prompt": p}} for p in texts]
        torch.manual_seed(0)
        rollout = sample_rollout(ctx, prompt_batch(ctx, examples, 1))
        mask = rollout.mask
        # the engine gave each sampled token half the trainer's probability: ratio 2 everywhere
        rollout.engine_logprobs = fill_masked(rollout.logprobs - math.log(2.0), mask)
        rollout.advantages = fill_masked(
            torch.ones_like(rollout.logprobs), mask
        )  # ratio 1: loss -1 per token
        normalizer = float(mask.sum())
        _, parts, _ = micro_batch_loss(ctx, rollout, normalizer, StatSums(), True)
        runs[correction] = float(parts["loss/policy"])
    assert runs["none"] == pytest.approx(-1.0, rel=1e-6)
    assert runs["tis"] == pytest.approx(weight * runs["none"], rel=1e-5)


def test_a_model_the_engine_cannot_run_is_refused_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path, reward_model=False)  # head size 32 / 4 = 8
    code = main(online_cli_args(paths, tmp_path / "run", *VLLM, "train.max_steps=1", kind="grpo"))
    err = capsys.readouterr().err
    assert code == 2
    assert "attention head size 8" in err and "model.name_or_path=" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _final(run):
    return load_file(str(run / "final" / "model.safetensors"))


RUN = (*VLLM, "train.max_steps=3", "train.save_steps=1", "train.log_steps=1")


@needs_vllm
def test_grpo_with_vllm_logs_the_gap_stops_when_the_engine_dies_and_resumes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = engine_problem(tmp_path)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert main(online_cli_args(paths, whole, *RUN, kind="grpo")) == 0
    capsys.readouterr()
    rows = [r for r in _metrics(whole) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # a float32 engine on the actor's weights: its log-probs are the trainer's
        assert 0 <= r["generation/logprob_gap/mean"] < 1e-4 and r["generation/logprob_gap/max"] < 1e-3
        assert r["time/weight_sync"] > 0 and r["time/generate"] > 0

    from vllm import LLM

    real, calls = LLM.generate, []

    def dies_on_the_third_rollout(self, *args, **kwargs):  # the engine itself fails, under rlhfkit's call
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("EngineCore died unexpectedly")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", dies_on_the_third_rollout)
    code = main(online_cli_args(paths, broken, *RUN, kind="grpo"))
    err = capsys.readouterr().err
    assert code == 4
    stops = [line for line in err.splitlines() if line.startswith("rlhfkit: stopped")]
    assert stops == [
        "rlhfkit: stopped: the vLLM engine failed while generating: RuntimeError: EngineCore died unexpectedly"
    ]
    assert "Traceback" not in err
    assert (broken / "checkpoints" / "step-2" / "COMPLETE").is_file()
    assert not (broken / "checkpoints" / "step-3").exists()
    monkeypatch.setattr(LLM, "generate", real)
    assert main([*online_cli_args(paths, broken, *RUN, kind="grpo"), "--resume"]) == 0
    # the engine is deterministic for these batches: the resumed run draws and trains what the whole run did
    resumed, expected = _final(broken), _final(whole)
    assert resumed.keys() == expected.keys()
    for name in expected:
        assert torch.equal(resumed[name], expected[name]), name


@needs_vllm
def test_stale_weights_stop_fires_when_the_sync_is_planted_out(tmp_path, capsys, monkeypatch):
    import rlhfkit.rollout.vllm_engine as vllm_engine

    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    monkeypatch.setattr(vllm_engine.VLLMEngine, "load_weights", lambda self, model: None)  # the planted bug
    paths = engine_problem(tmp_path)
    run = tmp_path / "run"
    code = main(online_cli_args(paths, run, *RUN, "train.learning_rate=5e-2", kind="grpo"))
    err = capsys.readouterr().err
    assert code == 4
    assert "generation/logprob_gap/mean" in err and "online.vllm_max_logprob_gap = 0.1" in err
    assert (run / "checkpoints" / "step-1" / "COMPLETE").is_file()  # the rollout before the stop is saved


def test_engine_for_hook_syncs_and_hands_the_sampler_only_to_hooks_that_take_it(tmp_path):
    from rlhfkit.trainers.online.engine_rollout import engine_for_hook

    events = []

    class FakeEngine:  # records what the trainer asks of the engine
        def load_weights(self, model):
            events.append(("load", model))

        def generate(self, prompt_ids, prompt_mask, *, seeds, **kwargs):
            events.append(("generate", len(seeds)))

    paths = write_online_problem(tmp_path, reward_model=False)
    ctx = make_context(online_config(paths, tmp_path / "a", kind="grpo"))

    def takes_it(policy, reward_model, step, generate=None):
        return {}

    def plain(policy, reward_model, step):
        return {}

    assert engine_for_hook(ctx, takes_it) == {}  # hf: no engine
    ctx = dataclasses.replace(ctx, engine=FakeEngine())
    assert engine_for_hook(ctx, plain) == {} and events == []  # a hook without generate samples itself
    given = engine_for_hook(ctx, takes_it)
    assert events == [("load", ctx.roles.actor)]  # the actor's weights, loaded before the hook samples
    given["generate"](None, torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long))
    assert events[-1] == ("generate", 3)


def _count_engine_rows(monkeypatch):
    """Count the requests vLLM itself is given (``LLM.generate``), under rlhfkit's calls."""
    from vllm import LLM

    real, rows = LLM.generate, []

    def counting(self, requests, *args, **kwargs):
        rows.append(len(requests))
        return real(self, requests, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", counting)
    return rows


@needs_vllm
def test_held_out_evaluation_and_the_refresh_sample_from_the_engine(tmp_path, monkeypatch):
    import functools

    import rlhfkit.trainers.online.collect as collect
    from rlhfkit.config import RefreshConfig
    from rlhfkit.models import load_scalar_model
    from rlhfkit.rollout.pairs import sample_response_pairs
    from rlhfkit.rollout.vllm_engine import engine_generate
    from rlhfkit.trainers.online.engine_rollout import start_engine
    from rlhfkit.trainers.online.metrics import evaluate_prompts
    from rlhfkit.trainers.online.refresh import RewardRefresh
    from tests.trainers.online.online_fixtures import PROMPTS

    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = engine_problem(tmp_path, reward_model=True)
    cfg = online_config(paths, tmp_path / "run", *VLLM, kind="grpo")
    ctx = make_context(cfg)
    ctx = dataclasses.replace(ctx, engine=start_engine(cfg, ctx.roles.actor))
    try:
        rows = _count_engine_rows(monkeypatch)
        examples = [{"prompt_ids": ctx.tokenizer(p)["input_ids"], "record": {"prompt": p}} for p in PROMPTS]

        def greedy(generate):  # evaluation samples; greedy, the two backends must give the same tokens
            return lambda *args, **kwargs: generate(*args, **{**kwargs, "greedy": True})

        monkeypatch.setattr(ctx.engine, "generate", greedy(ctx.engine.generate))
        monkeypatch.setattr(collect, "generate_responses", greedy(collect.generate_responses))
        from_engine = evaluate_prompts(ctx, examples)
        assert sum(rows) == len(PROMPTS)  # every held-out response came from the engine
        from_hf = evaluate_prompts(dataclasses.replace(ctx, engine=None), examples)
        assert sum(rows) == len(PROMPTS)
        assert from_engine.keys() == from_hf.keys()
        for name in from_hf:
            assert from_engine[name] == pytest.approx(from_hf[name], abs=1e-5), name
        monkeypatch.undo()  # the real engine and generate again (and the row count)
        rows = _count_engine_rows(monkeypatch)

        # the refresh's pairs: greedy, the engine's sampler gives Hugging Face generate's responses
        policy = ctx.roles.actor
        sampler = engine_generate(ctx.engine)
        kwargs = dict(max_new_tokens=6, seed=3)
        greedy_engine = sample_response_pairs(
            policy, ctx.tokenizer, PROMPTS, generate=functools.partial(sampler, greedy=True), **kwargs
        )
        from rlhfkit.rollout.generation import generate_responses

        greedy_hf = sample_response_pairs(
            policy,
            ctx.tokenizer,
            PROMPTS,
            generate=functools.partial(generate_responses, greedy=True),
            **kwargs,
        )
        assert greedy_engine == greedy_hf and any(p.a for p in greedy_hf)
        # and the refresh hook samples with the sampler it is given
        before = sum(rows)
        reward_model = load_scalar_model(str(paths["reward"]), tokenizer=ctx.tokenizer)
        refresh = RewardRefresh(
            ctx.tokenizer,
            PROMPTS,
            label_fn=lambda prompt, a, b: len(a) < len(b),
            initial_pairs=[{"prompt": "hello", "chosen": "cat", "rejected": "dog dog"}],
            config=RefreshConfig(pairs=4, steps=1, batch_size=2, max_new_tokens=6),
        )
        metrics = refresh(policy, reward_model, 1, generate=sampler)
        assert sum(rows) - before == 2 * 4  # two responses for each of the 4 prompts
        assert "refresh/new_pairs" in metrics
    finally:
        ctx.engine.close()


@needs_vllm
def test_generate_command_with_the_vllm_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = engine_problem(tmp_path)
    rows = _count_engine_rows(monkeypatch)
    base = ["generate", "--model", str(paths["policy"]), "--prompts", str(paths["prompts"])]
    base += ["--max-new-tokens", "6"]
    out = {name: tmp_path / f"{name}.jsonl" for name in ("hf", "vllm", "s1", "s2")}
    assert main([*base, "--greedy", "--out", str(out["hf"])]) == 0
    assert rows == []  # hf: no engine
    assert main([*base, "--greedy", "--backend", "vllm", "--out", str(out["vllm"])]) == 0
    lines = out["hf"].read_text().splitlines()
    assert sum(rows) == len(lines) > 0  # every response came from the engine
    assert out["vllm"].read_text() == out["hf"].read_text()  # greedy: the same responses
    for name in ("s1", "s2"):  # sampled: the seed fixes the engine's draws
        assert main([*base, "--backend", "vllm", "--seed", "4", "--out", str(out[name])]) == 0
    assert out["s1"].read_text() == out["s2"].read_text()


@needs_vllm
def test_an_engine_that_fails_to_start_stops_with_one_line_and_resume_continues(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = engine_problem(tmp_path)
    # vLLM's own refusal: a longest sequence beyond the model's 128 positions
    fresh = tmp_path / "fresh"
    code = main(
        online_cli_args(paths, fresh, "online.generation_backend=vllm", "online.vllm_max_model_len=4096")
    )
    err = capsys.readouterr().err
    stops = [line for line in err.splitlines() if line.startswith("rlhfkit: stopped")]
    assert code == 4 and len(stops) == 1 and "Traceback" not in err
    assert stops[0].startswith("rlhfkit: stopped: the vLLM engine failed to start: ") and "4096" in stops[0]
    assert not (fresh / "checkpoints").exists() or not any((fresh / "checkpoints").iterdir())

    # a resumed run whose engine cannot start (out of KV-cache memory, planted in vLLM's constructor)
    from vllm import LLM

    run = tmp_path / "run"
    one = online_cli_args(paths, run, *VLLM, "train.max_steps=1", "train.save_steps=1", kind="grpo")
    assert main(one) == 0
    real = LLM.__init__

    def no_memory(self, *args, **kwargs):
        raise ValueError("No available memory for the cache blocks. Try increasing VLLM_CPU_KVCACHE_SPACE.")

    monkeypatch.setattr(LLM, "__init__", no_memory)
    two = [
        *online_cli_args(paths, run, *VLLM, "train.max_steps=2", "train.save_steps=1", kind="grpo"),
        "--resume",
    ]
    capsys.readouterr()
    assert main(two) == 4
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("rlhfkit: stopped")] == [
        "rlhfkit: stopped: the vLLM engine failed to start: ValueError: No available memory for the cache "
        "blocks. Try increasing VLLM_CPU_KVCACHE_SPACE."
    ]
    assert (run / "checkpoints" / "step-1" / "COMPLETE").is_file()
    assert not (run / "checkpoints" / "step-2").exists()
    monkeypatch.setattr(LLM, "__init__", real)
    assert main(two) == 0
    assert [r["step"] for r in _metrics(run) if r["step"] > 0] == [1, 2]


@pytest.mark.slow
@pytest.mark.learning
@needs_vllm
@pytest.mark.skipif(
    not os.environ.get("RLHFKIT_VLLM_LEARNING"),
    reason="opt-in (RLHFKIT_VLLM_LEARNING=1): 4 GRPO runs, ~2.5 minutes on 2 shared cores",
)
def test_grpo_with_vllm_learns_what_hf_learns(tmp_path, learning_figures):
    """+1 per 'cat' token (the toy reward of the online tests, not the built-in task: that needs an SFT model
    and a reward model first): over seeds 0 and 1, the vllm runs' score gain is within the hf runs' seed spread."""
    from rlhfkit.engine.metrics_writer import read_metrics
    from rlhfkit.trainers import online

    paths = engine_problem(tmp_path)
    gains = {"hf": [], "vllm": []}
    for backend in gains:
        for seed in (0, 1):
            out = tmp_path / f"{backend}-{seed}"
            cfg = online_config(
                paths,
                out,
                f"seed={seed}",
                f"online.generation_backend={backend}",
                "online.vllm_max_model_len=64",
                "train.max_steps=12",
                "train.learning_rate=3e-3",
                "train.batch_size=8",
                "train.micro_batch_size=null",
                "online.group_size=4",
                "online.num_minibatches=1",
                "online.ppo_epochs=2",
                "online.kl_coef=0.01",
                "online.missing_eos=none",
                "train.save_steps=100",
                kind="grpo",
            )
            online.train(cfg)
            scores = [r["score/mean"] for r in read_metrics(out / "metrics.jsonl") if "score/mean" in r]
            gains[backend].append(sum(scores[-4:]) / 4 - sum(scores[:4]) / 4)
    learning_figures(**{f"gain_{b}_{i}": g for b, gs in gains.items() for i, g in enumerate(gs)})
    assert min(gains["hf"]) > 2.0 and min(gains["vllm"]) > 2.0, gains  # both learn
    spread = max(max(gains["hf"]) - min(gains["hf"]), 0.5)
    vllm_mean = sum(gains["vllm"]) / 2
    assert min(gains["hf"]) - spread <= vllm_mean <= max(gains["hf"]) + spread, gains


def test_request_seeds_are_a_function_of_the_rollout_prompt_and_sample(tmp_path):
    from rlhfkit.trainers.online.collect import prompt_batch
    from rlhfkit.trainers.online.context import StageClock, derived_seed
    from rlhfkit.trainers.online.engine_rollout import generate_pieces, request_seeds

    # by hand: the k-th row of a prompt (rows of a prompt are consecutive) gets derived_seed("vllm", base, prompt, k)
    got = request_seeds(11, torch.tensor([5, 5, 5, 7, 7]))
    assert got == [
        derived_seed("vllm", 11, p, k) % 2**63 for p, k in [(5, 0), (5, 1), (5, 2), (7, 0), (7, 1)]
    ]
    assert len(set(got)) == 5

    seen = []

    class FakeEngine:  # records the seeds each piece is sampled with
        def load_weights(self, model):
            pass

        def generate(self, prompt_ids, prompt_mask, *, seeds, **kwargs):
            seen.extend(seeds)

    paths = write_online_problem(tmp_path, reward_model=False)
    ctx = make_context(online_config(paths, tmp_path / "a", "online.group_size=3", kind="grpo"))
    ctx = dataclasses.replace(ctx, engine=FakeEngine())
    examples = [
        {"prompt_ids": ctx.tokenizer(p)["input_ids"], "record": {"prompt": p}}
        for p in ("a", "b cat", "c", "d")
    ]
    batch = prompt_batch(ctx, examples, 1)
    rows = batch["group_ids"].shape[0]
    assert rows > 5
    draws = {}
    for sampling_seed, size in (
        (1, rows),
        (1, 5),
        (2, rows),
    ):  # pieces of 5 rows: the same seeds as one piece
        seen.clear()
        torch.manual_seed(sampling_seed)  # the loop seeds this from (run seed, rollout, process)
        generate_pieces(ctx, batch, size, StageClock(), None)
        draws[sampling_seed, size] = list(seen)
    torch.manual_seed(1)
    base = int(torch.randint(2**62, (1,)))
    assert draws[1, rows] == request_seeds(base, batch["group_ids"]) == draws[1, 5]
    assert len(set(draws[1, rows])) == rows and set(draws[1, rows]).isdisjoint(draws[2, rows])


class RecordingEngine(CopyEngine):
    """A :class:`CopyEngine` that keeps what each of its calls handed back (its tokens and mask)."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def generate(self, prompt_ids, prompt_mask, *, seeds, **kwargs):
        out = super().generate(prompt_ids, prompt_mask, seeds=seeds, **kwargs)
        self.outputs.append((out.response_ids.clone(), out.mask.clone()))
        return out


def _capture_updates(monkeypatch):
    """The rollouts the update trains on, as it gets them (a list filled as the run goes)."""
    import copy

    import rlhfkit.trainers.online.loop as loop
    from rlhfkit.trainers.online.ppo_update import ppo_update

    seen = []

    def capture(ctx, rollout, step, **kwargs):
        seen.append((copy.deepcopy(rollout), ctx.roles.teacher, ctx.sampling))
        return ppo_update(ctx, rollout, step, **kwargs)

    monkeypatch.setattr(loop, "ppo_update", capture)
    return seen


def _check_teacher_read(rollouts, engine_outputs=None):
    """Each rollout's teacher log-probs are a hand read of its rows; with ``engine_outputs``, those rows hold
    the engine's tokens (one generate call per rollout)."""
    from tests.trainers.online.test_distill import teacher_logprobs_by_hand

    for k, (rollout, teacher, sampling) in enumerate(rollouts):
        mask = rollout.mask
        assert mask.any() and rollout.teacher_logprobs is not None
        if engine_outputs is not None:
            ids, engine_mask = engine_outputs[k]
            width = mask.shape[1]
            assert torch.equal(engine_mask[:, :width], rollout.response_mask)
            assert torch.equal(ids[:, :width][mask], rollout.response_ids[mask])
        expected = teacher_logprobs_by_hand(teacher, rollout, sampling)
        torch.testing.assert_close(rollout.teacher_logprobs, expected, atol=1e-5, rtol=1e-5)


def test_distill_with_an_engine_grades_the_engines_tokens(tmp_path, monkeypatch):
    """`train distill` with online.generation_backend=vllm (an engine in vLLM's place): the teacher reads the
    tokens the engine sampled, and the run logs the teacher's term beside the engine's log-prob gap."""
    import rlhfkit.trainers.online.loop as loop
    from rlhfkit.engine.metrics_writer import read_metrics
    from rlhfkit.trainers.online import train
    from tests.trainers.online.test_distill import distill_overrides, write_teacher

    engine = RecordingEngine()
    monkeypatch.setattr(loop, "start_engine", lambda cfg, actor, episodes=None: engine)
    seen = _capture_updates(monkeypatch)
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths)
    out = tmp_path / "run"
    cfg = load_config(None, distill_overrides(paths, out, teacher_dir, *VLLM, "train.max_steps=2"), "distill")
    train(cfg)
    assert engine.calls == 2 and len(seen) == 2
    _check_teacher_read(seen, engine.outputs)
    rows = read_metrics(out / "metrics.jsonl")
    assert all(r["distill/teacher_kl"] != 0 and r["generation/logprob_gap/mean"] < 1e-4 for r in rows)


@needs_vllm
def test_distill_with_vllm_grades_the_engines_tokens(tmp_path, monkeypatch):
    """The same with vLLM itself sampling the student's responses."""
    from rlhfkit.engine.metrics_writer import read_metrics
    from rlhfkit.rollout.vllm_engine import VLLMEngine
    from tests.trainers.online.test_distill import cli, distill_overrides, write_teacher

    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    outputs = []
    real = VLLMEngine.generate

    def recorded(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        outputs.append((out.response_ids.clone(), out.mask.clone()))
        return out

    monkeypatch.setattr(VLLMEngine, "generate", recorded)
    seen = _capture_updates(monkeypatch)
    paths = engine_problem(tmp_path)
    teacher_dir = write_teacher(tmp_path, paths, sharpness=30.0)
    out = tmp_path / "run"
    assert cli(out, *distill_overrides(paths, out, teacher_dir, *VLLM, "train.max_steps=2")) == 0
    assert len(outputs) == len(seen) == 2
    _check_teacher_read(seen, outputs)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # a float32 engine on the actor's weights: its log-probs are the trainer's
        assert r["distill/teacher_kl"] != 0 and 0 <= r["generation/logprob_gap/mean"] < 1e-4
