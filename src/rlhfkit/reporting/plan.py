"""The experiments' registered plan: docs/experiments_plan.json, read and checked.

Per claim (keyed as in docs/experiments_data.json) the plan holds when it was registered (``"before the runs"``
or ``"after the results"``), the correction family its directional comparisons are corrected in, what is paired
(``"seed"``, or ``"token"`` for a per-token mean of one policy), the seeds where it was registered before its
runs, and per comparison: arms ``a`` and ``b`` (the difference read is b − a), the primary ``outcome`` and how it
is read, the ``direction`` (+1, -1, or 0 for "no difference"), the ``margin`` (a key of the plan's ``margins``,
each with its value and its reason; required for direction 0), ``n`` (the values the comparison is over), and
optionally ``same_as``: the ``CLAIM.ID`` of a comparison it repeats (one hypothesis, counted once in its family).

:func:`load_plan` refuses a malformed plan with a :class:`PlanError` naming the file, the claim, the comparison
and the field. :mod:`rlhfkit.reporting.evidence` decides the page's verdicts from this plan. The git history is
the evidence of the order: :func:`registration_commits` finds the first commit of the plan file that holds each
claim, and :func:`order_problems` checks that every result recording a commit was run after its claim was
registered (it needs the repository's history: a full clone, not a shallow one).
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfkit.errors import UserError

REGISTERED = ("before the runs", "after the results")
PAIRED = ("seed", "token")
_COMPARISON_FIELDS = {"a", "b", "outcome", "direction", "margin", "n", "same_as"}


class PlanError(UserError, ValueError):
    """A malformed experiments plan; the message names the file, the claim, the comparison and the field."""


@dataclass(frozen=True)
class Planned:
    """One registered comparison: b − a on ``outcome``, claimed ``direction`` (+1, -1, 0), its margin (value and
    key into the plan's margins, None where the claim states none), over ``n`` values, corrected in ``family``."""

    key: str  # "CLAIM.ID"
    a: str
    b: str
    outcome: str
    direction: int
    margin: float | None
    margin_key: str | None
    n: int
    family: str
    registered: str
    same_as: str | None


@dataclass(frozen=True)
class Plan:
    comparisons: dict[str, Planned]  # by "CLAIM.ID", in the file's order
    families: dict[str, str]  # name -> what the family is
    margins: dict[str, dict[str, Any]]  # key -> {"value", "units", "reason"}
    registered: dict[str, str]  # claim -> "before the runs" / "after the results"

    def family_members(self) -> dict[str, list[str]]:
        """Per family, the directional comparisons corrected together (``same_as`` repeats left out), in order."""
        out: dict[str, list[str]] = {name: [] for name in self.families}
        for key, c in self.comparisons.items():
            if c.direction != 0 and c.same_as is None:
                out[c.family].append(key)
        return out


def _fail(path, where: str, message: str) -> PlanError:
    return PlanError(f"{path}: {where}: {message}")


def _text(path, where, entry, field) -> str:
    value = entry.get(field)
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, where, f"field {field!r} must be a non-empty string, got {value!r}")
    return value


