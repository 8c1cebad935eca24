"""How many calls one model turn can hold where the tool-call end marker is one token (Qwen2.5's
``</tool_call>``): the turn stops at the first call's end, so it holds that call only; a second call comes in
a later turn, after the first one's result."""

from __future__ import annotations

from rlhfkit.rollout.episodes import run_episodes
from tests.helpers_tools import ScriptedSampler, char_ids, tool_tokenizer
from tests.rollout.test_episodes import CALL, MODEL, runner_for

SECOND = CALL.replace("12*34", "5*6")


def test_with_a_one_token_call_end_a_turn_holds_one_call():
    tok = tool_tokenizer()  # <tool_call> and </tool_call> single tokens, as in Qwen2.5's vocabulary
    end = tok.convert_tokens_to_ids("</tool_call>")
    runner = runner_for(tok)
    assert end in runner.turn_stops
    # the model "writes" two calls in its first turn; the sampler stops it at the first </tool_call>
    both = char_ids(tok, CALL + "\n" + SECOND + "</s>")
    sampler = ScriptedSampler([[both], [char_ids(tok, SECOND)], [char_ids(tok, "answer</s>")]])
    out = run_episodes(runner, MODEL, ["What is 12*34 and 5*6?"], generate=sampler)
    record = out.records[0]
    assert [t["text"] for t in record.turns if t["role"] == "assistant"][0] == CALL
    assert [c["result"] for c in record.calls] == ["408", "30"]  # one call per turn, in two turns
    assert record.model_turns == 3 and bool(out.ended[0])
