"""docs/experiments.md against the rule: every verdict on the page is what rlhfkit.reporting.paired.decide computes
from docs/experiments_data.json, the summary table agrees with the sections, and the renderer itself by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlhfkit.reporting.evidence import (
    BEGIN,
    CELL,
    END,
    effect,
    load,
    render,
    sections,
    summary_table,
    verdicts,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def page_and_claims():
    return (DOCS / "experiments.md").read_text(), load(DOCS / "experiments_data.json")


def test_no_verdict_on_the_page_is_hand_written(page_and_claims):
    page, claims = page_and_claims
    assert render(page, claims) == page, (
        "docs/experiments.md is stale: run python examples/experiments/verdicts.py"
    )


def test_every_claim_has_its_section_and_its_cells_there(page_and_claims):
    page, claims = page_and_claims
    by_heading = sections(page)
    words = verdicts(claims)
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
    page, claims = page_and_claims
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


def test_render_by_hand(tmp_path):
    data = {
        "claims": {
            "x": {
                "section": "X",
                "claim": "b is above a",
                "caveat": "none",
                "comparisons": [
                    {
                        "id": "up",
                        "label": "up",
                        "figure": "f",
                        "direction": 1,
                        "differences": [1.0, 1.2, 0.9],
                    },
                    {
                        "id": "eq",
                        "label": "eq",
                        "figure": "f",
                        "direction": 0,
                        "margin": 0.5,
                        "a": 1.0,
                        "b": [1.0, 1.01, 0.99],
                    },
                ],
            }
        }
    }
    path = tmp_path / "data.json"
    path.write_text(json.dumps(data))
    claims = load(path)
    page = (
        f"# P\n\n{BEGIN}\nstale table\n{END}\n\n## X\n\n| up | <!-- verdict:x.up -->open<!-- /verdict --> |\n"
    )
    out = render(page, claims)
    assert "| <!-- verdict:x.up -->holds<!-- /verdict --> |" in out and "stale table" not in out
    assert "| b is above a | X | up: holds; eq: no difference (within ±0.5) |" in out
    # mean 1.0333, sd 0.1528, t_{0.975, 2} = 4.3027: [0.654, 1.413]
    assert "up: +1.03 [+0.65, +1.41]; 3+ 0−" in summary_table(claims)
    assert render(out, claims) == out
    with pytest.raises(ValueError, match="x.nope"):
        render(out + "<!-- verdict:x.nope -->holds<!-- /verdict -->", claims)
    data["claims"]["x"]["comparisons"][0]["a"] = [0.0, 0.0, 0.0]  # two forms at once
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="claim 'x', comparison 'up'"):
        load(path)
    # an interval without its seeds is not a form: every verdict on seeds is computed from the seeds
    data["claims"]["x"]["comparisons"][0] = {
        "id": "up", "label": "up", "figure": "f", "direction": 1, "mean": 1.0, "low95": 0.5, "high95": 1.5, "n": 5,
    }  # fmt: skip
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="exactly one form"):
        load(path)


def test_the_summary_rows_read_by_the_readme_check(page_and_claims):
    # tests/test_readme.py reads the section cell of each row: it must name a heading of the page
    page, _ = page_and_claims
    headings = [h.lower() for h in re.findall(r"^#{2,3} (.+)$", page, re.M)]
    block = page.split(BEGIN)[1].split(END)[0]
    for row in block.strip().splitlines()[2:]:
        assert any(h.startswith(row.split(" | ")[1].strip().lower()) for h in headings)


def test_an_effect_prints_the_95_interval_and_the_90_one_against_a_margin():
    # differences 0.1, 0.3, -0.1: mean 0.1, sd 0.2, se 0.2 / sqrt 3 = 0.1155; t_{0.975, 2} = 4.3027 gives
    # [-0.397, +0.597], t_{0.95, 2} = 2.9200 gives [-0.237, +0.437]
    comp = {"id": "e", "direction": 0, "margin": 0.5, "differences": [0.1, 0.3, -0.1]}
    assert effect(comp) == "+0.10 [−0.40, +0.60], 90% [−0.24, +0.44] against ±0.5; 2+ 1−"
    assert effect({**comp, "direction": 1, "margin": None}) == "+0.10 [−0.40, +0.60]; 2+ 1−"
