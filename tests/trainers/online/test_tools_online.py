"""Online training with tools (``online.tools`` / ``online.environment``): GRPO and PPO with a critic run whole
episodes, train the model's tokens only (never the tool results between its turns), score on the last model
token, log the tool metrics and write each episode's turns to samples.jsonl.

The policy is a tiny random model, so what it "samples" is scripted (:class:`ToolSampler`, standing in for
``generate_responses`` as the other online tests do): a call of the calculator, then after the result an
answer, right or wrong at random. Every log-prob, value, KL and loss is the real model's.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.config import load_config
from rlhfkit.data import TokenLimits, prepare_examples
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.errors import ConfigError
from rlhfkit.rollout.samples import read_samples
from rlhfkit.tasks.calculator import ANSWER_PREFIX, ToolsTask, call_text, parse_prompt
from rlhfkit.trainers import online
from rlhfkit.trainers.online import collect, loop
from rlhfkit.trainers.online.collect import (
    episode_runner,
    prompt_batch,
    sample_rollout,
    score_rollout,
    take_scores,
)
from rlhfkit.trainers.online.ppo_update import ppo_update
from rlhfkit.trainers.online.shaping import estimate_advantages, shape_rollout
from tests.helpers import tiny_llama
from tests.trainers.online.online_fixtures import make_context, online_overrides, state
from tests.trainers.online.test_online import _hand_built_generation

ENV_PY = '''
class CalculatorEnv:
    """A TRL-style environment: reset with the row, a tool method, and the episode's reward."""

    def reset(self, prompt, **kwargs):
        self.prompt, self.calls = prompt, 0
        return None

    def multiply(self, a: int, b: int) -> str:
        """
        Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        self.calls += 1
        return str(a * b)

    def get_reward(self) -> float:
        return 0.25 + 0.5 * self.calls
'''


def write_tools_problem(root):
    """The ``tools`` task's tokenizer (with its chat template), a tiny random policy on it, prompts, and a
    TRL-style environment in ``env.py``."""
    root.mkdir(parents=True, exist_ok=True)
    task = ToolsTask(seed=0, num_train_prompts=8, num_eval_prompts=2)
    tokenizer = task.build_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    paths = {"policy": root / "policy", "prompts": root / "prompts.jsonl", "env": root / "env.py"}
    model.save_pretrained(paths["policy"])
    tokenizer.save_pretrained(paths["policy"])
    paths["prompts"].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in task.prompts("train")))
    paths["env"].write_text(ENV_PY)
    return paths


def base_overrides(paths, out) -> list[str]:
    """The small online run of the other online tests, on this problem, without its reward functions."""
    settings = online_overrides({"policy": paths["policy"], "prompts": paths["prompts"], "rewards": "-"}, out)
    return [s for s in settings if not s.startswith("online.reward_functions")]


def tools_overrides(paths, out, *extra) -> list[str]:
    """dotted.key=value settings of a small run with the calculator tool and the task's gold scorer, 2 rollouts."""
    settings = [
        "online.tools=[rlhfkit.tasks.calculator:calculator]",
        "online.reward_functions=[rlhfkit.tasks.calculator:correct_answer_reward]",
        "online.response_length=48",
        "online.max_turns=3",
        "online.kl_coef=0.1",
        "data.max_prompt_length=32",
        "train.max_steps=2",
        *extra,
    ]
    return [*base_overrides(paths, out), *settings]


def tools_config(paths, out, *extra, kind="grpo"):
    """GRPO (or PPO with a critic) on :func:`tools_overrides`."""
    return load_config(None, tools_overrides(paths, out, *extra), kind)


class ToolSampler:
    """Stands in for ``generate_responses``: a row that has seen no tool result calls the calculator on its
    prompt's numbers (ending the turn at ``</tool_call>``), unless a draw says to answer at once; a row after
    a result answers, right or wrong by a draw, then EOS. Draws come from torch's global generator (seeded
    by the trainer per rollout). ``calls`` counts the rows that called."""

    def __init__(self, tokenizer, answer_at_once: float = 0.25):
        self.tok, self.answer_at_once, self.calls = tokenizer, answer_at_once, 0

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def right(self) -> bool:
        """Whether the next answer is right: a fair draw."""
        return float(torch.rand(())) < 0.5

    def __call__(self, model, prompt_ids, prompt_mask, *, max_new_tokens, stop_token_ids, pad_token_id, **_):
        rows = []
        for ids, mask in zip(prompt_ids, prompt_mask, strict=True):
            text = self.tok.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            problem = parse_prompt(text)
            if "<|tool|>" not in text and float(torch.rand(())) >= self.answer_at_once:
                self.calls += 1
                rows.append(self.ids(call_text(problem)))
                continue
            answer = problem.answer if self.right() else problem.answer + 1
            rows.append(self.ids(f"{ANSWER_PREFIX}{answer}") + [self.tok.eos_token_id])
        raw = [(row + [pad_token_id] * max_new_tokens)[:max_new_tokens] for row in rows]
        sample = _hand_built_generation(self.tok, raw)
        return sample(
            model, prompt_ids, prompt_mask, stop_token_ids=stop_token_ids, pad_token_id=pad_token_id
        )


