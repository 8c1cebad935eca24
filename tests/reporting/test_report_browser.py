"""report.html in a real browser (headless Chromium over the DevTools protocol, see tests/reporting/browser.py): it
renders without a console error, every plot loads, the sample browser filters by step and run and sorts by
each column, and a screenshot is taken (into ``$RLHFKIT_SCREENSHOT_DIR`` when set, for a person to look at).

Skipped, with the reason, where no Chromium is installed (``./setup.sh dev`` installs Debian's, saying so, as root).
"""

import json
import os
from pathlib import Path

import pytest
from browser import Chromium, find_chromium
from test_report import SAMPLES, online_rows, write_run

from rlhfkit.reporting.report import write_quickstart_page, write_report, write_reports

BINARY = find_chromium()
pytestmark = pytest.mark.skipif(
    BINARY is None,
    reason="no Chromium found: install Debian's chromium package "
    "(`./setup.sh dev` does, as root) or set RLHFKIT_CHROMIUM",
)


def shot_path(tmp_path, name):
    folder = Path(os.environ.get("RLHFKIT_SCREENSHOT_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def many_samples():
    rows = []
    for step in (1, 2, 3):
        for i in range(4):
            rows.append(
                {
                    "step": step,
                    "prompt": f"prompt {i}",
                    "response": f"response {i} of step {step}\x07",
                    "score": (7 * i + step) % 5 / 4,
                    "gold": None if i == 3 else i / 3,
                    "kl": (3 * i + step) % 4,
                    "length": 5 + i * step,
                    "ended": i != 2,
                    "parts": {"reward_model": i / 4, "format": -0.5},
                }
            )
    return "".join(json.dumps(r) + "\n" for r in rows) + SAMPLES


def column(browser, key):
    return browser.evaluate(
        f"[...document.querySelectorAll('#samples-table tbody tr')].map(r => r.dataset.{key})"
    )


def choose(browser, select_id, value):
    browser.evaluate(
        f"(() => {{ const s = document.getElementById('{select_id}'); s.value = '{value}'; "
        "s.dispatchEvent(new Event('change')); })()"
    )


def numbers(values):
    return [float(v) for v in values if v not in ("null", "undefined")]


def check_page_loads(browser):
    assert browser.evaluate("document.readyState") == "complete"
    broken = browser.evaluate("[...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).length")
    assert broken == 0
    return browser.evaluate("document.images.length")


def test_run_page_renders_and_its_sample_browser_filters_and_sorts(tmp_path):
    write_run(tmp_path / "run", online_rows(runaway=True), samples=many_samples())
    page = write_report(tmp_path / "run")
    with Chromium(BINARY) as browser:
        browser.open(page.as_uri())
        assert check_page_loads(browser) == 13
        assert browser.evaluate("document.querySelectorAll('figure.warn').length") == 5
        assert (
            browser.evaluate("document.getElementById('sample-count').textContent")
            == "showing 15 of 15 samples"
        )
        # no markup from a response: "</script><b>x</b>" is text on the page, and the bell is an escape
        assert browser.evaluate("document.querySelectorAll('#samples-table b').length") == 0
        texts = browser.evaluate(
            "[...document.querySelectorAll('#samples-table td.text')].map(t => t.textContent)"
        )
        assert "bell\\x07 </script><b>x</b>" in texts and not any("\x07" in t for t in texts)

        choose(browser, "sample-step", "2")
        assert set(column(browser, "step")) == {"2"} and len(column(browser, "step")) == 6
        choose(browser, "sample-step", "all")
        for key in ("score", "gold", "kl", "length"):
            choose(browser, "sample-sort", key)
            for order, sign in (("asc", 1), ("desc", -1)):
                choose(browser, "sample-order", order)
                values = column(browser, key)
                present = numbers(values)
                assert present == sorted(present, key=lambda v: sign * v), (key, order, values)
                # rows without the value come last, whichever the order
                assert values[len(present) :] == ["null"] * (len(values) - len(present)), (key, values)
        choose(browser, "sample-sort", "kl")
        choose(browser, "sample-step", "3")
        assert numbers(column(browser, "kl")) == [3.0, 2.0, 1.0, 0.0]  # still highest first
        assert set(column(browser, "step")) == {"3"}
        assert browser.errors() == []
        png = browser.screenshot(shot_path(tmp_path, "report-run.png"))
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000


def test_sample_browser_without_gold_has_no_gold_column_and_its_cells_line_up(tmp_path):
    """A run scored by a reward function has no gold annotator: no gold column or sort, and every row has one
    cell per heading (the score and KL under their own headings)."""
    rows = [
        {"step": 1, "prompt": f"p{i}", "response": f"r{i}", "score": i - 1.0, "parts": {"accuracy": 0.0}}
        | {"kl": 10.0 + i, "length": 5, "ended": i > 0}
        for i in range(3)
    ]
    samples = "".join(json.dumps(r) + "\n" for r in rows)
    write_run(tmp_path / "run", online_rows(), samples=samples, config="kind: grpo\n")
    page = write_report(tmp_path / "run")
    with Chromium(BINARY) as browser:
        browser.open(page.as_uri())
        heads = browser.evaluate(
            "[...document.querySelectorAll('#samples-table th')].map(t => t.textContent)"
        )
        assert "gold" not in heads and heads[:3] == ["step", "score (as trained)", "KL"]
        cells = browser.evaluate(
            "[...document.querySelectorAll('#samples-table tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
        )
        assert len(cells) == 3 and all(len(row) == len(heads) for row in cells)
        assert sorted(row[2] for row in cells) == ["10", "11", "12"]  # the KL column holds the KL
        sorts = browser.evaluate("[...document.querySelectorAll('#sample-sort option')].map(o => o.value)")
        assert "gold" not in sorts
        assert browser.errors() == []


def test_side_by_side_page_filters_by_run(tmp_path):
    write_run(tmp_path / "runs" / "kl-0.05", online_rows(), samples=many_samples())
    write_run(tmp_path / "runs" / "kl-0.2", online_rows(n=7, kl_speed=1.0), samples=SAMPLES)
    *_, page = write_reports([tmp_path / "runs" / "kl-0.05", tmp_path / "runs" / "kl-0.2"])
    with Chromium(BINARY) as browser:
        browser.open(page.as_uri())
        check_page_loads(browser)
        assert (
            browser.evaluate("document.getElementById('sample-count').textContent")
            == "showing 18 of 18 samples"
        )
        choose(browser, "sample-run", "kl-0.2")
        assert browser.evaluate("document.querySelectorAll('#samples-table tbody tr').length") == 3
        assert browser.evaluate(
            "[...document.querySelectorAll('.comparison th')].slice(1, 3).map(t => t.textContent)"
        ) == ["kl-0.05", "kl-0.2"]
        assert browser.errors() == []
        browser.screenshot(shot_path(tmp_path, "report-compare.png"))


def test_quickstart_page_shows_every_stage(tmp_path):
    out = tmp_path / "qs"
    write_run(
        out / "sft",
        [{"step": s, "loss": 3.0 / s, "eval/loss": 3.2 / s, "learning_rate": 1e-3} for s in range(1, 31)],
        summary={"kind": "sft"},
        config="kind: sft\n",
    )
    bins = [
        {
            "low": 0.5 + k / 20,
            "high": 0.55 + k / 20,
            "count": 10 - k,
            "confidence": 0.52 + k / 20,
            "observed": 0.5 + k / 22,
        }
        for k in range(10)
    ]
    write_run(
        out / "reward",
        [{"step": s, "loss": 0.7 / s, "accuracy": 0.5 + s / 100} for s in range(1, 21)],
        summary={"kind": "reward", "heldout_accuracy": 0.7, "calibration_bins": bins},
        config="kind: reward\n",
    )
    (out / "reward" / "heldout_scores.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "chosen": (i % 7) / 3,
                    "rejected": (i % 5) / 3 - 0.5,
                    "gold_chosen": i % 3,
                    "gold_rejected": 1,
                }
            )
            + "\n"
            for i in range(60)
        )
    )
    write_run(out / "ppo", online_rows(), samples=many_samples())
    summary = {"examples": [{"prompt": "a\x1b[0m", "sft": "sft says", "ppo": "ppo says"}]}
    page = write_quickstart_page(
        out, [("PPO KL to SFT (nats / response)", "-0.020"), ("PPO gold", "0.1")], summary
    )
    with Chromium(BINARY) as browser:
        browser.open(page.as_uri())
        assert check_page_loads(browser) >= 18
        for anchor in ("sft", "reward", "ppo", "reward-calibration", "reward-score_histogram", "examples"):
            assert browser.evaluate(f"document.getElementById('{anchor}') !== null"), anchor
        assert "negative: the k1 estimator" in browser.evaluate("document.body.innerText")
        assert browser.evaluate("document.querySelector('#examples-table td').textContent") == "a\\x1b[0m"
        assert browser.errors() == []
        browser.screenshot(shot_path(tmp_path, "report-quickstart-fixture.png"))


