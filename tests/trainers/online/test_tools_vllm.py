"""Multi-turn episodes with tools on the vllm backend (``online.generation_backend=vllm`` with ``online.tools``):
each turn goes to the engine as the row's own ids (a token-id prompt, never text encoded again) and stops at
EOS or the tool-call end marker, so greedy episodes with the same tool results give the rows that Hugging Face
generate gives; a GRPO run with tools samples its episodes from the engine, keeps the engine's log-probs on
the model's tokens only and logs the log-prob gap.

The policies are tiny models taught in a few seconds to play the episodes (call the calculator, then answer
with its result), so that the episodes have tool turns whose results the next turn reads. The tests that start
an engine run where vLLM is importable (``./setup.sh vllm``) and are skipped otherwise, with that reason."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from rlhfkit.config import load_config
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.errors import ConfigError
from rlhfkit.models import load_tokenizer
from rlhfkit.rollout.episodes import EpisodeRunner, run_episodes
from rlhfkit.rollout.samples import read_samples
from rlhfkit.tasks.calculator import call_text, parse_prompt
from rlhfkit.trainers.online import collect
from tests.helpers import tiny_llama
from tests.helpers_tools import tool_tokenizer
from tests.rollout.test_episodes import runner_for
from tests.trainers.online.test_tools_online import base_overrides, run_capturing, write_tools_problem

needs_vllm = (
    pytest.mark.skipif(  # CI sets RLHFKIT_REQUIRE_VLLM=1 where it installed vLLM: never skipped there
        importlib.util.find_spec("vllm") is None and not os.environ.get("RLHFKIT_REQUIRE_VLLM"),
        reason="vLLM is not installed (./setup.sh vllm, or pip install 'rlhfkit[vllm]')",
    )
)
# head size 64 / 2 = 32, one that vLLM's CPU attention runs
ENGINE_MODEL = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)
PROMPTS = ["What is 12*34?", "What is 7*8?", "What is 5*6?"]


def tools_overrides(paths, out, *extra) -> list[str]:
    """A small GRPO run with the calculator tool and the task's gold scorer, 2 rollouts."""
    return [
        *base_overrides(paths, out),
        "online.tools=[rlhfkit.tasks.calculator:calculator]",
        "online.reward_functions=[rlhfkit.tasks.calculator:correct_answer_reward]",
        "online.response_length=48",
        "online.max_turns=3",
        "data.max_prompt_length=32",
        "train.max_steps=2",
        *extra,
    ]


def demonstration(runner: EpisodeRunner, prompt: str, call: str) -> list[int]:
    """The ids of a whole episode that calls the tool with ``call`` (its text) and answers with the result,
    played through the runner as a sampler would (so the tool results and the template's text are the real
    ones)."""
    episode = runner.start(prompt, {})
    runner.play_turn(episode, runner.encode(call), last_turn=False)
    result = episode.record.calls[0]["result"]
    runner.play_turn(episode, runner.encode(f"answer={result}") + [runner.stop_token_ids[0]], last_turn=False)
    return episode.prompt_ids + episode.ids


