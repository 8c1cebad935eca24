"""The verdicts of docs/experiments.md, computed from the per-seed figures in docs/experiments_data.json.

The data file holds, per claim (keyed by a short name), the section that measures it, the claim, its main
caveat, and one or more comparisons: each with the figure compared, the claimed direction (+1, -1, or 0 for "no
difference") and margin, and its values in one of these forms, all transcribed from the page's own tables:

- ``differences``: the per-seed differences b - a as the page prints them;
- ``a`` and ``b``: the two arms' per-seed values (``a`` may be one number: a threshold every seed is read against);
- ``mean``, ``se``, ``n``: a mean over n values and its standard error (a per-token check, not seeds).

A claim may record ``commit``: the commit its results were run at (the plan's history must show it registered
before; :func:`rlhfkit.reporting.plan.order_problems`). Claims without one were registered after their results.

Every verdict is :func:`rlhfkit.reporting.paired.decide` of its comparison under the registered plan
(docs/experiments_plan.json, :mod:`rlhfkit.reporting.plan`): the plan's direction and margin, and the exact
test's p after Holm's correction over the directional comparisons of the plan's family (a registered
comparison not yet run counts with p = 1; a ``same_as`` repeat takes its original's). :func:`render` writes the
page's summary table (between ``<!-- verdicts:begin -->`` and ``<!-- verdicts:end -->``) and every verdict cell in the
sections (``<!-- verdict:CLAIM.ID -->word<!-- /verdict -->``); ``python examples/experiments/verdicts.py``
rewrites the page, ``--check`` only says whether it is current (tests/reporting/test_evidence.py runs it).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from rlhfkit.reporting.paired import (
    ALPHA,
    Claim,
    Paired,
    decide,
    holm,
    paired,
    paired_summary,
    smallest_exact_p,
)
from rlhfkit.reporting.plan import Plan

BEGIN, END = "<!-- verdicts:begin -->", "<!-- verdicts:end -->"
CELL = re.compile(r"<!-- verdict:([\w.-]+) -->(.*?)<!-- /verdict -->")
HEADER = (
    "| claim | section | verdict | effect, b − a: mean [95% t-interval]; seeds up / down; exact p (Holm) "
    "| main caveat | registered |\n"
    "|---|---|---|---|---|---|"
)


def load(path: str | Path) -> dict[str, dict[str, Any]]:
    """The claims of a data file, checked: every comparison has an id, a direction, a margin where it claims no
    difference, and values in exactly one of the forms of the module's docstring.

    Raises:
        ValueError: naming the claim and comparison at fault.
    """
    claims = json.loads(Path(path).read_text())["claims"]
    for name, entry in claims.items():
        for field in ("section", "claim", "caveat", "comparisons"):
            if field not in entry:
                raise ValueError(f"{path}: claim {name!r} has no {field!r}")
        commit = entry.get("commit")
        if commit is not None and not re.fullmatch(r"[0-9a-f]{7,40}", str(commit)):
            raise ValueError(f"{path}: claim {name!r}: 'commit' must be a commit hash, got {commit!r}")
        ids = [c.get("id") for c in entry["comparisons"]]
        if len(set(ids)) != len(ids) or None in ids:
            raise ValueError(f"{path}: claim {name!r}: every comparison needs its own 'id', got {ids}")
        for comp in entry["comparisons"]:
            try:
                claim_of(comp)
                paired_of(comp)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}: claim {name!r}, comparison {comp['id']!r}: {exc}") from exc
    return claims


def claim_of(comp: dict[str, Any]) -> Claim:
    return Claim(comp["direction"], comp.get("margin"))


def paired_of(comp: dict[str, Any]) -> Paired:
    """The comparison's :class:`Paired`, from whichever form its values take."""
    forms = [k for k in ("differences", "a", "se") if k in comp]
    if len(forms) != 1 or ("a" in comp) != ("b" in comp):
        raise ValueError(f"values in exactly one form (differences; a and b; mean, se, n), got {forms}")
    if "differences" in comp:
        d = comp["differences"]
        return paired([0.0] * len(d), d)
    if "b" in comp:
        b, a = comp["b"], comp["a"]
        return paired([a] * len(b) if isinstance(a, int | float) else a, b)
    return paired_summary(comp["mean"], comp["se"], comp["n"])


def check_against_plan(claims: dict[str, dict[str, Any]], plan: Plan) -> None:
    """Every comparison with data is registered, with the plan's direction and margin and its number of values.

    Raises:
        ValueError: naming the comparison and the field that differs.
    """
    for name, entry in claims.items():
        for comp in entry["comparisons"]:
            key = f"{name}.{comp['id']}"
            planned = plan.comparisons.get(key)
            if planned is None:
                raise ValueError(f"comparison {key!r} has data but no entry in the plan")
            if comp["direction"] != planned.direction or comp.get("margin") != planned.margin:
                raise ValueError(
                    f"comparison {key!r}: the data says direction {comp['direction']}, margin "
                    f"{comp.get('margin')}; the plan registers {planned.direction}, {planned.margin}"
                )
            n = paired_of(comp).n
            if n != planned.n:
                raise ValueError(f"comparison {key!r}: {n} values, the plan registers n = {planned.n}")


