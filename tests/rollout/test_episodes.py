"""Multi-turn episodes (rlhfkit.rollout.episodes): token-exact rows, the mask, the loop's stopping rules, tool
errors as the model sees them, TRL-style environments, and the hf sampler in the loop.

Most tests script what the "model" samples (:class:`helpers_tools.ScriptedSampler`), written one character
at a time: a tokenization that the tokenizer would never produce itself, so any re-tokenization shows.
"""

from __future__ import annotations

import time

import pytest
import torch

from rlhfkit.errors import DataError
from rlhfkit.models import sampling_for
from rlhfkit.rollout.chat_turns import TemplateError
from rlhfkit.rollout.episodes import EpisodeRunner, run_episodes
from rlhfkit.rollout.tools import Toolbox
from tests.helpers import tiny_llama
from tests.helpers_tools import TOOL_TEMPLATE, ScriptedSampler, char_ids, tool_tokenizer

MODEL = torch.nn.Linear(1, 1)  # the scripted sampler never reads it
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'


def calculator(expression: str) -> str:
    """Multiply two numbers.

    Args:
        expression: "a*b"
    """
    a, b = expression.split("*")
    return str(int(a) * int(b))


def boom(x: int) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("kaput")


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "late"


def big(n: int) -> str:
    """A long result.

    Args:
        n: repeats
    """
    return "1234567890" * n


def runner_for(tokenizer, tools=(calculator,), environment=None, **settings) -> EpisodeRunner:
    eos = tokenizer.eos_token_id
    settings = {
        "max_turns": 3,
        "response_length": 400,
        "tool_timeout": 2.0,
        "max_tool_response_length": None,
        **settings,
    }
    return EpisodeRunner.create(
        tokenizer,
        Toolbox.load(list(tools), environment),
        stop_token_ids=[eos],
        pad_token_id=tokenizer.pad_token_id,
        sampling=sampling_for(tokenizer.pad_token_id, [eos]),
        **settings,
    )


def prompt_ids(tokenizer, text="<|system|>tools: calculator\n<|user|>What is 12*34?\n<|assistant|>"):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def row(episodes, i):
    """(the prompt's ids, the ids after it, the model mask) of episode i, without padding."""
    query = episodes.query_ids[i][episodes.query_mask[i].bool()].tolist()
    keep = episodes.response_mask[i]
    return query, episodes.response_ids[i][keep].tolist(), episodes.mask[i][keep].tolist()


def test_row_is_the_sampled_ids_plus_the_rendered_tool_suffix():
    tok = tool_tokenizer()
    first, second = char_ids(tok, CALL), char_ids(tok, "answer=408</s>")
    sampler = ScriptedSampler([[first], [second]])
    out = run_episodes(runner_for(tok), MODEL, ["What is 12*34?"], generate=sampler)
    # What the template writes after a turn that stopped at </tool_call>: the end of the assistant turn, the
    # result, the next generation prompt (written out here by hand from TOOL_TEMPLATE).
    suffix = tok("</s>\n<|tool|><tool_response>408</tool_response>\n<|assistant|>", add_special_tokens=False)
    suffix = suffix["input_ids"]
    query, response, mask = row(out, 0)
    assert query == prompt_ids(tok)
    assert response == first + suffix + second
    assert mask == [True] * len(first) + [False] * len(suffix) + [True] * len(second)
    assert sampler.seen[1] == [query + first + suffix]  # the second turn was sampled after exactly this row
    assert bool(out.ended[0]) and not bool(out.truncated[0])
    # The row is not what re-tokenizing its text gives, and that re-tokenization merges across a turn boundary.
    full = query + response
    text = tok.decode(full, skip_special_tokens=False)
    again = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert again["input_ids"] != full
    cuts, at = [], 0
    for piece in (query, first, suffix):
        at += len(tok.decode(piece, skip_special_tokens=False))
        cuts.append(at)
    assert any(start < cut < end for start, end in again["offset_mapping"] for cut in cuts)


