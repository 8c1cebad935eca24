"""Dynamic sampling (``online.dynamic_sampling``) with tools: the extra rounds play whole episodes, and a group
that replaces one brings its episodes' turns along, so that the metrics and samples.jsonl describe the rows
trained. The policy's turns are scripted (:class:`tests.trainers.online.test_tools_online.ToolSampler`)."""

from __future__ import annotations

import torch

from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.models import load_tokenizer
from rlhfkit.rollout.episodes import EpisodeRecord, Episodes
from rlhfkit.rollout.samples import read_samples
from rlhfkit.tasks.calculator import ANSWER_PREFIX, parse_prompt
from rlhfkit.trainers.online.dynamic import select_episodes
from tests.trainers.online.test_tools_online import (
    ToolSampler,
    check_rollout_rows,
    run_capturing,
    tools_config,
    write_tools_problem,
)


class FirstAnswersRight(ToolSampler):
    """Every episode calls the calculator, then answers. The first ``first`` answers are right (stage 1's
    groups all score 1: none has a spread), the later ones wrong and right in turn (each later group has one
    of each)."""

    def __init__(self, tokenizer, first: int):
        super().__init__(tokenizer, answer_at_once=0.0)
        self.first, self.answered = first, 0

    def right(self) -> bool:
        self.answered += 1
        return self.answered <= self.first or self.answered % 2 == 0


def test_dynamic_sampling_replaces_groups_with_played_episodes_and_their_turns(tmp_path, monkeypatch):
    paths = write_tools_problem(tmp_path)
    out = tmp_path / "run"
    cfg = tools_config(
        paths,
        out,
        "online.dynamic_sampling=true",
        "online.dynamic_sampling_rounds=2",
        "train.max_steps=1",
        "logging.samples_per_step=8",
    )
    responses = cfg.train.batch_size * cfg.online.group_size
    sampler = FirstAnswersRight(load_tokenizer(cfg.model.name_or_path), first=responses)
    (rollout,), _ = run_capturing(monkeypatch, cfg, sampler)
    (row,) = read_metrics(out / "metrics.jsonl")
    groups = cfg.train.batch_size
    assert row["groups/resampled"] == groups and row["groups/sampling_rounds"] == 1
    assert sampler.answered == 2 * responses  # stage 1's episodes and one extra round's
    # the trained rows are the extra round's episodes: prompt, call, result, answer, a spread in every group
    assert check_rollout_rows(sampler.tok, rollout) == responses
    assert rollout.scores.view(groups, -1).std(1).min() > 0
    assert row["tools/calls_per_episode"] == 1.0 and row["turns/mean"] == 2.0
    samples = read_samples(out / "samples.jsonl")
    assert len(samples) == responses
    for sample in samples:  # each sample's turns are its own episode's: its prompt's call, its scored answer
        problem = parse_prompt(sample["prompt"])
        _, call, answer = sample["turns"]  # the call turn, the tool's result, the answer turn
        assert [call["role"], answer["role"]] == ["tool", "assistant"]
        assert call["arguments"] == {"expression": problem.expression} and call["result"] == str(
            problem.answer
        )
        assert (answer["text"] == f"{ANSWER_PREFIX}{problem.answer}") == (sample["score"] == 1.0), sample


def test_selected_episodes_are_laid_out_as_the_rollouts_rows():
    """Two batches of different prompt and row widths: the picked episodes' prompts are left padded, their rows
    right padded (as :func:`concat_rollouts` lays out the rollouts), and their records follow them."""
    pad = 0

    def batch(prompt: list[int], row: list[int], name: str) -> Episodes:
        n = len(row)
        return Episodes(
            query_ids=torch.tensor([prompt]),
            query_mask=torch.ones(1, len(prompt), dtype=torch.long),
            response_ids=torch.tensor([row]),
            mask=torch.tensor([[True] * (n - 1) + [False]]),
            response_mask=torch.ones(1, n, dtype=torch.bool),
            ended=torch.tensor([True]),
            truncated=torch.tensor([False]),
            records=[EpisodeRecord(turns=[{"role": "assistant", "text": name}])],
            conversations=[[{"role": "user", "content": name}]],
            completions=[[]],
            environments=[name],
        )

    a, b = batch([5, 6], [7, 8], "a"), batch([1, 2, 3], [9, 9, 9], "b")
    picked = select_episodes(a, b, [1, 0], pad)
    assert picked.query_ids.tolist() == [[1, 2, 3], [pad, 5, 6]]
    assert picked.query_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert picked.response_ids.tolist() == [[9, 9, 9], [7, 8, pad]]
    assert picked.mask.tolist() == [[True, True, False], [True, False, False]]
    assert picked.response_mask.tolist() == [[True, True, True], [True, True, False]]
    assert [r.turns[0]["text"] for r in picked.records] == ["b", "a"] and picked.environments == ["b", "a"]
