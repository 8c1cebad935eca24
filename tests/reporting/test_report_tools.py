"""The report of a run with tools (online.tools / online.environment): its tool metrics as figures (calls and
model turns per episode with one line per tool, failed calls by cause, episodes cut short), and each
episode's turns in samples.jsonl shown as a conversation (report.html's data, report.md's tables)."""

import json
import re

from test_report import PNG, online_rows, write_run

from rlhfkit.reporting.panels import PANEL, run_keys
from rlhfkit.reporting.report import write_report
from rlhfkit.reporting.runs import label, load_run
from rlhfkit.rollout.tools import CAUSES


def tool_rows(n=6):
    """An online run's metrics with the episode metrics a tool run logs (every cause, 0 where none happened)."""
    rows = online_rows(n)
    for row in rows:
        s = row["step"]
        row.update({f"tools/errors/{cause}": 0.0 for cause in CAUSES})
        row.update(
            {
                "tools/calls_per_episode": 0.2 * s,
                "tools/calls/calculator": 0.15 * s,
                "tools/calls/lookup_word": 0.05 * s,
                "tools/errors": 0.3 / s,
                "tools/errors/timeout": 0.2 / s,
                "tools/errors/malformed_arguments": 0.1 / s if s < 3 else 0.0,
                "turns/mean": 1.0 + 0.2 * s,
                "episodes/truncated": 0.1,
                "episodes/max_turns": 0.05,
            }
        )
    return rows


EPISODE = {
    "step": 2,
    "prompt": "What is 123*456?",
    "response": "<tool_call>...</tool_call> the row's text",
    "score": 1.0,
    "kl": 0.3,
    "length": 40,
    "ended": True,
    "turns": [
        {"role": "assistant", "text": '<tool_call>{"name": "calculator"}</tool_call>'},
        {
            "role": "tool",
            "name": "calculator",
            "arguments": {"expression": "123*456"},
            "result": "56088",
            "error": None,
        },
        {
            "role": "tool",
            "name": "lookup_word",
            "arguments": {"w": "x"},
            "result": "<b>late</b>\x07",
            "error": "timeout",
        },
        {"role": "assistant", "text": "The answer is 56088."},
    ],
}
PLAIN = {"step": 1, "prompt": "p", "response": "no tools in this one", "score": 0.0, "kl": 0.1, "length": 3}
TOOL_SAMPLES = json.dumps(PLAIN) + "\n" + json.dumps(EPISODE) + "\n"


def test_tool_metrics_get_their_figures_with_a_line_per_tool_and_per_cause_that_happened(tmp_path):
    write_run(tmp_path / "run", tool_rows(), samples=TOOL_SAMPLES, config="kind: grpo\n")
    write_report(tmp_path / "run")
    for name in ("tool_calls", "tool_errors", "episodes_cut"):
        assert (tmp_path / "run" / "report" / f"{name}.png").read_bytes()[:8] == PNG, name
    run = load_run(tmp_path / "run")
    specs = {spec.name: spec for spec in PANEL}
    calls = {key: legend for key, legend, _ in run_keys(specs["tool_calls"], run)}
    assert calls == {
        "tools/calls_per_episode": "tool calls, all tools",
        "turns/mean": "model turns",
        "tools/calls/calculator": "calculator calls",
        "tools/calls/lookup_word": "lookup_word calls",
    }
    errors = [key for key, _, _ in run_keys(specs["tool_errors"], run)]
    # the causes that happened, not the five that stayed 0 the whole run
    assert errors == ["tools/errors", "tools/errors/malformed_arguments", "tools/errors/timeout"]
    assert label("tools/errors/timeout") == "tool calls that failed: timeout (share of calls)"
    assert label("tools/calls/lookup_word") == "calls of lookup_word per episode"
    md = (tmp_path / "run" / "report.md").read_text()
    for name in ("tool_calls", "tool_errors", "episodes_cut"):
        assert f"report/{name}.png" in md
    page = (tmp_path / "run" / "report.html").read_text()
    assert 'id="tool_calls"' in page and 'id="tool_errors"' in page


def test_a_run_without_tools_draws_no_tool_figure(tmp_path):
    write_run(tmp_path / "run", online_rows(), samples=json.dumps(PLAIN) + "\n")
    write_report(tmp_path / "run")
    drawn = {p.stem for p in (tmp_path / "run" / "report").iterdir()}
    assert not drawn & {"tool_calls", "tool_errors", "episodes_cut"}


def test_episode_turns_reach_the_page_and_the_markdown_as_a_conversation(tmp_path):
    write_run(tmp_path / "run", tool_rows(), samples=TOOL_SAMPLES, config="kind: grpo\n")
    write_report(tmp_path / "run")
    page = (tmp_path / "run" / "report.html").read_text()
    data = re.search(r'<script type="application/json" id="samples-data">(.*?)</script>', page, re.S).group(1)
    plain, episode = json.loads(data)
    assert plain["turns"] is None
    assert [t["role"] for t in episode["turns"]] == ["assistant", "tool", "tool", "assistant"]
    call, failed = episode["turns"][1:3]
    assert call == {
        "role": "tool",
        "name": "calculator",
        "arguments": '{"expression": "123*456"}',
        "result": "56088",
        "error": None,
    }
    # a tool's text is escaped like a response's: no raw control character, no markup
    assert failed["error"] == "timeout" and failed["result"] == "<b>late</b>\\x07" and "\x07" not in page
    assert "<b>late" not in page  # "<" travels escaped inside the JSON
    assert "<th>conversation</th>" in page
    md = (tmp_path / "run" / "report.md").read_text()
    assert 'call calculator({"expression": "123*456"}) -> 56088' in md
    assert "error (timeout): <b>late</b>\\x07" in md and "\x07" not in md