def test_turn_that_ends_with_eos_keeps_the_template_newline_after_it():
    tok = tool_tokenizer(marker_tokens=False)  # no </tool_call> token: the model ends its turn with EOS
    first, second = char_ids(tok, CALL + "</s>"), char_ids(tok, "answer=408</s>")
    sampler = ScriptedSampler([[first], [second]])
    out = run_episodes(runner_for(tok), MODEL, ["What is 12*34?"], generate=sampler)
    suffix = tok("\n<|tool|><tool_response>408</tool_response>\n<|assistant|>", add_special_tokens=False)
    _, response, mask = row(out, 0)
    assert response == first + suffix["input_ids"] + second
    assert sum(mask) == len(first) + len(second)


def test_mask_covers_exactly_the_model_tokens_and_rows_are_padded():
    tok = tool_tokenizer()
    call, answer, direct = char_ids(tok, CALL), char_ids(tok, "answer=408</s>"), char_ids(tok, "answer=1</s>")
    sampler = ScriptedSampler([[call, direct], [answer]])
    out = run_episodes(runner_for(tok), MODEL, ["What is 12*34?", "What is 1*1?"], generate=sampler)
    sampled = [call + answer, direct]
    for i in range(2):
        _, response, mask = row(out, i)
        assert [t for t, m in zip(response, mask, strict=True) if m] == sampled[i]
        assert int(out.mask[i].sum()) == len(sampled[i])
    width = out.response_ids.shape[1]
    assert width == len(row(out, 0)[1])
    assert out.response_mask[1].tolist() == [True] * len(direct) + [False] * (width - len(direct))
    assert not out.mask[1, len(direct) :].any()
    assert (out.response_ids[1, len(direct) :] == tok.pad_token_id).all()
    metrics = out.metrics()
    assert metrics["tools/calls_per_episode"] == 0.5 and metrics["turns/mean"] == 1.5
    assert metrics["tools/calls/calculator"] == 0.5 and metrics["tools/errors"] == 0.0


def test_tool_errors_are_counted_and_seen_by_the_model():
    calls = [
        '<tool_call>\n{"name": "boom", "arguments": {"x": 1}}\n</tool_call>',
        '<tool_call>\n{"name": "slow", "arguments": {"seconds": 3}}\n</tool_call>',
        '<tool_call>\n{"name": "nosuch", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>',
        '<tool_call>\n{"name": "calculator", "arguments": {"wrong": "1*2"}}\n</tool_call>',
    ]
    # One call a turn (a turn ends at its call's end marker), five turns; the marker is plain text here.
    tok = tool_tokenizer(marker_tokens=False)
    turns = [[char_ids(tok, call + "</s>")] for call in calls] + [[char_ids(tok, "answer=1</s>")]]
    sampler = ScriptedSampler(turns)
    runner = runner_for(
        tok, tools=(calculator, boom, slow), tool_timeout=0.2, response_length=2000, max_turns=6
    )
    out = run_episodes(runner, MODEL, ["What is 12*34?"], generate=sampler)
    errors = [t["error"] for t in out.records[0].turns if t["role"] == "tool"]
    assert errors == ["exception", "timeout", "unknown_tool", "malformed_arguments", "malformed_arguments"]
    seen = tok.decode(sampler.seen[5][0], skip_special_tokens=False)
    assert "RuntimeError: kaput" in seen
    assert "no result within 0.2 s (timeout)" in seen
    assert "unknown tool; the tools are boom, calculator, slow" in seen
    assert "the call could not be read" in seen
    assert "bad arguments" in seen
    metrics = out.metrics()
    assert metrics["tools/errors"] == 1.0 and metrics["tools/calls_per_episode"] == 5
    assert metrics["tools/errors/exception"] == metrics["tools/errors/timeout"] == 0.2
    assert metrics["tools/errors/malformed_arguments"] == 0.4
    assert metrics["tools/timeouts"] == 1.0 and metrics["episodes/stopped_by_tool"] == 0.0
    assert bool(out.ended[0])


