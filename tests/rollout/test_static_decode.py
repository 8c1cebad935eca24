"""Decoding over a static key / value cache, eager and compiled (rlhfkit.models.static_decode): the same tokens as
the growing cache, greedy and sampled, on several architectures, with LoRA, in fp32 and bf16; the random
generator left in the same state; a model that cannot take a static cache falls back with one logged line; the
compiled step compiles once for prompts of other lengths."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

import rlhfkit.models.static_decode as static_decode
from rlhfkit.config.sections import ModelConfig
from rlhfkit.models import sampling_for
from rlhfkit.models.lora import prepare_trained
from rlhfkit.models.precision import autocast_forward, float32_attention_on_cpu
from rlhfkit.models.static_decode import bucketed_capacity, decode_of, set_decode, static_unsupported
from rlhfkit.rollout import generate_responses
from tests.models.tiny_architectures import bpe_tokenizer, tiny_config

R = 10


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


def _model(name, tokenizer, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(name, tokenizer, **overrides)).eval()


def _prompts(tokenizer, columns=6, seed=1):
    """Three distinct prompts twice each (GRPO's groups: the shared prompt cache fills the static one), the
    first two rows left padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (3, columns), generator=g).repeat_interleave(2, 0)
    mask = torch.ones_like(ids)
    mask[:2, :2] = 0
    ids[:2, :2] = tokenizer.pad_token_id
    return ids, mask


def _sample(model, tokenizer, decode, greedy, ids=None, mask=None, seed=0, max_new_tokens=R):
    if ids is None:
        ids, mask = _prompts(tokenizer)
    torch.manual_seed(seed)
    out = generate_responses(
        model,
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        stop_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        sampling=sampling_for(tokenizer.pad_token_id, [tokenizer.eos_token_id], temperature=1.0),
        greedy=greedy,
        return_logprobs=True,
        decode=decode,
    )
    return out, torch.rand(4)  # what the generator draws next: the same only if generate drew the same


def _spy_static_cache(monkeypatch) -> list:
    """A list that gets an entry at every call of generate's ``static_cache``."""
    calls = []
    real = static_decode.static_cache

    def spy(*args, **kwargs):
        calls.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr("rlhfkit.rollout.generation.static_cache", spy)
    return calls


def _eager_compile(monkeypatch) -> None:
    """The compiled decode with dynamo's capture and no code generation (inductor takes tens of seconds)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, backend="eager", mode=None)
    config._compile_all_devices = True
    monkeypatch.setattr(static_decode, "_compile_config", lambda: config)
    torch._dynamo.reset()


def _assert_same(a, b, tol=1e-5):
    (first, after_first), (second, after_second) = a, b
    assert torch.equal(first.response_ids, second.response_ids)
    assert torch.equal(first.mask, second.mask)
    assert torch.equal(after_first, after_second)
    assert (first.sampled_logprobs - second.sampled_logprobs).abs().max() <= tol


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3", "gemma", "phi3", "qwen2_moe", "opt"])
@pytest.mark.parametrize("greedy", [True, False])
def test_static_cache_gives_the_dynamic_cache_tokens(tokenizer, name, greedy):
    model = _model(name, tokenizer)
    assert static_unsupported(model) is None
    _assert_same(_sample(model, tokenizer, "dynamic", greedy), _sample(model, tokenizer, "static", greedy))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_distinct_prompts_fill_the_static_cache_in_generates_own_prefill(tokenizer, name):
    """No prompt repeats (evaluation, ``rlhfkit generate``): no shared prompt cache, the static cache starts
    empty and ``generate``'s prefill writes every prompt column."""
    model = _model(name, tokenizer)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 300, (4, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids[0, :3] = tokenizer.pad_token_id
    for greedy in (True, False):
        _assert_same(
            _sample(model, tokenizer, "dynamic", greedy, ids, mask),
            _sample(model, tokenizer, "static", greedy, ids, mask),
        )


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("greedy", [True, False])
def test_static_cache_with_lora_in_fp32_and_bf16(tokenizer, dtype, greedy):
    model = _model("llama", tokenizer, attn_implementation="sdpa")
    if dtype is not None:
        model = float32_attention_on_cpu(autocast_forward(model, dtype))
    model = prepare_trained(model, ModelConfig(lora_rank=4, lora_alpha=8))
    with torch.no_grad():  # lora_B starts at zero: a non-zero update, merged for sampling
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.eval()
    tol = 1e-5 if dtype is None else 1e-2  # bf16: the log-probs of two roundings of the same tokens
    dynamic = _sample(model, tokenizer, "dynamic", greedy)
    _assert_same(dynamic, _sample(model, tokenizer, "static", greedy), tol)
    if not greedy:  # the draws depend on the seed: equal tokens are not the same argmax by chance
        other = _sample(model, tokenizer, "dynamic", greedy, seed=7)[0]
        assert not torch.equal(dynamic[0].response_ids, other.response_ids)


def test_the_models_decode_is_used_and_carried_through_wrappers(tokenizer, monkeypatch):
    """``set_decode`` on a LoRA actor (online.hf_decode) reaches every generate call made without ``decode``."""
    model = prepare_trained(_model("llama", tokenizer), ModelConfig(lora_rank=4, lora_alpha=8))
    assert decode_of(model) == "dynamic"
    seen = _spy_static_cache(monkeypatch)
    _sample(model, tokenizer, None, greedy=True)
    assert seen == []
    set_decode(model, "static")
    assert decode_of(model) == "static"
    _sample(model, tokenizer, None, greedy=True)
    assert seen == [True]
    with pytest.raises(ValueError, match="decode must be one of"):
        set_decode(model, "fast")


@pytest.mark.parametrize("name", ["gemma2", "falcon_h1"])
def test_a_model_without_a_plain_static_cache_falls_back_with_one_logged_line(tokenizer, name, caplog):
    model = _model(name, tokenizer)
    reason = static_unsupported(model)
    assert reason is not None and ("sliding window or recurrent" in reason or "recurrent" in reason)
    static_decode._log_fallback_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="rlhfkit.models.static_decode"):
        static = _sample(model, tokenizer, "static", greedy=False)
        _sample(model, tokenizer, "static", greedy=False)
    lines = [r.getMessage() for r in caplog.records if "hf_decode" in r.getMessage()]
    assert len(lines) == 1 and type(model).__name__ in lines[0]
    _assert_same(_sample(model, tokenizer, "dynamic", greedy=False), static)


