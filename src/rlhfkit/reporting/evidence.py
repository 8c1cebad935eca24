"""The verdicts of docs/experiments.md, computed from the per-seed figures in docs/experiments_data.json.

The data file holds, per claim (keyed by a short name), the section that measures it, the claim, its main
caveat, and one or more comparisons: each with the figure compared, the claimed direction (+1, -1, or 0 for "no
difference") and margin, and its values in one of these forms, all transcribed from the page's own tables:

- ``differences``: the per-seed differences b - a as the page prints them;
- ``a`` and ``b``: the two arms' per-seed values (``a`` may be one number: a threshold every seed is read against);
- ``mean``, ``se``, ``n``: a mean over n values and its standard error (a per-token check, not seeds).

Every verdict is :func:`rlhfkit.reporting.paired.decide` of its comparison. :func:`render` writes the page's
summary table (between ``<!-- verdicts:begin -->`` and ``<!-- verdicts:end -->``) and every verdict cell in the
sections (``<!-- verdict:CLAIM.ID -->word<!-- /verdict -->``); ``python examples/experiments/verdicts.py``
rewrites the page, ``--check`` only says whether it is current (tests/reporting/test_evidence.py runs it).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from rlhfkit.reporting.paired import Claim, Paired, decide, paired, paired_summary

BEGIN, END = "<!-- verdicts:begin -->", "<!-- verdicts:end -->"
CELL = re.compile(r"<!-- verdict:([\w.-]+) -->(.*?)<!-- /verdict -->")
HEADER = (
    "| claim | section | verdict | effect, b − a: mean [95% t-interval]; seeds up / down | main caveat |\n"
    "|---|---|---|---|---|"
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


def verdicts(claims: dict[str, dict[str, Any]]) -> dict[str, str]:
    """``{"CLAIM.ID": word}`` for every comparison."""
    return {
        f"{name}.{comp['id']}": decide(paired_of(comp), claim_of(comp))
        for name, entry in claims.items()
        for comp in entry["comparisons"]
    }


def _signed(x: float, digits: int) -> str:
    return f"{x:+.{digits}f}".replace("-", "−")


def effect(comp: dict[str, Any]) -> str:
    """``+0.74 [+0.50, +0.97]; 5+ 0−`` (the sign counts only where the page has the seeds), with the 90% interval
    beside it where the claim states a margin."""
    p, k = paired_of(comp), comp.get("digits", 2)
    low, high = p.interval(0.95) or (math.nan, math.nan)
    text = f"{_signed(p.mean, k)} [{_signed(low, k)}, {_signed(high, k)}]"
    if comp.get("margin") is not None:
        low90, high90 = p.interval(0.90) or (math.nan, math.nan)
        text += f", 90% [{_signed(low90, k)}, {_signed(high90, k)}] against ±{comp['margin']:g}"
    if p.differences:
        text += f"; {p.positive}+ {p.negative}−"
    return text


def summary_table(claims: dict[str, dict[str, Any]]) -> str:
    """The page's summary: one row per claim, its verdicts and effects labelled where it has several."""
    words = verdicts(claims)
    rows = [HEADER]
    for name, entry in claims.items():
        comps = entry["comparisons"]
        if len(comps) == 1:
            verdict, eff = words[f"{name}.{comps[0]['id']}"], effect(comps[0])
        else:
            verdict = "; ".join(f"{c['label']}: {words[name + '.' + c['id']]}" for c in comps)
            eff = "; ".join(f"{c['label']}: {effect(c)}" for c in comps)
        rows.append(f"| {entry['claim']} | {entry['section']} | {verdict} | {eff} | {entry['caveat']} |")
    return "\n".join(rows)


def render(page: str, claims: dict[str, dict[str, Any]]) -> str:
    """The page with its summary block and every verdict cell as the rule computes them.

    Raises:
        ValueError: no summary block, or a cell naming a comparison the data does not have.
    """
    if page.count(BEGIN) != 1 or page.count(END) != 1:
        raise ValueError(f"the page needs one {BEGIN} ... {END} block for the summary table")
    words = verdicts(claims)
    head, rest = page.split(BEGIN)
    _, tail = rest.split(END)
    page = f"{head}{BEGIN}\n{summary_table(claims)}\n{END}{tail}"

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