def test_a_result_over_the_limit_is_cut_says_so_and_is_counted():
    tok = tool_tokenizer()
    call = char_ids(tok, '<tool_call>\n{"name": "big", "arguments": {"n": 30}}\n</tool_call>')
    sampler = ScriptedSampler([[call], [char_ids(tok, "answer=1</s>")]])
    runner = runner_for(tok, tools=(big,), max_tool_response_length=5)
    out = run_episodes(runner, MODEL, ["What is 12*34?"], generate=sampler)
    result = out.records[0].calls[0]
    full = len(tok("1234567890" * 30, add_special_tokens=False)["input_ids"])
    assert result["error"] == "too_long"
    assert result["result"].endswith(f"[truncated: the result was {full} tokens; the limit is 5]")
    shown = result["result"].split("\n[truncated")[0]
    assert len(tok(shown, add_special_tokens=False)["input_ids"]) == 5
    assert "[truncated: the result was" in tok.decode(sampler.seen[1][0], skip_special_tokens=False)
    assert out.metrics()["tools/errors/too_long"] == 1.0


def test_max_turns_stops_the_episode_and_counts_the_unanswered_call():
    tok = tool_tokenizer()
    call = char_ids(tok, CALL)
    sampler = ScriptedSampler([[call], [call]])  # a third generate call would find no script
    out = run_episodes(runner_for(tok, max_turns=2), MODEL, ["What is 12*34?"], generate=sampler)
    record = out.records[0]
    assert record.model_turns == 2 and [c["error"] for c in record.calls] == [None, "max_turns"]
    assert not bool(out.ended[0]) and not bool(out.truncated[0])  # it stopped at </tool_call>, not at EOS
    assert out.metrics()["episodes/max_turns"] == 1.0
    _, response, mask = row(out, 0)
    assert response[-len(call) :] == call and mask[-len(call) :] == [True] * len(call)


def test_each_turn_draws_from_its_active_episodes_own_streams():
    """``streams`` (online.sampler=exact): each turn's call gets the streams of the episodes still active, in
    their order; the second turn only the episode that called the tool."""
    from rlhfkit.models.sampler import RowStreams

    tok = tool_tokenizer()
    call, answer, direct = char_ids(tok, CALL), char_ids(tok, "answer=408</s>"), char_ids(tok, "answer=1</s>")
    script = ScriptedSampler([[direct, call], [answer]])
    given = []

    def sampler(*args, streams=None, **kwargs):
        given.append((streams.prompt_index.tolist(), streams.sample_index.tolist()))
        return script(*args, **kwargs)

    streams = RowStreams(3, torch.tensor([10, 11]), torch.tensor([0, 1]))
    prompts = ["What is 1*1?", "What is 12*34?"]
    run_episodes(runner_for(tok), MODEL, prompts, generate=sampler, streams=streams)
    assert given == [([10, 11], [0, 1]), ([11], [1])]


def test_the_budget_bounds_every_turn_together_and_truncates():
    tok = tool_tokenizer()
    call, answer = char_ids(tok, CALL), char_ids(tok, "answer=408</s>")
    suffix = tok("</s>\n<|tool|><tool_response>408</tool_response>\n<|assistant|>", add_special_tokens=False)
    room = len(call) + len(suffix["input_ids"]) + 3  # 3 tokens left for the answer
    # A second episode with a shorter call has more room left, so the one generate call of turn 2 may sample
    # more tokens than the first episode's budget: the loop cuts each episode at its own.
    short = char_ids(tok, CALL.replace("12*34", "1*2"))
    sampler = ScriptedSampler([[call, short], [answer, char_ids(tok, "a</s>")]])
    prompts = ["What is 12*34?"] * 2
    out = run_episodes(runner_for(tok, response_length=room), MODEL, prompts, generate=sampler)
    _, response, mask = row(out, 0)
    assert len(response) == room and response[-3:] == answer[:3]  # cut inside the second model turn
    assert bool(out.truncated[0]) and not bool(out.ended[0])
    assert bool(out.ended[1]) and not bool(out.truncated[1])
    # Results that would leave no room for a model token are not appended: truncated, the call counted.
    sampler = ScriptedSampler([[call]])
    runner = runner_for(tok, response_length=len(call) + len(suffix["input_ids"]))
    out = run_episodes(runner, MODEL, prompts[:1], generate=sampler)
    _, response, _ = row(out, 0)
    assert response == call and bool(out.truncated[0])
    assert out.records[0].calls[0]["error"] == "budget"
    assert out.metrics()["episodes/truncated"] == 1.0 and out.metrics()["tools/errors/budget"] == 1.0


