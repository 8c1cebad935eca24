"""examples/experiments/verdicts.py: --check passes on the committed page, fails on a stale copy, and a run
rewrites the stale copy to the committed page; the sections' hand-written Holm values are the family's current
correction."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "experiments" / "verdicts.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_verdicts_script_checks_and_rewrites(tmp_path):
    page = (ROOT / "docs" / "experiments.md").read_text()
    assert run("--check").returncode == 0
    key = "<!-- verdict:overfit.kl0 -->"
    assert key + "open<!-- /verdict -->" in page
    stale = tmp_path / "experiments.md"
    stale.write_text(page.replace(key + "open", key + "holds", 1))
    result = run("--check", "--page", str(stale))
    assert result.returncode == 1 and "differs" in result.stdout
    assert run("--page", str(stale)).returncode == 0
    assert stale.read_text() == page


def test_verdicts_check_needs_the_plans_history(tmp_path):
    # a plan outside the repository has no commits to show the order of registration and results: --check refuses
    plan = tmp_path / "experiments_plan.json"
    plan.write_text((ROOT / "docs" / "experiments_plan.json").read_text())
    result = run("--check", "--plan", str(plan))
    assert (
        result.returncode == 2
        and "no committed history" in result.stderr
        and "Traceback" not in result.stderr
    )


def holm_mismatches(page: str) -> list[str]:
    """The section rows whose "(Holm p)" beside a verdict cell is not the family's corrected p as the data
    file and the plan give it now (Holm's p moves whenever another member of the family gets its data)."""
    from rlhfkit.reporting.evidence import corrected, load
    from rlhfkit.reporting.plan import load_plan

    adjusted = corrected(
        load(ROOT / "docs" / "experiments_data.json"), load_plan(ROOT / "docs" / "experiments_plan.json")
    )
    bad = []
    for line in page.splitlines():
        key, holm = re.search(r"<!-- verdict:([\w.-]+) -->", line), re.findall(r"\(Holm ([0-9.e+-]+)\)", line)
        if key and holm and (adjusted.get(key[1]) is None or f"{adjusted[key[1]]:.2g}" != holm[-1]):
            bad.append(f"{key[1]}: the page says Holm {holm[-1]}, the data give {adjusted.get(key[1])}")
    return bad


def test_the_sections_holm_values_are_the_familys_current_correction():
    page = (ROOT / "docs" / "experiments.md").read_text()
    assert holm_mismatches(page) == []
    # a stale value (as before the family's last member ran) is caught: the refresh row's Holm value planted at 1
    row = re.search(r"[^\n]*\(Holm ([0-9.e+-]+)\) \| <!-- verdict:refresh-own-pairs\.end -->", page)
    assert row and row[1] != "1"
    stale = page.replace(row[0], row[0].replace(f"(Holm {row[1]})", "(Holm 1)"))
    assert len(holm_mismatches(stale)) == 1
    assert holm_mismatches(stale)[0].startswith(
        "refresh-own-pairs.end: the page says Holm 1, the data give 0."
    )
