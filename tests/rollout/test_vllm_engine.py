"""The vLLM generation engine (rlhfkit.rollout.vllm_engine): greedy tokens equal Hugging Face generate's on
the current weights after updates (synced in place, long prompts so that cached prompt blocks would show),
LoRA merged, per-request seeds, the engine's log-probs equal to the trainer's, the head-size refusal.

The tests that start an engine run where vLLM is importable (``./setup.sh vllm``) and are skipped otherwise
with that reason; the refusal needs no vLLM."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from rlhfkit.errors import ConfigError
from rlhfkit.models import response_logits, sampled_logprobs, sampling_for
from rlhfkit.rollout import generate_responses
from rlhfkit.rollout.vllm_engine import (
    EngineSettings,
    VLLMEngine,
    check_engine_can_run,
    engine_responses,
    head_size,
)
from tests.helpers import tiny_llama

needs_vllm = (
    pytest.mark.skipif(  # CI sets RLHFKIT_REQUIRE_VLLM=1 where it installed vLLM: never skipped there
        importlib.util.find_spec("vllm") is None and not os.environ.get("RLHFKIT_REQUIRE_VLLM"),
        reason="vLLM is not installed (./setup.sh vllm, or pip install 'rlhfkit[vllm]')",
    )
)

# head size 64 / 2 = 32, one that vLLM's CPU attention runs
ENGINE_MODEL = dict(
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=128,
    max_position_embeddings=256,
)
VOCAB, PAD, EOS = 64, 3, 2


def engine_model(seed: int = 0):
    return tiny_llama(seed=seed, vocab_size=VOCAB, **ENGINE_MODEL).float()


def prompts(rows: int = 4, length: int = 140, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts longer than a KV-cache block (128 tokens on CPU), so that prompt blocks cached under
    earlier weights would be reused if the sync did not drop them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = PAD, 0
    return ids, mask


def generation(greedy: bool) -> dict:
    return dict(
        max_new_tokens=12,
        stop_token_ids=[EOS],
        pad_token_id=PAD,
        sampling=sampling_for(PAD, [EOS], temperature=0.7),
        greedy=greedy,
    )


def update(model: torch.nn.Module, steps: int = 3, lr: float = 3e-2, seed: int = 1) -> None:
    """A few AdamW steps of next-token loss on random text: the weights move as in training."""
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        ids = torch.randint(4, VOCAB, (4, 20), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.fixture(scope="module")
def engine_and_model():
    model = engine_model()
    engine = VLLMEngine(model, EngineSettings("float32", 1, "auto", 160, seed=0))
    yield engine, model
    engine.close()  # vLLM's process group goes with it: a later engine of this process starts clean


def test_a_head_size_the_cpu_attention_lacks_is_refused_naming_it():
    small = tiny_llama(vocab_size=VOCAB)  # hidden 32 / 4 heads: head size 8
    assert head_size(small.config) == 8
    with pytest.raises(
        ConfigError, match=r"model.name_or_path=x has attention head size 8.*generation_backend=hf"
    ):
        check_engine_can_run(small.config, "model.name_or_path=x", on_cpu=True)
    check_engine_can_run(engine_model().config, "m", on_cpu=True)  # 32 runs
    with pytest.raises(ConfigError, match="head size 8"):  # before anything is handed to vLLM
        VLLMEngine(small, EngineSettings("float32", 1, "auto", 64))


def _completion(token_ids: list[int], logprob: float = -0.5) -> SimpleNamespace:
    """A vLLM ``CompletionOutput`` as rlhfkit reads it: the ids and, per token, {id: entry with .logprob}."""
    return SimpleNamespace(
        token_ids=token_ids, logprobs=[{t: SimpleNamespace(logprob=logprob)} for t in token_ids]
    )


@pytest.mark.parametrize("pad", [PAD, EOS])
def test_a_completion_cut_by_the_engines_length_cap_is_masked_by_what_the_engine_produced(pad):
    """The engine stops a request whose prompt + response reaches its max_model_len: fewer than R tokens and no
    stop token. Its filler is outside the mask and the row is not ended, also when pad == EOS (the filler
    would otherwise read as a stop token and count as an ending the model never produced)."""
    ids, mask = prompts(rows=3, length=4)
    completions = [
        _completion([5, 6, 7]),  # cut by the cap after 3 of 6 tokens: no stop token
        _completion([5, EOS]),  # stopped by the model
        _completion([5, 6, 7, 8, 9, 10]),  # all R tokens, no stop: response_length reached
    ]
    out = engine_responses(ids, mask, completions, max_new_tokens=6, stop_token_ids=[EOS], pad_token_id=pad)
    assert out.mask.sum(1).tolist() == [3, 2, 6]
    assert out.ended.tolist() == [False, True, False]
    assert out.response_ids[0].tolist() == [5, 6, 7, pad, pad, pad]
    assert torch.equal(out.attention_mask[:, 4:], out.mask.long())
    assert out.sampled_logprobs.sum(1).tolist() == [-1.5, -1.0, -3.0]  # 0 outside the mask


@needs_vllm
def test_greedy_tokens_equal_hf_on_the_current_weights_after_updates(engine_and_model):
    engine, model = engine_and_model
    ids, mask = prompts()
    engine.load_weights(model)
    before = engine.generate(ids, mask, seeds=[0, 1, 2, 3], **generation(True))
    assert torch.equal(
        before.response_ids, generate_responses(model, ids, mask, **generation(True)).response_ids
    )
    for _ in range(3):  # several updates, each synced before generating
        update(model)
        engine.load_weights(model)
        hf = generate_responses(model, ids, mask, **generation(True))
        out = engine.generate(ids, mask, seeds=[0, 1, 2, 3], **generation(True))
        assert torch.equal(out.response_ids, hf.response_ids)
        assert torch.equal(out.mask, hf.mask) and torch.equal(out.ended, hf.ended)
    # the weights did move: the tokens of the first sync would not pass for the last ones
    assert not torch.equal(before.response_ids, out.response_ids)


@needs_vllm
@pytest.mark.parametrize("pad", [PAD, EOS])
def test_the_engine_cut_at_its_max_model_len_trains_no_filler(engine_and_model, pad):
    """Prompts of 150 and 155 tokens and 12 new tokens against the engine's max_model_len of 160: the engine
    returns 10 and 5 tokens without a stop token. Only those are in the mask, no row is ended (pad == EOS too),
    and the engine's log-probs there are the trainer's (the filler, 0 on the engine's side, would read as a
    gap of nats: the stale-weights stop)."""
    engine, model = engine_and_model
    engine.load_weights(model)
    ids, mask = prompts(rows=4, length=155, seed=2)  # row 0: 150 real tokens
    kwargs = {**generation(False), "pad_token_id": pad}
    out = engine.generate(ids, mask, seeds=[0, 1, 2, 3], **kwargs)
    assert out.mask.sum(1).tolist() == [10, 5, 5, 5] and not out.ended.any()
    with torch.no_grad():
        logits = response_logits(model, out.input_ids, out.attention_mask, out.response_start)
        trainer = sampled_logprobs(logits, out.response_ids, kwargs["sampling"])  # (B, R)
    assert float((trainer - out.sampled_logprobs).abs()[out.mask].max()) < 1e-4


@needs_vllm
def test_without_the_sync_the_engine_keeps_the_old_tokens(engine_and_model):
    engine, model = engine_and_model
    ids, mask = prompts(seed=3)
    engine.load_weights(model)
    old = engine.generate(ids, mask, seeds=[0, 1, 2, 3], **generation(True))
    update(model, steps=4, lr=5e-2, seed=7)
    stale = engine.generate(ids, mask, seeds=[0, 1, 2, 3], **generation(True))
    assert torch.equal(stale.response_ids, old.response_ids)
    hf = generate_responses(model, ids, mask, **generation(True))
    assert not torch.equal(stale.response_ids, hf.response_ids)


@needs_vllm
def test_engine_logprobs_equal_the_trainers_and_seeds_reproduce(engine_and_model):
    engine, model = engine_and_model
    engine.load_weights(model)
    ids, mask = prompts(rows=6, seed=5)
    kwargs = generation(False)
    a = engine.generate(ids, mask, seeds=[10, 11, 12, 13, 14, 15], **kwargs)
    b = engine.generate(ids, mask, seeds=[10, 11, 12, 13, 14, 15], **kwargs)
    c = engine.generate(ids, mask, seeds=[20, 21, 22, 23, 24, 25], **kwargs)
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)
    # a request's tokens depend on its own seed, not on the rest of the batch
    alone = engine.generate(ids[2:3], mask[2:3], seeds=[12], **kwargs)
    assert torch.equal(alone.response_ids, a.response_ids[2:3])
    with torch.no_grad():
        logits = response_logits(model, a.input_ids, a.attention_mask, a.response_start)
        trainer = sampled_logprobs(logits, a.response_ids, kwargs["sampling"])  # (B, R)
    gap = (trainer - a.sampled_logprobs).abs()[a.mask]
    assert gap.numel() > 0 and float(gap.max()) < 1e-4
    assert bool((a.sampled_logprobs[~a.mask] == 0).all())
    assert not bool((a.response_ids == PAD).logical_and(a.mask).any())  # the pad is suppressed


@needs_vllm
def test_lora_actor_is_served_merged(engine_and_model):
    from rlhfkit.models.lora import add_lora

    engine, _ = engine_and_model
    base = engine_model(seed=4)
    actor = add_lora(base, rank=4, alpha=16)
    update(actor, steps=3, lr=5e-2)
    engine.load_weights(actor)
    ids, mask = prompts(seed=9)
    hf = generate_responses(actor, ids, mask, **generation(True))
    out = engine.generate(ids, mask, seeds=[0, 1, 2, 3], **generation(True))
    assert torch.equal(out.response_ids, hf.response_ids)


@needs_vllm
def test_the_engine_sampler_is_a_drop_in_for_generate_responses(engine_and_model):
    from rlhfkit.rollout.vllm_engine import engine_generate, row_seeds

    engine, model = engine_and_model
    engine.load_weights(model)
    sampler = engine_generate(engine)
    ids, mask = prompts(seed=11)
    hf = generate_responses(model, ids, mask, **generation(True))
    out = sampler(model, ids, mask, **generation(True))
    assert torch.equal(out.response_ids, hf.response_ids) and torch.equal(out.ended, hf.ended)
    # sampling: the request seeds come from the seeded global generator, one per row
    draws = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        draws.append(sampler(model, ids, mask, **generation(False)).response_ids)
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    torch.manual_seed(5)
    base = int(torch.randint(2**62, (1,)))
    by_hand = engine.generate(ids, mask, seeds=row_seeds(base, 4), **generation(False))
    assert torch.equal(by_hand.response_ids, draws[0])
    assert len(set(row_seeds(base, 4))) == 4 and row_seeds(base, 4) == row_seeds(base, 4)


@needs_vllm
def test_vllm_logs_to_stdout_as_it_is_when_it_writes(engine_and_model, capsys):
    """vLLM's log handler writes to the current sys.stdout, not to the one of the moment vLLM configured its
    logging: a stream replaced for a while and closed (as pytest's capture is after each test) must not
    leave vLLM writing to a closed file ("--- Logging error ---", which made test order matter)."""
    import contextlib
    import io
    import logging

    logger = logging.getLogger("vllm.rlhfkit_probe")  # under vLLM's own logger and handler
    for text in ("first", "second"):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            logger.warning("probe %s", text)
        assert f"probe {text}" in buffer.getvalue()
        buffer.close()
    logger.warning("probe after")
    out, err = capsys.readouterr()
    assert "probe after" in out and "Logging error" not in err


@needs_vllm
def test_a_call_whose_prompts_exceed_a_steps_token_budget_samples_as_row_by_row(engine_and_model):
    """32 seeded prompts of 140 tokens (4,480 tokens, more than the 4,096 a CPU engine schedules in one step):
    a prefill vLLM would split across steps makes it rewind the request's generator, which a CPU generator
    cannot do (RuntimeError: "CPU Generator does not use offset"). The call completes, and each row's tokens
    are the ones it draws alone."""
    engine, model = engine_and_model
    engine.load_weights(model)
    ids, mask = prompts(rows=32, seed=7)
    seeds = list(range(100, 132))
    kwargs = generation(False)
    out = engine.generate(ids, mask, seeds=seeds, **kwargs)
    for row in (0, 17, 31):
        alone = engine.generate(ids[row : row + 1], mask[row : row + 1], seeds=[seeds[row]], **kwargs)
        assert torch.equal(alone.response_ids, out.response_ids[row : row + 1])