def test_template_that_rewrites_earlier_turns_is_refused_at_start_up():
    # As reasoning templates that drop earlier <think> blocks: only the last assistant turn is written out.
    hiding = TOOL_TEMPLATE.replace(
        "<|assistant|>{{ m['content'] }}</s>",
        "<|assistant|>{% if loop.last %}{{ m['content'] }}{% endif %}</s>",
    )
    with pytest.raises(TemplateError, match="does not render prefixes of itself"):
        runner_for(tool_tokenizer(hiding))
    trimming = TOOL_TEMPLATE.replace("{{ m['content'] }}</s>", "{{ m['content'] | trim }}</s>")
    with pytest.raises(TemplateError, match="verbatim"):
        runner_for(tool_tokenizer(trimming))
    with pytest.raises(TemplateError, match="has none"):
        runner_for(tool_tokenizer(None))
    runner_for(tool_tokenizer())  # the template as it is passes


ENV_FILE = '''
class IncrementEnv:
    def __init__(self):
        self.counter = 0

    def reset(self, start: int = 0, **kwargs) -> str | None:
        self.counter = start
        return f" (the counter starts at {start})"

    def increment(self, a: int) -> int:
        """
        Increment the counter by a value.

        Args:
            a: The value to increment by
        """
        self.counter += a
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter)

    def _helper(self):
        return None
'''


def test_trl_style_environment_runs_unchanged(tmp_path, monkeypatch):
    (tmp_path / "env.py").write_text(ENV_FILE)
    monkeypatch.chdir(tmp_path)
    tok = tool_tokenizer(marker_tokens=False)
    runner = runner_for(tok, tools=(), environment="env.py:IncrementEnv")
    assert [s["function"]["name"] for s in runner.toolbox.schemas] == ["increment"]
    call = '<tool_call>\n{"name": "increment", "arguments": {"a": 2}}\n</tool_call></s>'
    sampler = ScriptedSampler([[char_ids(tok, call)] * 2, [char_ids(tok, "done</s>")] * 2])
    rows = [{"start": 1, "answer": "x"}, {"start": 5, "answer": "y"}]
    out = run_episodes(runner, MODEL, ["Count."] * 2, rows, generate=sampler)
    assert out.environment_scores() == [3.0, 7.0]  # one environment per episode
    assert [r.calls[0]["result"] for r in out.records] == ["3", "7"]
    assert out.conversations[0][0]["content"] == "Count. (the counter starts at 1)"
    call_text = call.removesuffix("</s>")
    assert out.completions[1] == [
        {"role": "assistant", "content": call_text},
        {"role": "tool", "name": "increment", "content": "7"},
        {"role": "assistant", "content": "done"},
    ]
    assert "Count. (the counter starts at 5)" in tok.decode(sampler.seen[0][1], skip_special_tokens=False)


def test_hf_sampler_in_the_loop_is_reproducible_from_the_seed():
    tok = tool_tokenizer()
    model = tiny_llama(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=256,
    )
    runner = runner_for(tok, response_length=12)
    rows = []
    for _ in range(2):
        torch.manual_seed(3)
        out = run_episodes(runner, model, ["What is 12*34?", "What is 1*2?"])
        rows.append(out.response_ids)
        assert out.response_ids.shape[1] <= 12 and out.mask.any()
        assert (out.mask <= out.response_mask).all()
    assert torch.equal(rows[0], rows[1])


