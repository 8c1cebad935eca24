"""docs/experiments.md against the rule: every verdict on the page is what rlhfkit.reporting.paired.decide computes
from docs/experiments_data.json under the registered plan (docs/experiments_plan.json, Holm within its
families), the summary table agrees with the sections, and the renderer itself by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlhfkit.reporting.evidence import (
    BEGIN,
    CELL,
    END,
    corrected,
    effect,
    load,
    render,
    sections,
    summary_table,
    verdicts,
)
from rlhfkit.reporting.plan import load_plan

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def page_and_claims():
    return (
        (DOCS / "experiments.md").read_text(),
        load(DOCS / "experiments_data.json"),
        load_plan(DOCS / "experiments_plan.json"),
    )


def test_no_verdict_on_the_page_differs_from_the_plans_computation(page_and_claims):
    page, claims, plan = page_and_claims
    assert render(page, claims, plan) == page, (
        "docs/experiments.md is stale: run python examples/experiments/verdicts.py"
    )


def test_every_verdict_on_the_page_has_a_plan_entry(page_and_claims):
    page, claims, plan = page_and_claims
    for key, _ in CELL.findall(page):
        assert key in plan.comparisons, f"verdict cell {key}: not registered in docs/experiments_plan.json"
    for name, entry in claims.items():
        for comp in entry["comparisons"]:
            assert f"{name}.{comp['id']}" in plan.comparisons


def test_every_claim_has_its_section_and_its_cells_there(page_and_claims):
    page, claims, plan = page_and_claims
    by_heading = sections(page)
    words = verdicts(claims, plan)
    for name, entry in claims.items():
        assert entry["section"] in by_heading, f"claim {name!r}: no section {entry['section']!r} on the page"
        if entry.get("in_section", True):
            cells = {key: word for key, word in CELL.findall(by_heading[entry["section"]])}
            for comp in entry["comparisons"]:
                key = f"{name}.{comp['id']}"
                assert cells.get(key) == words[key], (
                    f"section {entry['section']!r}: no verdict cell for {key}"
                )


def test_the_summary_table_agrees_with_the_sections(page_and_claims):
    page, claims, _ = page_and_claims
    block = page.split(BEGIN)[1].split(END)[0]
    rows = [r for r in block.strip().splitlines()[2:]]
    assert len(rows) == len(claims)
    cells_on_page: dict[str, set[str]] = {}
    for key, word in CELL.findall(page):
        cells_on_page.setdefault(key, set()).add(word)
    for row, (name, entry) in zip(rows, claims.items(), strict=True):
        cols = [c.strip() for c in row.strip("|").split(" | ")]
        assert cols[1] == entry["section"]
        for comp in entry["comparisons"]:
            key = f"{name}.{comp['id']}"
            for word in cells_on_page.get(key, set()):
                assert word in cols[2], (
                    f"summary row {name!r} says {cols[2]!r}, its section {word!r} for {key}"
                )
        # results without a recorded commit were registered after the fact, and the row says so
        assert cols[-1] == ("after the fact" if "commit" not in entry else cols[-1]), name


PLAN = {
    "families": {"f": "the test's family"},
    "margins": {"m": {"value": 0.5, "reason": "a practical threshold for the test"}},
    "claims": {
        "x": {
            "registered": "after the results",
            "family": "f",
            "paired": "seed",
            "comparisons": {
                "up": {"a": "a", "b": "b", "outcome": "f", "direction": 1, "n": 6},
                "up2": {"a": "a", "b": "c", "outcome": "f", "direction": 1, "n": 6},
                "eq": {"a": "a", "b": "b", "outcome": "f", "direction": 0, "margin": "m", "n": 3},
            },
        }
    },
}


def _write(tmp_path, data, plan=PLAN):
    (tmp_path / "data.json").write_text(json.dumps(data))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    return load(tmp_path / "data.json"), load_plan(tmp_path / "plan.json")


def test_render_by_hand(tmp_path):
    up = {
        "id": "up",
        "label": "up",
        "figure": "f",
        "direction": 1,
        "differences": [1.0, 1.2, 0.9, 1.1, 1.0, 0.95],
    }
    eq = {
        "id": "eq",
        "label": "eq",
        "figure": "f",
        "direction": 0,
        "margin": 0.5,
        "a": 1.0,
        "b": [1.0, 1.01, 0.99],
    }
    data = {
        "claims": {"x": {"section": "X", "claim": "b is above a", "caveat": "none", "comparisons": [up, eq]}}
    }
    claims, plan = _write(tmp_path, data)
    page = (
        f"# P\n\n{BEGIN}\nstale table\n{END}\n\n## X\n\n| up | <!-- verdict:x.up -->open<!-- /verdict --> |\n"
    )
    # 6+ 0-: exact p = 2 / 64 = 0.031; its family also registers "up2", not yet run (p = 1): Holm 2 * 0.031
    assert corrected(claims, plan)["x.up"] == pytest.approx(0.0625)
    out = render(page, claims, plan)
    assert "| <!-- verdict:x.up -->open<!-- /verdict --> |" in out and "stale table" not in out
    assert "| b is above a | X | up: open; eq: no difference (within ±0.5) |" in out
    assert out.rstrip().endswith("|") and "| none | after the fact |" in out
    # mean 1.025, sd 0.1084, t_{0.975, 5} = 2.5706: [0.911, 1.139]
    assert "up: +1.03 [+0.91, +1.14]; 6+ 0−; exact p 0.031 (Holm 0.062)" in summary_table(claims, plan)
    assert render(out, claims, plan) == out
    # registered alone in its family, the same figures hold
    alone = json.loads(json.dumps(PLAN))
    del alone["claims"]["x"]["comparisons"]["up2"]
    claims, plan = _write(tmp_path, data, alone)
    assert verdicts(claims, plan)["x.up"] == "holds"
    assert "<!-- verdict:x.up -->holds<!-- /verdict -->" in render(page, claims, plan)
    with pytest.raises(ValueError, match="x.nope"):
        render(out + "<!-- verdict:x.nope -->holds<!-- /verdict -->", claims, plan)
    # the data must say what the plan registers
    data["claims"]["x"]["comparisons"][0] = {**up, "direction": -1}
    claims, plan = _write(tmp_path, data, alone)
    with pytest.raises(ValueError, match="'x.up': the data says direction -1"):
        verdicts(claims, plan)
    data["claims"]["x"]["comparisons"][0] = {**up, "differences": [1.0, 1.2]}
    claims, plan = _write(tmp_path, data, alone)
    with pytest.raises(ValueError, match="2 values, the plan registers n = 6"):
        verdicts(claims, plan)
    data["claims"]["x"]["comparisons"][0] = up
    data["claims"]["x"]["comparisons"].append({**up, "id": "new"})
    claims, plan = _write(tmp_path, data, alone)
    with pytest.raises(ValueError, match="'x.new' has data but no entry in the plan"):
        verdicts(claims, plan)
    del data["claims"]["x"]["comparisons"][-1]
    data["claims"]["x"]["comparisons"][0] = {**up, "a": [0.0] * 6}  # two forms at once
    (tmp_path / "data.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="claim 'x', comparison 'up'"):
        load(tmp_path / "data.json")
    # an interval without its seeds is not a form: every verdict on seeds is computed from the seeds
    data["claims"]["x"]["comparisons"][0] = {
        "id": "up", "label": "up", "figure": "f", "direction": 1, "mean": 1.0, "low95": 0.5, "high95": 1.5, "n": 5,
    }  # fmt: skip
    (tmp_path / "data.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="exactly one form"):
        load(tmp_path / "data.json")
    data["claims"]["x"]["comparisons"][0] = up
    data["claims"]["x"]["commit"] = "not a hash"
    (tmp_path / "data.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'commit' must be a commit hash"):
        load(tmp_path / "data.json")


def test_a_repeated_comparison_is_one_hypothesis(tmp_path):
    d = [1.0, 1.2, 0.9, 1.1, 1.0, 0.95]
    plan = json.loads(json.dumps(PLAN))
    plan["claims"]["x"]["comparisons"]["up2"]["same_as"] = "x.up"
    data = {
        "claims": {
            "x": {
                "section": "X",
                "claim": "c",
                "caveat": "none",
                "comparisons": [
                    {"id": "up", "label": "up", "figure": "f", "direction": 1, "differences": d},
                    {"id": "up2", "label": "up2", "figure": "f", "direction": 1, "differences": d},
                ],
            }
        }
    }
    claims, plan = _write(tmp_path, data, plan)
    # counted once, the family has one member: p = 0.031 uncorrected, for both rows
    assert corrected(claims, plan) == {"x.up": pytest.approx(2 / 64), "x.up2": pytest.approx(2 / 64)}
    assert verdicts(claims, plan) == {"x.up": "holds", "x.up2": "holds"}


def test_the_summary_rows_read_by_the_readme_check(page_and_claims):
    # tests/test_readme.py reads the section cell of each row: it must name a heading of the page
    page, _, _ = page_and_claims
    headings = [h.lower() for h in re.findall(r"^#{2,3} (.+)$", page, re.M)]
    block = page.split(BEGIN)[1].split(END)[0]
    for row in block.strip().splitlines()[2:]:
        assert any(h.startswith(row.split(" | ")[1].strip().lower()) for h in headings)


def test_an_effect_prints_the_95_interval_the_90_one_against_a_margin_and_the_exact_test():
    # differences 0.1, 0.3, -0.1: mean 0.1, sd 0.2, se 0.2 / sqrt 3 = 0.1155; t_{0.975, 2} = 4.3027 gives
    # [-0.397, +0.597], t_{0.95, 2} = 2.9200 gives [-0.237, +0.437]
    comp = {"id": "e", "direction": 0, "margin": 0.5, "differences": [0.1, 0.3, -0.1]}
    assert effect(comp) == "+0.10 [−0.40, +0.60], 90% [−0.24, +0.44] against ±0.5; 2+ 1−"
    # a direction prints its exact test: observed sum 0.3; the 8 flips give ±0.5, ±0.3 (twice each), ±0.1, so
    # 6 of 8 reach |0.3| -> 0.75; Holm's p beside it where it differs
    assert effect({**comp, "direction": 1, "margin": None}) == "+0.10 [−0.40, +0.60]; 2+ 1−; exact p 0.75"
    assert effect({**comp, "direction": 1, "margin": None}, 1.0) == (
        "+0.10 [−0.40, +0.60]; 2+ 1−; exact p 0.75 (Holm 1)"
    )


def test_an_open_direction_on_five_seeds_says_the_power_reason(page_and_claims, tmp_path):
    page, _, _ = page_and_claims
    # order's 1+ 4- "DPO below PPO", once "holds" on its interval alone
    assert "DPO: open (5 seeds: the exact test cannot reach 0.05)" in page.split(BEGIN)[1].split(END)[0]
    d = [0.9, 0.66, 0.65, 0.96, 0.51]
    comp = {"id": "up", "label": "up", "figure": "f", "direction": 1, "differences": d}
    data = {"claims": {"x": {"section": "X", "claim": "c", "caveat": "none", "comparisons": [comp]}}}
    plan = json.loads(json.dumps(PLAN))
    plan["claims"]["x"]["comparisons"] = {"up": {"a": "a", "b": "b", "outcome": "f", "direction": 1, "n": 5}}
    claims, plan = _write(tmp_path, data, plan)
    assert "| up: open (5 seeds: the exact test cannot reach 0.05) |" not in summary_table(claims, plan)
    assert (
        "| open (5 seeds: the exact test cannot reach 0.05) | +0.74 [+0.50, +0.97]; 5+ 0−; exact p 0.062 |"
        in (summary_table(claims, plan))
    )