def corrected(claims: dict[str, dict[str, Any]], plan: Plan) -> dict[str, float | None]:
    """``{"CLAIM.ID": p}``: each directional comparison's exact p after Holm's correction over its plan family
    (registered members without data count with p = 1; a ``same_as`` repeat takes its original's); None for a
    no-difference claim or a comparison whose values are not kept."""
    exact = {
        f"{name}.{comp['id']}": paired_of(comp).exact_p
        for name, entry in claims.items()
        for comp in entry["comparisons"]
    }
    out: dict[str, float | None] = {}
    for members in plan.family_members().values():
        ps = [1.0 if exact.get(key) is None else exact[key] for key in members]
        out.update(zip(members, holm(ps), strict=True))
    for key, planned in plan.comparisons.items():
        if planned.same_as is not None:
            out[key] = out.get(planned.same_as)
    return {key: (out.get(key) if exact[key] is not None else None) for key in exact}


def verdicts(claims: dict[str, dict[str, Any]], plan: Plan) -> dict[str, str]:
    """``{"CLAIM.ID": word}`` for every comparison with data, decided under the plan."""
    check_against_plan(claims, plan)
    adjusted = corrected(claims, plan)
    words = {}
    for name, entry in claims.items():
        for comp in entry["comparisons"]:
            key = f"{name}.{comp['id']}"
            planned = plan.comparisons[key]
            claim = Claim(planned.direction, planned.margin)
            words[key] = decide(paired_of(comp), claim, adjusted[key])
    return words


def _signed(x: float, digits: int) -> str:
    return f"{x:+.{digits}f}".replace("-", "−")


def effect(comp: dict[str, Any], corrected_p: float | None = None) -> str:
    """``+0.74 [+0.50, +0.97]; 5+ 0−; exact p 0.062 (Holm 0.31)`` (the sign counts and the exact test only where
    the page has the seeds), with the 90% interval beside it where the claim states a margin."""
    p, k = paired_of(comp), comp.get("digits", 2)
    low, high = p.interval(0.95) or (math.nan, math.nan)
    text = f"{_signed(p.mean, k)} [{_signed(low, k)}, {_signed(high, k)}]"
    if comp.get("margin") is not None:
        low90, high90 = p.interval(0.90) or (math.nan, math.nan)
        text += f", 90% [{_signed(low90, k)}, {_signed(high90, k)}] against ±{comp['margin']:g}"
    if p.differences:
        text += f"; {p.positive}+ {p.negative}−"
    if p.exact_p is not None and comp["direction"] != 0:
        text += f"; exact p {p.exact_p:.2g}"
        if corrected_p is not None and corrected_p != p.exact_p:
            text += f" (Holm {corrected_p:.2g})"
    return text


def _word(word: str, comp: dict[str, Any]) -> str:
    """The verdict, with the power reason where an open direction could not have passed the exact test."""
    n = paired_of(comp).n
    if (
        word == "open"
        and comp["direction"] != 0
        and paired_of(comp).differences
        and smallest_exact_p(n) > ALPHA
    ):
        return f"open ({n} seeds: the exact test cannot reach {ALPHA:g})"
    return word


def summary_table(claims: dict[str, dict[str, Any]], plan: Plan) -> str:
    """The page's summary: one row per claim, its verdicts and effects labelled where it has several, and when
    it was registered."""
    words, adjusted = verdicts(claims, plan), corrected(claims, plan)
    rows = [HEADER]
    for name, entry in claims.items():
        comps = entry["comparisons"]
        keys = [f"{name}.{c['id']}" for c in comps]
        if len(comps) == 1:
            verdict, eff = _word(words[keys[0]], comps[0]), effect(comps[0], adjusted[keys[0]])
        else:
            verdict = "; ".join(
                f"{c['label']}: {_word(words[k], c)}" for c, k in zip(comps, keys, strict=True)
            )
            eff = "; ".join(
                f"{c['label']}: {effect(c, adjusted[k])}" for c, k in zip(comps, keys, strict=True)
            )
        when = (
            "after the fact"
            if plan.registered[name] == "after the results"
            else f"before the runs (results at {entry['commit'][:7]})"
        )
        rows.append(
            f"| {entry['claim']} | {entry['section']} | {verdict} | {eff} | {entry['caveat']} | {when} |"
        )
    return "\n".join(rows)


def render(page: str, claims: dict[str, dict[str, Any]], plan: Plan) -> str:
    """The page with its summary block and every verdict cell as the rule computes them under the plan.

    Raises:
        ValueError: no summary block, a cell naming a comparison the data does not have, or data that the plan
            does not register as it is.
    """
    if page.count(BEGIN) != 1 or page.count(END) != 1:
        raise ValueError(f"the page needs one {BEGIN} ... {END} block for the summary table")
    words = verdicts(claims, plan)
    head, rest = page.split(BEGIN)
    _, tail = rest.split(END)
    page = f"{head}{BEGIN}\n{summary_table(claims, plan)}\n{END}{tail}"

    def cell(match: re.Match) -> str:
        key = match.group(1)
        if key not in words:
            raise ValueError(f"verdict cell {key!r}: no such comparison in the data")
        return f"<!-- verdict:{key} -->{words[key]}<!-- /verdict -->"

    return CELL.sub(cell, page)


def sections(page: str) -> dict[str, str]:
    """Each ``##`` and ``###`` section's text, keyed by its heading: from the heading to the next heading of the
    same or a higher level (a ``##`` section includes its ``###`` subsections)."""
    heads = [
        (m.start(), m.end(), len(m.group(1)), m.group(2).strip())
        for m in re.finditer(r"^(#{2,3}) (.+)$", page, re.M)
    ]
    out = {}
    for i, (_, end, level, title) in enumerate(heads):
        stop = next((start for start, _, lv, _ in heads[i + 1 :] if lv <= level), len(page))
        out[title] = page[end:stop]
    return out