# SmolLM2-135M-Instruct's chat template (chatml): it shows no tools and has no tool role of its own.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_template_without_tools_gets_the_default_format():
    tok = tool_tokenizer(CHATML, marker_tokens=False)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    runner = runner_for(tok)
    assert not runner.turns.shows_tools
    first, second = char_ids(tok, CALL + "<|im_end|>"), char_ids(tok, "answer=408<|im_end|>")
    sampler = ScriptedSampler([[first], [second]])
    out = run_episodes(runner, MODEL, ["What is 12*34?"], generate=sampler)
    query, response, mask = row(out, 0)
    prompt = tok.decode(query, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '"name": "calculator"' in prompt and prompt.endswith(
        "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n"
    )
    suffix = "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    suffix_ids = tok(suffix, add_special_tokens=False)["input_ids"]
    assert response == first + suffix_ids + second
    assert mask == [True] * len(first) + [False] * len(suffix_ids) + [True] * len(second)
    assert bool(out.ended[0])


def test_tokenizer_that_puts_a_space_before_every_text_is_refused():
    # SentencePiece-style: every encoded text starts with "▁", so a suffix encoded on its own adds a space.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.helpers_tools import CORPUS

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=False)
    backend.decoder = decoders.Metaspace(prepend_scheme="always", split=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<pad>", "<s>", "</s>"], show_progress=False
    )
    backend.train_from_iterator(CORPUS * 4, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = TOOL_TEMPLATE
    with pytest.raises(TemplateError, match="a prefix space"):
        runner_for(tok)


def test_the_turn_ends_at_its_call_and_invented_results_are_never_in_the_row():
    """A model that goes on past its call (writes its own <tool_response>) on a backend that stops only at EOS:
    the turn is cut after the call's end marker, and the invented text is neither trained nor in the row."""
    tok = tool_tokenizer(marker_tokens=False)  # the marker is several tokens: no stop id can end the turn
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    invented = "\n<tool_response>999</tool_response>\nanswer=999"
    sampler = ScriptedSampler([[char_ids(tok, call + invented + "</s>")], [char_ids(tok, "answer=408</s>")]])
    out = run_episodes(runner_for(tok), MODEL, ["What is 12*34?"], generate=sampler)
    _, response, mask = row(out, 0)
    trained = tok.decode([t for t, m in zip(response, mask, strict=True) if m], skip_special_tokens=False)
    assert trained == call + "answer=408</s>"
    assert "999" not in tok.decode(response, skip_special_tokens=False)
    assert out.records[0].turns[0]["text"] == call
    assert out.records[0].calls[0]["result"] == "408"


def test_a_call_followed_by_eos_keeps_the_models_eos():
    tok = tool_tokenizer(marker_tokens=False)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    first = char_ids(tok, call + "</s>")
    sampler = ScriptedSampler([[first], [char_ids(tok, "answer=2</s>")]])
    out = run_episodes(runner_for(tok), MODEL, ["q"], generate=sampler)
    _, response, mask = row(out, 0)
    assert response[: len(first)] == first and all(mask[: len(first)])


class CountingSampler(ScriptedSampler):
    """Hands every row of call k the ids ``script[k]`` and records each call's row count."""

    def __init__(self, script: list[list[int]]):
        super().__init__([])
        self.script, self.sizes = script, []

    def __call__(self, model, prompt_ids, prompt_mask, **kwargs):
        self.turns = [[self.script[len(self.sizes)]] * prompt_ids.shape[0]]
        self.sizes.append(prompt_ids.shape[0])
        return super().__call__(model, prompt_ids, prompt_mask, **kwargs)


@pytest.mark.parametrize("size, calls", [(None, [5, 5]), (2, [2, 2, 1, 2, 2, 1]), (5, [5, 5])])
def test_rollout_batch_size_bounds_every_generate_call_of_an_episode(size, calls):
    tok = tool_tokenizer(marker_tokens=False)
    call = char_ids(
        tok, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    )
    half = len(calls) // 2  # the first turn's calls, then the second turn's (answers)
    sampler = CountingSampler([call] * half + [char_ids(tok, "answer=6</s>")] * half)
    out = run_episodes(runner_for(tok), MODEL, ["q"] * 5, generate=sampler, rollout_batch_size=size)
    assert sampler.sizes == calls
    assert [r.model_turns for r in out.records] == [2] * 5
    assert all(r.calls[0]["result"] == "6" for r in out.records)


def test_reset_text_goes_to_the_last_user_message(tmp_path, monkeypatch):
    (tmp_path / "env.py").write_text(ENV_FILE)
    monkeypatch.chdir(tmp_path)
    tok = tool_tokenizer(marker_tokens=False)
    runner = runner_for(tok, tools=(), environment="env.py:IncrementEnv")
    prompt = [
        {"role": "user", "content": "First question."},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "Count."},
    ]
    sampler = ScriptedSampler([[char_ids(tok, "done</s>")]])
    out = run_episodes(runner, MODEL, [prompt], [{"start": 4}], generate=sampler)
    users = [m["content"] for m in out.conversations[0] if m["role"] == "user"]
    assert users == ["First question.", "Count. (the counter starts at 4)"]
    out.close()


