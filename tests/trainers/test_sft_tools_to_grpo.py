"""The path of docs/tools.md on a tiny model: tool demonstrations as TRL writes them (assistant ``tool_calls``,
``tool`` messages, the tools named in ``data.tools``) -> ``rlhfkit train sft`` -> GRPO with the tool. The SFT
policy memorises its one demonstration, so the GRPO episodes sample the call themselves (no scripted sampler):
the calls are parsed and answered, and the rows the episodes build hold, token for token, the SFT row's
prompt, call turn, tool result and next generation prompt. The same agreement is checked for a template that
does not show tools (the default format) with the call replayed from the SFT row."""

from __future__ import annotations

import copy
import json

import torch
import yaml

from rlhfkit import cli
from rlhfkit.config import load_config
from rlhfkit.data import TokenLimits, prepare_examples
from rlhfkit.data.tool_calls import format_call
from rlhfkit.rollout.episodes import run_episodes
from rlhfkit.rollout.samples import read_samples
from rlhfkit.tasks.calculator import ANSWER_PREFIX, ToolsTask, parse_prompt
from rlhfkit.trainers import online
from rlhfkit.trainers.online import loop
from rlhfkit.trainers.online.collect import episode_runner
from rlhfkit.trainers.online.ppo_update import ppo_update
from rlhfkit.trainers.sft import data_tool_schemas
from tests.helpers import tiny_llama
from tests.helpers_tools import ScriptedSampler

TOOL = "rlhfkit.tasks.calculator:calculator"


def demonstration(prompt: str) -> dict:
    """One TRL row: the call (arguments as a JSON string, as OpenAI's API writes them), its result, the answer."""
    problem = parse_prompt(prompt)
    arguments = json.dumps({"expression": problem.expression})
    return {
        "messages": [
            {"role": "user", "content": prompt},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": arguments}}
                ],
            },
            {"role": "tool", "name": "calculator", "content": str(problem.answer)},
            {"role": "assistant", "content": f"{ANSWER_PREFIX}{problem.answer}"},
        ]
    }


def write_problem(root, template: str | None = None):
    """The tools task's tokenizer (its template shows tools; ``template`` replaces it), a tiny random policy,
    8 copies of one demonstration, and its prompt as the RL data."""
    task = ToolsTask(seed=0, num_train_prompts=8, num_eval_prompts=2)
    tokenizer = task.build_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    prompt = task.prompts("train")[0]
    paths = {"policy": root / "policy", "demos": root / "demos.jsonl", "prompts": root / "prompts.jsonl"}
    root.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, max_position_embeddings=1024
    )
    model.save_pretrained(paths["policy"])
    tokenizer.save_pretrained(paths["policy"])
    paths["demos"].write_text((json.dumps(demonstration(prompt)) + "\n") * 8)
    paths["prompts"].write_text(json.dumps({"prompt": [{"role": "user", "content": prompt}]}) + "\n")
    return paths, tokenizer, prompt


def grpo_config(policy, prompts, out, *extra):
    settings = [
        f"output_dir={out}",
        f"model.name_or_path={policy}",
        f"data.train_file={prompts}",
        "data.max_prompt_length=512",
        f"online.tools=[{TOOL}]",
        "online.reward_functions=[rlhfkit.tasks.calculator:correct_answer_reward]",
        "online.response_length=64",
        "online.max_turns=2",
        "online.group_size=2",
        "online.advantage_estimator=grpo",
        "online.temperature=0.3",
        "train.batch_size=1",
        "train.max_steps=1",
        "logging.samples_per_step=2",
        "logging.progress_bar=false",
        *extra,
    ]
    return load_config(None, settings, "grpo")


def sft_example(paths, tokenizer):
    """The demonstration's SFT example, tokenised as ``train sft`` with ``data.tools`` does."""
    settings = [
        f"data.tools=[{TOOL}]",
        f"model.name_or_path={paths['policy']}",
        "output_dir=unused",
        "data.train_file=unused",
    ]
    sft = load_config(None, settings, "sft")
    limits = TokenLimits(512, 1024, tools=data_tool_schemas(sft))
    return prepare_examples(paths["demos"], "sft", tokenizer, limits)[0]


