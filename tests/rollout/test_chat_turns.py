"""Chat templates that rewrite the model's turn as they render it: reasoning templates that drop the
``<think>`` block (DeepSeek-R1-distill's ``content.split('</think>')[-1]``), templates that ``lstrip`` the
turn, and a template that rewrites it only on a marker no start-up probe can guess."""

from __future__ import annotations

import pytest

from rlhfkit.rollout.chat_turns import TemplateError
from rlhfkit.rollout.episodes import run_episodes
from tests.helpers_tools import TOOL_TEMPLATE, ScriptedSampler, char_ids, tool_tokenizer
from tests.rollout.test_episodes import CALL, MODEL, runner_for

ASSISTANT = "<|assistant|>{{ m['content'] }}</s>"


def rewriting(expression: str, generation_prompt: str = "<|assistant|>") -> str:
    """TOOL_TEMPLATE with the assistant's content rewritten by the Jinja ``expression`` of ``c``."""
    assistant = (
        "{% set c = m['content'] %}<|assistant|>{{ " + expression + " }}</s>"
    )  # as DeepSeek-R1-distill: the rewrite is in the template's assistant branch
    template = TOOL_TEMPLATE.replace(ASSISTANT, assistant)
    assert template != TOOL_TEMPLATE
    return template.replace(
        "{% if add_generation_prompt %}<|assistant|>", "{% if add_generation_prompt %}" + generation_prompt
    )


# DeepSeek-R1-Distill's assistant branch: {% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}
R1 = rewriting("c.split('</think>')[-1]")
# The same with the generation prompt that opens the reasoning block (the later R1-distill tokenizers).
R1_OPEN_THINK = rewriting("c.split('</think>')[-1]", "<|assistant|><think>\n")
LSTRIP = rewriting("c.lstrip('\\n')")
# Rewrites the turn only when it holds a marker the policy may emit mid-run.
MARKER = rewriting("c.replace('<|secret|>', '')")


def response(episodes, i) -> tuple[list[int], list[bool]]:
    keep = episodes.response_mask[i]
    return episodes.response_ids[i][keep].tolist(), episodes.mask[i][keep].tolist()


@pytest.mark.parametrize(
    ("template", "first_text"),
    [
        (R1, "<think>hmm</think>" + CALL),
        (R1_OPEN_THINK, "hmm</think>" + CALL),  # the generation prompt opened the block
        (LSTRIP, "\n\n" + CALL),
    ],
    ids=["r1", "r1-open-think", "lstrip"],
)
def test_template_that_drops_the_head_of_a_turn_plays_the_episode_to_the_end(template, first_text):
    tok = tool_tokenizer(template)
    first, second = char_ids(tok, first_text), char_ids(tok, "answer=408</s>")
    sampler = ScriptedSampler([[first], [second]])
    out = run_episodes(runner_for(tok), MODEL, ["What is 12*34?"], generate=sampler)
    # The row keeps the sampled ids (what the model saw, reasoning included); between the turns, the text the
    # template writes after the turn as it renders it (its end of turn, the result, the generation prompt).
    opening = "<think>\n" if template is R1_OPEN_THINK else ""
    between = "</s>\n<|tool|><tool_response>408</tool_response>\n<|assistant|>" + opening
    suffix = tok(between, add_special_tokens=False)["input_ids"]
    ids, mask = response(out, 0)
    assert ids == first + suffix + second
    assert mask == [True] * len(first) + [False] * len(suffix) + [True] * len(second)
    assert out.records[0].calls[0]["result"] == "408" and out.records[0].calls[0]["error"] is None
    assert bool(out.ended[0]) and out.metrics()["tools/errors"] == 0.0


def test_start_up_probe_turns_carry_a_reasoning_block_and_leading_newlines():
    # Templates that rewrite a turn only when it holds a reasoning block, or only when it starts with a newline,
    # and not into a tail of it: were the probe turns without both, these would pass at start-up and stop the
    # run at the first such turn.
    for expression in ("c.replace('</think>', '</think>\\n')", "('\\n' ~ c) if c.startswith('\\n') else c"):
        with pytest.raises(TemplateError, match="start-up probe.*verbatim"):
            runner_for(tool_tokenizer(rewriting(expression)))


def test_a_refusal_at_start_up_names_the_template_and_the_turn_it_rewrites():
    tok = tool_tokenizer(rewriting("c | trim"))
    tok.name_or_path = "org/reasoner"
    with pytest.raises(TemplateError) as caught:
        runner_for(tok)
    message = str(caught.value)
    assert "org/reasoner" in message and "model turn 1" in message and "<think>hmm</think>" in message


def test_a_rewrite_no_probe_can_guess_ends_that_episode_with_a_counted_cause():
    tok = tool_tokenizer(MARKER)
    runner = runner_for(tok)  # the probe has no marker: start-up passes
    marked, plain = char_ids(tok, "so <|secret|> then " + CALL), char_ids(tok, CALL)
    sampler = ScriptedSampler([[marked, plain], [char_ids(tok, "answer=408</s>")]])
    out = run_episodes(runner, MODEL, ["What is 12*34?"] * 2, generate=sampler)
    # The marked episode stops after its turn, its call counted with cause "template"; the other goes on.
    ids, mask = response(out, 0)
    assert ids == marked and all(mask)
    assert [c["error"] for c in out.records[0].calls] == ["template"]
    assert not bool(out.ended[0]) and not bool(out.truncated[0])
    assert bool(out.ended[1]) and out.records[1].model_turns == 2
    assert len(sampler.seen[1]) == 1  # only the other episode was sampled again
    metrics = out.metrics()
    assert metrics["tools/errors/template"] == 0.5 and metrics["tools/errors"] == 0.5


def test_template_that_rewrites_the_conversation_before_the_turn_is_refused_as_not_a_prefix():
    # The user's message is written one way when it is the last and another when a turn follows it: the row
    # before the turn is not the start of the conversation with it, whatever the template does to the turn.
    template = TOOL_TEMPLATE.replace(
        "<|{{ m['role'] }}|>{{ m['content'] }}",
        "<|{{ m['role'] }}|>{{ m['content'] }}{% if not loop.last %}.{% endif %}",
    )
    assert template != TOOL_TEMPLATE
    with pytest.raises(TemplateError, match="start-up probe.*does not render prefixes of itself"):
        runner_for(tool_tokenizer(template))