def test_episodes_of_a_tool_run_show_as_conversations_with_calls_results_and_errors_apart(tmp_path):
    from test_report_tools import TOOL_SAMPLES, tool_rows

    write_run(tmp_path / "run", tool_rows(), samples=TOOL_SAMPLES, config="kind: grpo\n")
    page = write_report(tmp_path / "run")
    with Chromium(BINARY) as browser:
        browser.open(page.as_uri())
        check_page_loads(browser)
        for figure in ("tool_calls", "tool_errors", "episodes_cut"):
            assert browser.evaluate(f"document.querySelector('#{figure} img').naturalWidth > 0"), figure
        choose(browser, "sample-sort", "step")
        boxes = browser.evaluate(
            "[...document.querySelectorAll('#samples-table tbody tr')].map(r => "
            "[...r.querySelectorAll('.turn')].map(t => [t.className, t.textContent]))"
        )
        assert boxes[0] == [
            ["turn turn-assistant", 'model<tool_call>{"name": "calculator"}</tool_call>'],
            ["turn turn-call", 'callcalculator({"expression": "123*456"})'],
            ["turn turn-result", "result56088"],
            ["turn turn-call", 'calllookup_word({"w": "x"})'],
            ["turn turn-error", "error: timeout<b>late</b>\\x07"],
            ["turn turn-assistant", "modelThe answer is 56088."],
        ]
        assert boxes[1] == []  # a row without turns keeps its response text
        texts = browser.evaluate(
            "[...document.querySelectorAll('#samples-table td.text')].map(t => t.textContent)"
        )
        assert "no tools in this one" in texts
        assert browser.evaluate("document.querySelectorAll('#samples-table b').length") == 0
        # model turns, calls, results and errors each look different
        colours = browser.evaluate(
            "['turn-assistant', 'turn-call', 'turn-result', 'turn-error'].map(c => "
            "getComputedStyle(document.querySelector('.' + c)).backgroundColor)"
        )
        assert len(set(colours)) == 4 and "rgba(0, 0, 0, 0)" not in colours
        heads = browser.evaluate(
            "[...document.querySelectorAll('#samples-table th')].map(t => t.textContent)"
        )
        assert heads[-1] == "conversation"
        assert browser.errors() == []
        browser.screenshot(shot_path(tmp_path, "report-tools.png"))