def test_capacity_is_bucketed():
    assert [bucketed_capacity(n) for n in (1, 64, 65, 130)] == [64, 64, 128, 192]


def test_compiled_step_compiles_once_across_prompt_lengths(tokenizer, monkeypatch):
    """The compiled decode (dynamo's capture; the eager backend here, to keep the test fast) gives the dynamic
    tokens, and a later call with a prompt of another length in the same capacity bucket reuses the graph."""
    from torch._dynamo.utils import counters

    _eager_compile(monkeypatch)
    counters.clear()
    model = _model("llama", tokenizer)
    for columns in (6, 9):
        ids, mask = _prompts(tokenizer, columns)
        for greedy in (True, False):
            _assert_same(
                _sample(model, tokenizer, "dynamic", greedy, ids, mask),
                _sample(model, tokenizer, "compiled", greedy, ids, mask),
            )
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"]
    torch._dynamo.reset()


def test_a_grpo_run_with_a_static_cache_logs_the_dynamic_runs_figures(tmp_path, monkeypatch):
    """online.hf_decode reaches the trainer's sampler (the actor's decode) and leaves the run unchanged: the same
    responses, so the same scores, KL, log-prob statistics and losses, rollout after rollout (the first rollout's
    update changes the weights the second samples from: the compiled step must read the new ones)."""
    from rlhfkit.cli import main
    from rlhfkit.engine.metrics_writer import read_metrics
    from tests.trainers.online.online_fixtures import online_cli_args, write_online_problem

    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path, reward_model=False)
    used = _spy_static_cache(monkeypatch)
    figures = {}
    _eager_compile(monkeypatch)
    for decode in ("dynamic", "static", "compiled"):
        used.clear()
        out = tmp_path / decode
        args = online_cli_args(paths, out, "train.max_steps=2", f"online.hf_decode={decode}", kind="grpo")
        assert main(args) == 0
        rows = read_metrics(out / "metrics.jsonl")
        figures[decode] = [
            {k: v for k, v in row.items() if not k.startswith("time/") and "per_second" not in k}
            for row in rows
        ]
        assert bool(used) == (decode != "dynamic")
    assert len(figures["dynamic"]) == 2
    assert figures["static"] == figures["dynamic"] and figures["compiled"] == figures["dynamic"]
    torch._dynamo.reset()


@pytest.mark.parametrize("decode", ["static", "compiled"])
def test_a_prompt_and_response_across_a_capacity_bucket_give_the_dynamic_tokens(
    tokenizer, decode, monkeypatch
):
    """A prompt of 40 columns and 40 new tokens cross the first 64-position bucket (the static cache holds 128):
    a capacity computed without the prompt's columns would run out of cache here. Under the exact sampler
    (the default) the static and compiled decodes give the dynamic tokens, greedy and sampled."""
    _eager_compile(monkeypatch)
    model = _model("llama", tokenizer)
    columns, new = 40, 40
    assert bucketed_capacity(new) < columns + new <= bucketed_capacity(columns + new)
    ids, mask = _prompts(tokenizer, columns)
    for greedy in (True, False):
        dynamic = _sample(model, tokenizer, "dynamic", greedy, ids, mask, max_new_tokens=new)
        assert int(dynamic[0].mask.sum(1).max()) > bucketed_capacity(new) - columns  # past the first bucket
        _assert_same(dynamic, _sample(model, tokenizer, decode, greedy, ids, mask, max_new_tokens=new))
    torch._dynamo.reset()


def test_static_and_compiled_give_the_dynamic_tokens_under_the_multinomial_draw_too(tokenizer, monkeypatch):
    """``online.sampler=multinomial`` (generate's torch.multinomial) through the three decodes."""
    from rlhfkit.models.sampler import set_sampler

    _eager_compile(monkeypatch)
    model = set_sampler(_model("llama", tokenizer), "multinomial")
    dynamic = _sample(model, tokenizer, "dynamic", greedy=False)
    for decode in ("static", "compiled"):
        _assert_same(dynamic, _sample(model, tokenizer, decode, greedy=False))
    torch._dynamo.reset()