def call_span(example) -> list[int]:
    """The SFT row's ids from the call turn through the tool result to the next generation prompt (the
    completion up to its last untrained position)."""
    return example["completion_ids"][: max(example["completion_skip"]) + 1]


def test_trl_demonstrations_then_grpo_with_the_tool(tmp_path, monkeypatch, capsys):
    paths, tok, prompt = write_problem(tmp_path)
    problem = parse_prompt(prompt)
    sft_out = tmp_path / "sft"
    config = {
        "output_dir": str(sft_out),
        "model": {"name_or_path": str(paths["policy"])},
        "data": {
            "train_file": str(paths["demos"]),
            "tools": [TOOL],
            "max_prompt_length": 512,
            "max_length": 1024,
        },
        "train": {"max_steps": 60, "batch_size": 2, "learning_rate": 3e-2, "lr_schedule": "constant"},
        "logging": {"progress_bar": False},
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    args = ["train", "sft", "--config", str(tmp_path / "sft.yaml")]
    assert cli.main(args) == 0, capsys.readouterr().err

    cfg = grpo_config(sft_out / "final", paths["prompts"], tmp_path / "grpo")
    rollouts = []

    def capture(ctx, rollout, step, **kwargs):
        rollouts.append(copy.deepcopy(rollout))
        return ppo_update(ctx, rollout, step, **kwargs)

    monkeypatch.setattr(loop, "ppo_update", capture)
    online.train(cfg)

    # the episodes' calls were parsed, run and answered
    samples = read_samples(tmp_path / "grpo" / "samples.jsonl")
    calls = [t for s in samples for t in s["turns"] if t["role"] == "tool"]
    assert len(calls) == 2, samples
    for t in calls:
        assert t["name"] == "calculator" and t["error"] is None
        assert t["arguments"] == {"expression": problem.expression} and t["result"] == str(problem.answer)

    # ... in rows that are the SFT row, token for token
    example = sft_example(paths, tok)
    (rollout,) = rollouts
    span = call_span(example)
    for i in range(rollout.batch_size):
        assert rollout.query_ids[i][rollout.query_mask[i].bool()].tolist() == example["prompt_ids"]
        assert rollout.response_ids[i][: len(span)].tolist() == span
        tool_tokens = (
            rollout.response_mask[i] & ~rollout.mask[i]
        )  # what SFT does not train, RL does not either
        assert bool(tool_tokens[example["completion_skip"]].all())


def test_sft_and_episode_rows_agree_with_the_default_format(tmp_path):
    """A template that shows no tools: the SFT row has the default format's system message, call and result
    block, and an episode that samples that call gets the same ids around it."""
    from rlhfkit.tasks.calculator import CHAT_TEMPLATE

    plain = CHAT_TEMPLATE.split("{% endif %}", 1)[1]  # the tools task's template without its tools line
    paths, tok, prompt = write_problem(tmp_path, plain)
    problem = parse_prompt(prompt)
    cfg = grpo_config(paths["policy"], paths["prompts"], tmp_path / "grpo")
    example = sft_example(paths, tok)
    span = call_span(example)
    call_ids = tok(format_call("calculator", {"expression": problem.expression}), add_special_tokens=False)[
        "input_ids"
    ]
    assert span[: len(call_ids) + 1] == [
        *call_ids,
        tok.eos_token_id,
    ]  # the call, as the episodes' parser reads it
    runner = episode_runner(cfg, tok)
    assert not runner.turns.shows_tools
    answer = tok(f"{ANSWER_PREFIX}{problem.answer}", add_special_tokens=False)["input_ids"]
    sampler = ScriptedSampler([[call_ids], [[*answer, tok.eos_token_id]]])
    model = tiny_llama(vocab_size=len(tok), pad_token_id=tok.pad_token_id, max_position_embeddings=1024)
    torch.manual_seed(0)
    episodes = run_episodes(runner, model, [[{"role": "user", "content": prompt}]], generate=sampler)
    assert episodes.records[0].calls[0]["result"] == str(problem.answer)
    assert episodes.query_ids[0][episodes.query_mask[0].bool()].tolist() == example["prompt_ids"]
    assert episodes.response_ids[0][: len(span)].tolist() == span