LONG_ENV = """
class Chatty:
    def reset(self, **row):
        return " " + "context " * 50

    def noop(self) -> str:
        '''Nothing.

        Args:
        '''
        return ""
"""


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_an_episode_prompt_is_cut_to_the_limit_plus_what_the_tools_add(tmp_path, monkeypatch, truncation):
    """data.max_prompt_length held with tools: a long prompt (re-rendered in full by the episode before) and a
    long reset() text are cut as the data layer cuts prompts, to the limit plus the tools' own tokens."""
    (tmp_path / "env.py").write_text(LONG_ENV)
    monkeypatch.chdir(tmp_path)
    tok = tool_tokenizer(marker_tokens=False)
    runner = runner_for(
        tok, tools=(), environment="env.py:Chatty", max_prompt_length=32, truncation=truncation
    )
    limit = runner.prompt_limit()
    assert limit == 32 + runner.turns.prompt_overhead()
    sampler = ScriptedSampler([[char_ids(tok, "done</s>")] * 2])
    out = run_episodes(runner, MODEL, ["What is 12*34? " * 20, "Hi."], generate=sampler)
    lengths = out.query_mask.sum(1).tolist()
    assert max(lengths) == limit and all(n <= limit for n in lengths)
    ids = out.query_ids[0][out.query_mask[0].bool()].tolist()
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|assistant|>") if truncation == "left" else text.startswith("<|system|>")
    out.close()


def test_a_reset_text_over_the_limit_is_a_named_error_under_truncation_error(tmp_path, monkeypatch):
    (tmp_path / "env.py").write_text(LONG_ENV)
    monkeypatch.chdir(tmp_path)
    tok = tool_tokenizer(marker_tokens=False)
    runner = runner_for(tok, tools=(), environment="env.py:Chatty", max_prompt_length=32, truncation="error")
    with pytest.raises(
        DataError, match="reset\\(\\) of episode 0 returned 401 characters .* data.truncation"
    ):
        run_episodes(runner, MODEL, ["Hi."], generate=ScriptedSampler([]))
    # without reset text, a prompt the data layer let through is never refused for the tools' rendering
    plain = runner_for(tok, max_prompt_length=4, truncation="error")
    out = run_episodes(plain, MODEL, ["Hi there."], generate=ScriptedSampler([[char_ids(tok, "ok</s>")]]))
    assert int(out.query_mask.sum()) > plain.prompt_limit()
