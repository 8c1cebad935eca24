"""examples/experiments/verdicts.py: --check passes on the committed page, fails on a stale copy, and a run
rewrites the stale copy to the committed page."""

from __future__ import annotations

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