def gap_text(tok, product: int) -> str:
    """What the task's template writes between a call turn (stopped at ``</tool_call>``) and the next turn."""
    return f"{tok.eos_token}\n<|tool|>{product}\n<|assistant|>"


def check_rollout_rows(tok, rollout) -> int:
    """Every row: the model mask holds exactly the sampled text (call, answer, EOS), the rest of the row
    exactly the template's tool-result text; returns how many rows called the tool."""
    called = 0
    for i in range(rollout.batch_size):
        prompt = tok.decode(
            rollout.query_ids[i][rollout.query_mask[i].bool()].tolist(), skip_special_tokens=False
        )
        problem = parse_prompt(prompt)
        assert prompt.startswith("<|system|>tools: calculator\n")  # rendered by the runner, with the tools
        ids, mask, row = rollout.response_ids[i], rollout.mask[i], rollout.response_mask[i]
        model = tok.decode(ids[mask].tolist(), skip_special_tokens=False)
        gap = tok.decode(ids[row & ~mask].tolist(), skip_special_tokens=False)
        assert model.startswith((call_text(problem), ANSWER_PREFIX)) and model.endswith(tok.eos_token)
        if model.startswith(call_text(problem)):
            called += 1
            assert gap == gap_text(tok, problem.answer)
            first_gap = int((row & ~mask).nonzero()[0])
            assert bool(mask[:first_gap].all())  # the call's tokens, then the result's
        else:
            assert gap == ""
        assert not bool(mask[~row].any())
    return called


def run_capturing(monkeypatch, cfg, sampler: ToolSampler | None = None):
    """Train ``cfg`` with the scripted sampler (a :class:`ToolSampler` unless given); returns (the rollouts the
    update trained on, the sampler)."""
    from rlhfkit.models import load_tokenizer

    sampler = sampler or ToolSampler(load_tokenizer(cfg.model.name_or_path))
    monkeypatch.setattr(collect, "generate_responses", sampler)
    seen = []

    def capture(ctx, rollout, step, **kwargs):
        seen.append(copy.deepcopy(rollout))
        return ppo_update(ctx, rollout, step, **kwargs)

    monkeypatch.setattr(loop, "ppo_update", capture)
    online.train(cfg)
    return seen, sampler


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_tool_episodes_train_the_model_tokens_only_and_are_logged(tmp_path, monkeypatch, kind):
    paths = write_tools_problem(tmp_path)
    out = tmp_path / "run"
    held_out = (
        (f"data.eval_file={paths['prompts']}",) if kind == "grpo" else ()
    )  # evaluation plays episodes too
    cfg = tools_config(paths, out, "logging.samples_per_step=4", *held_out, kind=kind)
    rollouts, sampler = run_capturing(monkeypatch, cfg)
    tok = sampler.tok
    assert len(rollouts) == 2
    called = sum(check_rollout_rows(tok, r) for r in rollouts)
    assert 0 < called <= sampler.calls  # (the held-out episodes call too)
    if kind == "ppo":
        assert rollouts[0].values is not None  # PPO with a critic: values over the model tokens only
    for r in rollouts:
        gap = r.response_mask & ~r.mask
        assert gap.any()
        for name in (
            "logprobs",
            "ref_logprobs",
            "entropy",
            "kl",
            "rewards",
            "advantages",
            "returns",
            "values",
        ):
            x = getattr(r, name)
            if x is not None:
                assert bool((x[gap] == 0).all()), name  # nothing computed for a tool token
        # the score on the last model token: rewards (+ KL) sum to the score over the model tokens
        last = r.mask.long().cumsum(1).argmax(1)
        assert torch.allclose(r.rewards.sum(1), r.scores - cfg.online.kl_coef * r.kl.sum(1), atol=1e-5)
        assert bool(r.mask[torch.arange(r.batch_size), last].all())
    logged = read_metrics(out / "metrics.jsonl")
    metrics = [row for row in logged if "loss/policy" in row]  # (the held-out evaluation before training too)
    assert len(metrics) == 2
    if held_out:  # held-out episodes, scored by the gold scorer as the training ones
        assert 0.0 <= metrics[-1]["eval/score/mean"] <= 1.0 and metrics[-1]["eval/response_length/mean"] > 20
    for row in metrics:
        assert row["tools/calls_per_episode"] > 0 and row["turns/mean"] > 1
        assert row["tools/calls/calculator"] == row["tools/calls_per_episode"]
        assert row["tools/errors"] == 0 and "tools/errors/timeout" in row
    total = (
        sum(row["tools/calls_per_episode"] for row in metrics) * cfg.train.batch_size * cfg.online.group_size
    )
    assert total == pytest.approx(called)
    samples = read_samples(out / "samples.jsonl")
    assert len(samples) == 8
    tool_turns = [t for s in samples for t in s["turns"] if t["role"] == "tool"]
    assert tool_turns and all(t["name"] == "calculator" and t["error"] is None for t in tool_turns)
    for s in samples:
        problem = parse_prompt(s["prompt"])
        assert s["turns"][0]["role"] == "assistant"
        for t in s["turns"]:
            if t["role"] == "tool":
                assert t["arguments"] == {"expression": problem.expression} and t["result"] == str(
                    problem.answer
                )


