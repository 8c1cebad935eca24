"""The sampler's own log-probs in a tool episode's row (what ``online.rollout_correction`` and the log-prob gap
read): each model token carries the log-prob the sampler gave it, at its own column, across the template's
text between turns, which carries none."""

from __future__ import annotations

import dataclasses

import torch

from rlhfkit.rollout.episodes import run_episodes
from tests.helpers_tools import ScriptedSampler, char_ids, tool_tokenizer
from tests.rollout.test_episodes import CALL, MODEL, runner_for


class LogprobSampler(ScriptedSampler):
    """A :class:`ScriptedSampler` that also gives each sampled token a log-prob of its own: call k, row j,
    token t gets ``-(100 k + 10 j + t + 1) / 1000`` (0 after the row's stop)."""

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        k = len(self.seen) - 1
        rows, width = out.response_ids.shape
        values = -(100 * k + 10 * torch.arange(rows)[:, None] + torch.arange(width)[None] + 1) / 1000.0
        return dataclasses.replace(out, sampled_logprobs=torch.where(out.mask, values, 0.0))


def test_sampled_logprobs_stay_on_their_tokens_across_the_template_suffix():
    tok = tool_tokenizer()
    first = char_ids(tok, CALL)
    second = [char_ids(tok, "answer=408</s>"), char_ids(tok, CALL)]
    sampler = LogprobSampler([[first, first], second, [char_ids(tok, "ok</s>")]])
    out = run_episodes(runner_for(tok), MODEL, ["What is 12*34?", "What is 1*2?"], generate=sampler)
    assert out.sampled_logprobs is not None
    for i in range(2):
        keep = out.response_mask[i]
        model, given = out.mask[i][keep], out.sampled_logprobs[i][keep]  # (L,)
        assert (given[~model] == 0).all()  # the template's tokens carry none
        # the model's tokens, in order: call k's row j, token t, as the sampler gave them
        turns = [(0, i, len(first)), (1, i, len(second[i]))] + ([(2, 0, 3)] if i == 1 else [])
        want = [-(100 * k + 10 * j + t + 1) / 1000.0 for k, j, n in turns for t in range(n)]
        torch.testing.assert_close(given[model], torch.tensor(want), rtol=0, atol=1e-7)
        assert not model[: len(first)].logical_not().any() and not model[len(first)]  # a suffix after turn 1
