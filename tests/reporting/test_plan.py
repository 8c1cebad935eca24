"""rlhfkit.reporting.plan: docs/experiments_plan.json loads and registers every claim the page decides; a malformed
plan is refused naming its claim, comparison and field; and the git history shows each result recording a commit
was run after its claim was registered (checked on the repository and on a small repository built here)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from rlhfkit.reporting.evidence import load
from rlhfkit.reporting.plan import PlanError, load_plan, order_problems, registration_commits

DOCS = Path(__file__).resolve().parents[2] / "docs"

CENTRAL = (
    "overopt-central",
    "refresh-own-pairs",
    "overfit-central",
    "orm-prm",
    "grpo-ppo",
    "reversed-k3-penalty",
    "length-indifferent",
)


def test_the_plan_registers_the_central_claims_at_20_seeds_and_every_claim_on_the_page():
    plan = load_plan(DOCS / "experiments_plan.json")
    claims = load(DOCS / "experiments_data.json")
    for name in claims:
        assert name in plan.registered, f"claim {name!r} is on the page but not in the plan"
    for name in CENTRAL:
        assert plan.registered[name] == "before the runs"
        members = [c for k, c in plan.comparisons.items() if k.startswith(name + ".")]
        assert members and all(c.n == 20 and c.family == "central" for c in members)
    # every margin carries its reason; the 256-pair refresh row is one hypothesis, not two
    assert all(m["reason"] for m in plan.margins.values())
    assert plan.comparisons["overopt-refresh-control.refresh-plain"].same_as == "overopt-refreshing.ref-256"
    assert "overopt-refresh-control.refresh-plain" not in plan.family_members()["overoptimization"]


def test_the_pages_results_follow_their_registration_in_the_git_history():
    # results without a commit must be registered "after the results" (the page says "after the fact"); results
    # with one must come after the first commit of the plan that registers them. Needs the full history.
    assert order_problems(DOCS / "experiments_plan.json", load(DOCS / "experiments_data.json")) == []


GOOD = {
    "families": {"f": "one family"},
    "margins": {"m": {"value": 0.1, "reason": "evaluation error"}},
    "claims": {
        "x": {
            "registered": "before the runs",
            "family": "f",
            "paired": "seed",
            "seeds": [0, 1, 2],
            "comparisons": {
                "up": {"a": "a", "b": "b", "outcome": "gold", "direction": 1, "n": 3},
                "eq": {"a": "a", "b": "c", "outcome": "gold", "direction": 0, "margin": "m", "n": 3},
            },
        }
    },
}


def _plan_with(tmp_path, change):
    plan = json.loads(json.dumps(GOOD))
    change(plan)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p.pop("margins"), "top level: field 'margins'"),
        (lambda p: p["margins"]["m"].update(value=0), "margin 'm': field 'value'"),
        (lambda p: p["margins"]["m"].update(reason=""), "margin 'm': field 'reason'"),
        (lambda p: p["claims"]["x"].update(registered="later"), "claim 'x': field 'registered'"),
        (lambda p: p["claims"]["x"].update(family="g"), "claim 'x': field 'family'"),
        (lambda p: p["claims"]["x"].update(paired="prompt"), "claim 'x': field 'paired'"),
        (lambda p: p["claims"]["x"].pop("seeds"), "claim 'x': field 'seeds'"),
        (lambda p: p["claims"]["x"].update(comparisons={}), "claim 'x': field 'comparisons'"),
        (lambda p: p["claims"]["x"]["comparisons"]["up"].pop("b"), "comparison 'up': field 'b'"),
        (
            lambda p: p["claims"]["x"]["comparisons"]["up"].update(direction=2),
            "comparison 'up': field 'direction'",
        ),
        (
            lambda p: p["claims"]["x"]["comparisons"]["eq"].pop("margin"),
            "comparison 'eq': field 'margin' is required",
        ),
        (
            lambda p: p["claims"]["x"]["comparisons"]["eq"].update(margin="z"),
            "comparison 'eq': field 'margin' must",
        ),
        (lambda p: p["claims"]["x"]["comparisons"]["up"].update(n=0), "comparison 'up': field 'n' must"),
        (
            lambda p: p["claims"]["x"]["comparisons"]["up"].update(n=5),
            "field 'n' is 5 but the claim registers 3",
        ),
        (lambda p: p["claims"]["x"]["comparisons"]["up"].update(seed=1), "comparison 'up': unknown field"),
        (lambda p: p["claims"]["x"]["comparisons"]["up"].update(same_as="x.up"), "field 'same_as'"),
    ],
)
def test_a_malformed_plan_is_refused_naming_the_claim_and_field(tmp_path, change, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(")):
        load_plan(_plan_with(tmp_path, change))


def test_a_good_plan_loads(tmp_path):
    plan = load_plan(_plan_with(tmp_path, lambda p: None))
    assert plan.comparisons["x.eq"].margin == 0.1 and plan.comparisons["x.up"].margin is None
    assert plan.family_members() == {"f": ["x.up"]}  # the no-difference claim is not in Holm's family
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlanError, match="bad.json: cannot read the plan"):
        load_plan(tmp_path / "bad.json")


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_order_problems_in_a_repository_built_here(tmp_path):
    def git(*args):
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "notes.txt").write_text("before the plan\n")
    git("add", "notes.txt")
    git("commit", "-q", "-m", "before")
    before = git("rev-parse", "HEAD")
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(GOOD))
    git("add", "plan.json")
    git("commit", "-q", "-m", "register x")
    registered = git("rev-parse", "HEAD")
    (tmp_path / "notes.txt").write_text("the runs\n")
    git("commit", "-q", "-am", "results of x")
    after = git("rev-parse", "HEAD")
    assert registration_commits(plan_path) == {"x": registered}
    assert order_problems(plan_path, {"x": {"commit": after}}) == []
    assert order_problems(plan_path, {"x": {"commit": after[:10]}}) == []
    # run at the registration itself, or before it: the results do not follow the plan
    for commit in (registered, before):
        (problem,) = order_problems(plan_path, {"x": {"commit": commit}})
        assert f"claim 'x': its results' commit {commit} does not follow its registration" in problem
    (problem,) = order_problems(plan_path, {"x": {"commit": "0" * 40}})  # a commit the history does not hold
    assert "does not follow" in problem
    (problem,) = order_problems(plan_path, {"x": {}})
    assert "registered before its runs, but its results record no commit" in problem
    (problem,) = order_problems(plan_path, {"y": {"commit": after}})
    assert "claim 'y' has results but is not in the plan" in problem
    # a claim added to the plan later is registered by that later commit
    later = json.loads(json.dumps(GOOD))
    later["claims"]["z"] = later["claims"]["x"]
    plan_path.write_text(json.dumps(later))
    git("commit", "-q", "-am", "register z")
    assert registration_commits(plan_path) == {"x": registered, "z": git("rev-parse", "HEAD")}
    assert order_problems(plan_path, {"x": {"commit": after}}) == []  # x's registration is still the first
    (problem,) = order_problems(plan_path, {"z": {"commit": after}})
    assert "claim 'z'" in problem
    # an uncommitted plan has no history to show the order
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "plan.json").write_text(json.dumps(GOOD))
    with pytest.raises(PlanError, match="no committed history"):
        registration_commits(fresh / "plan.json")