def scripted_rollout(cfg, monkeypatch, **sample):
    """One rollout of ``cfg``'s first batch with the scripted :class:`ToolSampler`: (ctx, batch, rollout)."""
    ctx = make_context(cfg)
    ctx = dataclasses.replace(ctx, episodes=episode_runner(cfg, ctx.tokenizer))
    monkeypatch.setattr(collect, "generate_responses", ToolSampler(ctx.tokenizer))
    examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(32))
    torch.manual_seed(0)
    batch = prompt_batch(ctx, examples, 1)
    return ctx, batch, sample_rollout(ctx, batch, step=1, **sample)


def test_junk_in_tool_positions_changes_no_update(tmp_path, monkeypatch):
    """The trainer's update (policy, value, KL and entropy terms, PPO with a critic) reads nothing at the tool
    tokens of a rollout: junk there gives bit-identical weights and statistics."""
    paths = write_tools_problem(tmp_path)
    cfg = tools_config(paths, tmp_path / "run", "online.ent_coef=0.01", "online.kl_in_loss=true", kind="ppo")
    ctx, batch, rollout = scripted_rollout(cfg, monkeypatch, actor_forward=True)
    take_scores(rollout, score_rollout(ctx, rollout, batch["records"], batch["episodes"]))
    shape_rollout(ctx, rollout, ctx.kl_ctl.value)
    rollout.advantages, rollout.returns = estimate_advantages(ctx, rollout)
    gap = rollout.response_mask & ~rollout.mask
    assert gap.any()
    junk = copy.deepcopy(rollout)
    for k, name in enumerate(
        ("logprobs", "ref_logprobs", "values", "rewards", "kl", "advantages", "returns", "entropy")
    ):
        setattr(junk, name, getattr(junk, name).masked_fill(gap, 37.0 + k))
    models = {name: ctx.roles.actor if name == "actor" else ctx.roles.critic for name in ctx.optimizers}
    start = {name: (state(m), copy.deepcopy(ctx.optimizers[name].state_dict())) for name, m in models.items()}

    def update(r):
        for name, (weights, opt) in start.items():
            models[name].load_state_dict(weights)
            ctx.optimizers[name].load_state_dict(copy.deepcopy(opt))
        torch.manual_seed(1)
        result = ppo_update(ctx, r, 1)
        return {name: state(m) for name, m in models.items()}, result.stats.means(ctx)

    weights, stats = update(rollout)
    junk_weights, junk_stats = update(junk)
    assert stats == junk_stats
    for name in weights:
        assert any(not torch.equal(weights[name][k], start[name][0][k]) for k in weights[name])  # it trained
        for k in weights[name]:
            assert torch.equal(weights[name][k], junk_weights[name][k]), (name, k)