def taught_model(tokenizer, rows: list[list[int]], steps: int = 150):
    """A tiny Llama (head size 32) that has learnt ``rows`` by heart (next-token loss on each whole row)."""
    model = tiny_llama(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=256,
        **ENGINE_MODEL,
    ).float()
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attn = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], attn[i, : len(row)] = torch.tensor(row), 1
    labels = ids.masked_fill(attn == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def test_vllm_with_tools_is_accepted_by_the_config(tmp_path):
    paths = write_tools_problem(tmp_path)
    cfg = load_config(
        None, tools_overrides(paths, tmp_path / "run", "online.generation_backend=vllm"), "grpo"
    )
    assert cfg.online.generation_backend == "vllm" and cfg.online.tools


@needs_vllm
def test_greedy_episodes_give_the_same_rows_on_hf_and_vllm():
    from rlhfkit.rollout.vllm_engine import EngineSettings, VLLMEngine, engine_generate

    tok = tool_tokenizer()
    runner = runner_for(tok, response_length=120)
    calls = [
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{p[8:-1]}"}}}}\n</tool_call>'
        for p in PROMPTS
    ]
    model = taught_model(tok, [demonstration(runner, p, c) for p, c in zip(PROMPTS, calls, strict=True)])
    hf = run_episodes(runner, model, PROMPTS, greedy=True)
    engine = VLLMEngine(model, EngineSettings("float32", 1, "auto", 256, seed=0))
    sent = []
    generate = engine.llm.generate

    def recording(requests, params, **kwargs):
        sent.append([list(r["prompt_token_ids"]) for r in requests])
        return generate(requests, params, **kwargs)

    engine.llm.generate = recording
    try:
        vllm = run_episodes(runner, model, PROMPTS, greedy=True, generate=engine_generate(engine))
        too_long = torch.full((1, 256), 5)  # a row that fills the engine's max_model_len: named, not sent
        with pytest.raises(ConfigError, match="online.vllm_max_model_len: a prompt of 256 tokens"):
            engine.generate(
                too_long,
                torch.ones_like(too_long),
                max_new_tokens=4,
                stop_token_ids=runner.turn_stops,
                pad_token_id=runner.pad_token_id,
                sampling=runner.sampling,
                seeds=[0],
            )
    finally:
        engine.close()
    # the episodes have tool turns that the model answered after reading the results
    for record in hf.records:
        assert record.calls and all(c["error"] is None for c in record.calls)
        assert record.model_turns >= 2 and record.turns[-1]["text"].startswith("answer=")
    for name in ("query_ids", "query_mask", "response_ids", "mask", "response_mask", "ended", "truncated"):
        assert torch.equal(getattr(hf, name), getattr(vllm, name)), name
    assert [r.turns for r in hf.records] == [r.turns for r in vllm.records]
    assert len(sent) == 2  # one engine call per turn over the active episodes
    # each turn's request is the row so far, token for token: a prefix of the trained row that ends right
    # before a model token
    for turn in sent:
        for request in turn:
            matches = []
            for i in range(len(PROMPTS)):
                prompt = hf.query_ids[i][hf.query_mask[i].bool()].tolist()
                row = prompt + hf.response_ids[i][hf.response_mask[i]].tolist()
                cut = len(request) - len(prompt)
                if row[: len(request)] == request and cut >= 0 and bool(hf.mask[i, cut]):
                    matches.append(i)
            assert len(matches) == 1, request
    # the engine's log-probs ride along on the model's tokens only (hf generate gives none)
    assert hf.sampled_logprobs is None
    assert vllm.sampled_logprobs.shape == vllm.mask.shape
    assert bool((vllm.sampled_logprobs[~vllm.mask] == 0).all())


def teach_the_tools_policy(paths) -> None:
    """Overwrite the tools problem's random policy with one (head size 32) that calls the calculator on each
    training prompt and answers with the result."""
    cfg = load_config(None, tools_overrides(paths, paths["policy"].parent / "probe"), "grpo")
    tok = load_tokenizer(str(paths["policy"]))
    runner = collect.episode_runner(cfg, tok)
    prompts = [json.loads(line)["prompt"] for line in paths["prompts"].read_text().splitlines()]
    rows = [demonstration(runner, p, call_text(parse_prompt(p))) for p in prompts]
    taught_model(tok, rows).save_pretrained(paths["policy"])


@needs_vllm
def test_grpo_with_tools_samples_its_episodes_from_the_engine(tmp_path, monkeypatch):
    paths = write_tools_problem(tmp_path)
    teach_the_tools_policy(paths)
    out = tmp_path / "run"
    cfg = load_config(
        None,
        tools_overrides(
            paths,
            out,
            "online.generation_backend=vllm",
            "online.vllm_max_model_len=96",
            "logging.samples_per_step=4",
        ),
        "grpo",
    )

    def hf_generate(*args, **kwargs):
        raise AssertionError("Hugging Face generate was called under generation_backend=vllm")

    seen, _ = run_capturing(monkeypatch, cfg, sampler=hf_generate)
    assert len(seen) == 2  # every turn from the engine
    for rollout in seen:
        tool_tokens = rollout.response_mask & ~rollout.mask
        assert tool_tokens.any()  # episodes with tool results between the model's turns
        assert bool((rollout.engine_logprobs[~rollout.mask] == 0).all())
        assert bool((rollout.engine_logprobs[rollout.mask] <= 0).all())
    metrics = [row for row in read_metrics(out / "metrics.jsonl") if "loss/policy" in row]
    for row in metrics:
        assert row["tools/calls_per_episode"] > 0 and row["turns/mean"] > 1
        assert 0 <= row["generation/logprob_gap/mean"] < 1e-4  # a float32 engine on the actor's weights
        assert row["time/weight_sync"] > 0
    turns = [t for s in read_samples(out / "samples.jsonl") for t in s["turns"]]
    assert any(t["role"] == "tool" and t["error"] is None for t in turns)