def load_plan(path: str | Path) -> Plan:
    """The plan at ``path``, checked field by field.

    Raises:
        PlanError: the file is not JSON, or a field is missing, unknown or out of range (named with its claim
            and comparison).
    """
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: cannot read the plan: {exc}") from exc
    for field in ("families", "margins", "claims"):
        if not isinstance(raw.get(field), dict) or not raw[field]:
            raise _fail(path, "top level", f"field {field!r} must be a non-empty object")
    families = raw["families"]
    margins = raw["margins"]
    for key, m in margins.items():
        value = m.get("value") if isinstance(m, dict) else None
        if not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
            raise _fail(path, f"margin {key!r}", f"field 'value' must be a number > 0, got {value!r}")
        _text(path, f"margin {key!r}", m, "reason")
    comparisons: dict[str, Planned] = {}
    registered: dict[str, str] = {}
    for name, claim in raw["claims"].items():
        where = f"claim {name!r}"
        if not isinstance(claim, dict):
            raise _fail(path, where, "must be an object")
        if claim.get("registered") not in REGISTERED:
            raise _fail(
                path,
                where,
                f"field 'registered' must be one of {REGISTERED}, got {claim.get('registered')!r}",
            )
        if claim.get("family") not in families:
            raise _fail(
                path,
                where,
                f"field 'family' must name one of the plan's families, got {claim.get('family')!r}",
            )
        if claim.get("paired") not in PAIRED:
            raise _fail(path, where, f"field 'paired' must be one of {PAIRED}, got {claim.get('paired')!r}")
        seeds = claim.get("seeds")
        if claim["registered"] == "before the runs" and (
            not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds)
        ):
            raise _fail(
                path, where, f"field 'seeds' must list the seeds (integers) before the runs, got {seeds!r}"
            )
        if not isinstance(claim.get("comparisons"), dict) or not claim["comparisons"]:
            raise _fail(path, where, "field 'comparisons' must be a non-empty object")
        registered[name] = claim["registered"]
        for cid, comp in claim["comparisons"].items():
            at = f"{where}, comparison {cid!r}"
            unknown = set(comp) - _COMPARISON_FIELDS
            if unknown:
                raise _fail(path, at, f"unknown field(s) {sorted(unknown)}")
            a, b, outcome = (_text(path, at, comp, f) for f in ("a", "b", "outcome"))
            direction = comp.get("direction")
            if direction not in (1, 0, -1) or isinstance(direction, bool):
                raise _fail(path, at, f"field 'direction' must be +1, -1 or 0, got {direction!r}")
            margin_key = comp.get("margin")
            if margin_key is not None and margin_key not in margins:
                raise _fail(
                    path, at, f"field 'margin' must name one of the plan's margins, got {margin_key!r}"
                )
            if direction == 0 and margin_key is None:
                raise _fail(path, at, "field 'margin' is required for a 'no difference' claim (direction 0)")
            n = comp.get("n")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise _fail(path, at, f"field 'n' must be a positive integer, got {n!r}")
            if isinstance(seeds, list) and claim["paired"] == "seed" and n != len(seeds):
                raise _fail(path, at, f"field 'n' is {n} but the claim registers {len(seeds)} seeds")
            comparisons[f"{name}.{cid}"] = Planned(
                f"{name}.{cid}",
                a,
                b,
                outcome,
                direction,
                None if margin_key is None else float(margins[margin_key]["value"]),
                margin_key,
                n,
                claim["family"],
                claim["registered"],
                comp.get("same_as"),
            )
    for key, c in comparisons.items():
        if c.same_as is not None and (c.same_as not in comparisons or c.same_as == key):
            raise _fail(
                path,
                f"comparison {key!r}",
                f"field 'same_as' must name another comparison, got {c.same_as!r}",
            )
    return Plan(comparisons, dict(families), dict(margins), registered)


def _git(cwd: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PlanError(f"git {' '.join(args)} in {cwd}: {exc}") from exc
    if done.returncode != 0:
        raise PlanError(f"git {' '.join(args)} in {cwd}: {done.stderr.strip()}")
    return done.stdout


def registration_commits(path: str | Path) -> dict[str, str]:
    """``{claim: commit}``: the oldest commit of the plan file at ``path`` whose version holds the claim.

    Raises:
        PlanError: git is missing or the file has no committed history (a shallow or absent clone).
    """
    path = Path(path).resolve()
    where = path.parent
    history = "the registration order needs the git history (a full clone)"
    try:
        rel = _git(where, "rev-parse", "--show-prefix").strip() + path.name
        commits = _git(where, "log", "--reverse", "--format=%H", "--", path.name).split()
    except PlanError as exc:
        raise PlanError(f"{path}: no committed history ({exc}); {history}") from exc
    if not commits:
        raise PlanError(f"{path}: no committed history; {history}")
    first: dict[str, str] = {}
    for commit in commits:
        try:
            claims = json.loads(_git(where, "show", f"{commit}:{rel}")).get("claims", {})
        except (PlanError, json.JSONDecodeError):
            continue  # a version that was deleted or not valid JSON registers nothing
        for name in claims:
            first.setdefault(name, commit)
    return first


def order_problems(path: str | Path, results: dict[str, dict[str, Any]]) -> list[str]:
    """What is wrong with the order of registration and results, one line per claim (empty when nothing is):
    a result's recorded ``commit`` must strictly follow the first commit of the plan that registers its claim;
    a claim registered before its runs must have its results' commit recorded; every claim with results must be
    registered.

    Raises:
        PlanError: the plan is malformed or its history cannot be read.
    """
    plan = load_plan(path)
    first = registration_commits(path)
    where = Path(path).resolve().parent
    problems = []
    for name, entry in results.items():
        commit = entry.get("commit")
        if name not in plan.registered:
            problems.append(f"claim {name!r} has results but is not in the plan")
        elif commit is None:
            if plan.registered[name] == "before the runs":
                problems.append(
                    f"claim {name!r} is registered before its runs, but its results record no commit"
                )
        elif name not in first:
            problems.append(
                f"claim {name!r}: no committed version of the plan registers it, yet its results record {commit}"
            )
        else:
            try:
                full = _git(where, "rev-parse", "--verify", f"{commit}^{{commit}}").strip()
                _git(where, "merge-base", "--is-ancestor", first[name], full)
                ordered = full != first[name]
            except PlanError:
                ordered = False
            if not ordered:
                problems.append(
                    f"claim {name!r}: its results' commit {commit} does not follow its registration {first[name][:12]}"
                )
    return problems