def test_environment_reward_and_tools_reach_the_scores(tmp_path, monkeypatch):
    """A TRL-style environment class: its tool is offered next to online.tools, its get_reward() is added to
    the reward functions' score as the part "environment", and reward functions receive environments=."""
    paths = write_tools_problem(tmp_path)
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def seen(prompts, completions, environments, **kwargs):\n"
        "    assert all(isinstance(e.calls, int) and e.get_reward() == 0.25 + 0.5 * e.calls for e in environments)\n"
        "    assert all(isinstance(c, list) and c[0]['role'] == 'assistant' for c in completions)\n"
        "    return [1.0 for _ in prompts]\n"
    )
    cfg = tools_config(
        paths,
        tmp_path / "run",
        f"online.environment={paths['env']}:CalculatorEnv",
        f"online.reward_functions=[{rewards}:seen]",
        "train.max_steps=1",
    )
    ctx = make_context(cfg)
    ctx = dataclasses.replace(ctx, episodes=episode_runner(cfg, ctx.tokenizer))
    assert ctx.episodes.toolbox.names == ["multiply", "calculator"]
    monkeypatch.setattr(collect, "generate_responses", ToolSampler(ctx.tokenizer))
    examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(32))
    torch.manual_seed(0)
    batch = prompt_batch(ctx, examples, 1)
    rollout = sample_rollout(ctx, batch, step=1)
    scores = score_rollout(ctx, rollout, batch["records"], batch["episodes"])
    # the sampler calls calculator (not the environment's multiply): get_reward() is 0.25 for every episode
    assert torch.equal(scores.parts["environment"], torch.full((rollout.batch_size,), 0.25))
    assert torch.equal(scores.raw_scores, scores.parts["seen"] + 0.25)


def test_tools_config_errors_name_the_setting(tmp_path):
    paths = write_tools_problem(tmp_path)
    base = base_overrides(paths, tmp_path / "run")
    gold = "online.reward_functions=[rlhfkit.tasks.calculator:correct_answer_reward]"
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    return x\n")
    cfg = load_config(None, [*base, gold, f"online.tools=[{bad}:f]"], "grpo")
    with pytest.raises(ConfigError, match="online.tools.*no JSON schema"):
        online.train(cfg)
    assert not (tmp_path / "run").exists()  # refused before the run folder is written
    nothing = tmp_path / "env2.py"
    nothing.write_text("class E:\n    def reset(self, **row):\n        return None\n")
    cfg = load_config(
        None,
        [*base, f"online.environment={nothing}:E"],
        "grpo",
    )
    with pytest.raises(ConfigError, match="no get_reward"):
        online.train(cfg)


def test_a_resumed_tool_run_ends_bit_identical(tmp_path, monkeypatch):
    """Episodes are a function of (seed, step) like single-turn rollouts: two rollouts, then two more after
    --resume from the step-2 checkpoint, give the weights and metrics of four uninterrupted ones."""
    paths = write_tools_problem(tmp_path)
    monkeypatch.setattr(collect, "generate_responses", ToolSampler(ToolsTask(seed=0).build_tokenizer()))
    runs = {}
    for name, steps in (("full", 4), ("part", 2)):
        out = tmp_path / name
        online.train(tools_config(paths, out, "train.save_steps=2", f"train.max_steps={steps}", kind="ppo"))
        runs[name] = out
    online.train(
        tools_config(paths, runs["part"], "train.save_steps=2", "train.max_steps=4", kind="ppo"), resume=True
    )
    for folder in ("final", "final_critic"):
        full = load_file(str(runs["full"] / folder / "model.safetensors"))
        part = load_file(str(runs["part"] / folder / "model.safetensors"))
        assert full.keys() == part.keys()
        for key in full:
            assert torch.equal(full[key], part[key]), (folder, key)
    drop = ("time/", "tokens_per_second", "wall")
    clean = [
        {k: v for k, v in row.items() if not k.startswith(drop)}
        for row in read_metrics(runs["full"] / "metrics.jsonl")
    ]
    resumed = [
        {k: v for k, v in row.items() if not k.startswith(drop)}
        for row in read_metrics(runs["part"] / "metrics.jsonl")
    ]
    assert clean == resumed
    turns = [s["turns"] for s in read_samples(runs["full"] / "samples.jsonl")]
    assert len(turns) >= 4 and any(len(t) > 1 for t in turns)
    assert turns == [s["turns"] for s in read_samples(runs["part"] / "samples.jsonl")]


def test_the_tools_page_examples_run_as_shown(tmp_path):
    """docs/tools.md's tools list and environment class, written to files as the page names them, load as
    online.tools / online.environment and play an episode: the environment's tool changes its state, the
    result reaches the row, and get_reward scores it."""
    import re
    from pathlib import Path

    from rlhfkit.models import sampling_for
    from rlhfkit.rollout.episodes import EpisodeRunner, run_episodes
    from rlhfkit.rollout.tools import Toolbox
    from tests.helpers_tools import ScriptedSampler, char_ids, tool_tokenizer

    page = (Path(__file__).parents[3] / "docs" / "tools.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", page, re.DOTALL):
        name = block.splitlines()[0].removeprefix("# ").strip()
        (tmp_path / name).write_text(block)
    toolbox = Toolbox.load([f"{tmp_path / 'tools.py'}:multiply"], f"{tmp_path / 'env.py'}:Counter")
    assert toolbox.names == ["add", "multiply"]
    tok = tool_tokenizer()
    runner = EpisodeRunner.create(
        tok,
        toolbox,
        max_turns=3,
        response_length=200,
        tool_timeout=2.0,
        max_tool_response_length=None,
        stop_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
        sampling=sampling_for(tok.pad_token_id, [tok.eos_token_id]),
    )
    call = '<tool_call>\n{"name": "add", "arguments": {"amount": 3}}\n</tool_call>'
    sampler = ScriptedSampler([[char_ids(tok, call)], [char_ids(tok, "done</s>")]])
    episodes = run_episodes(
        runner, torch.nn.Linear(1, 1), ["count"], [{"prompt": "count", "target": 3}], generate=sampler
    )
    assert episodes.records[0].calls[0]["result"] == "3"
    assert episodes.environment_scores() == [1.0]


def test_a_lora_policy_trains_on_tool_episodes(tmp_path, monkeypatch):
    """LoRA: the reference is the policy with its adapter off; the rows and the mask are the same shape."""
    paths = write_tools_problem(tmp_path)
    cfg = tools_config(paths, tmp_path / "run", "model.lora_rank=4", "train.max_steps=1")
    rollouts, sampler = run_capturing(monkeypatch, cfg)
    assert check_rollout_rows(sampler.tok, rollouts[0]) > 0
    assert (tmp_path / "run" / "final").exists()


@pytest.mark.parametrize("kind, extra", [("rloo", ()), ("ppo", ("online.advantage_estimator=reinforce_pp",))])
def test_rloo_and_reinforce_pp_train_on_tool_episodes(tmp_path, monkeypatch, kind, extra):
    paths = write_tools_problem(tmp_path)
    cfg = tools_config(paths, tmp_path / "run", "train.max_steps=1", *extra, kind=kind)
    rollouts, sampler = run_capturing(monkeypatch, cfg)
    assert check_rollout_rows(sampler.tok, rollouts[0]) > 0 and rollouts[0].values is None
    gap = rollouts[0].response_mask & ~rollouts[0].mask
    assert bool((rollouts[0].advantages[gap] == 0).all())


def test_the_engines_default_length_holds_the_tools_prompt(tmp_path, monkeypatch):
    """vllm without online.vllm_max_model_len: the engine's longest sequence is the data's prompt, plus the tokens
    the tools add to a rendered prompt (this template's system line), plus the response."""
    import rlhfkit.rollout.vllm_engine as vllm_engine
    from rlhfkit.models import load_tokenizer
    from rlhfkit.trainers.online.engine_rollout import start_engine

    seen = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda model, settings, where: seen.update(s=settings))
    paths = write_tools_problem(tmp_path / "p")
    cfg = tools_config(paths, tmp_path / "a", "online.generation_backend=vllm")
    tokenizer = load_tokenizer(str(paths["policy"]))
    start_engine(cfg, None, collect.episode_runner(cfg, tokenizer))
    system_line = len(tokenizer("<|system|>tools: calculator\n", add_special_tokens=False)["input_ids"])
    assert system_line > 0
    assert seen["s"].max_model_len == 32 + system_line + 48
    start_engine(cfg, None)  # no tools: the data's prompt and the response
    assert seen["s"].max_model_len == 32 + 48


@pytest.mark.parametrize("value, stops", [("float('nan')", True), ("None", False), ("'high'", True)])
def test_an_environments_reward_is_checked_like_a_reward_functions(tmp_path, monkeypatch, value, stops):
    """get_reward() NaN or a non-number stops the run naming it (it trained silently as "no opinion", and None
    crashed with a TypeError); None is no opinion."""
    from rlhfkit.rollout.scoring import RewardFunctionError

    paths = write_tools_problem(tmp_path)
    paths["env"].write_text(ENV_PY.replace("return 0.25 + 0.5 * self.calls", f"return {value}"))
    cfg = tools_config(paths, tmp_path / "run", f"online.environment={paths['env']}:CalculatorEnv")
    ctx, batch, rollout = scripted_rollout(cfg, monkeypatch)
    if stops:
        with pytest.raises(RewardFunctionError, match="reward function 'environment.get_reward' returned"):
            score_rollout(ctx, rollout, batch["records"], batch["episodes"])
        return
    scores = score_rollout(ctx, rollout, batch["records"], batch["episodes"])
    assert bool(scores.parts["environment"].isnan().all())
    assert not any(t.worker.alive for t in batch["episodes"].tools)  # closed once scored
