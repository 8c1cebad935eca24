"""``report.html``: one self-contained page (plots inline as base64 PNG, styles and script inline, no request
to the network), built from blocks of HTML that :mod:`rlhfkit.reporting.report` puts in order.

Every piece of text from a run (prompts, responses, metric names, folder names) goes through
:func:`html.escape` here, or through ``textContent`` in the sample browser's script, never into markup raw.
The sample rows travel as JSON in a ``<script type="application/json">`` element with ``<`` escaped, so no
response can close the element.
"""

from __future__ import annotations

import base64
import html
import json
import time
from typing import Any

from rlhfkit import __version__
from rlhfkit.reporting import health
from rlhfkit.reporting.panels import Plot
from rlhfkit.reporting.runs import Run, fmt, label
from rlhfkit.reporting.sample_file import printable

MAX_SAMPLES = 5000  # rows embedded in the page (the newest ones); samples.jsonl keeps them all

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1500px;padding:0 20px 40px;
color:#1d1d1f;background:#fff;line-height:1.4}
h1{font-size:1.6em;margin:18px 0 4px}h2{font-size:1.3em;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
h3{font-size:1.1em;margin:18px 0 6px}.muted{color:#666;font-size:.9em}nav a{margin-right:14px}
table{border-collapse:collapse;font-size:.92em}td,th{border:1px solid #ddd;padding:3px 8px;vertical-align:top}
th{background:#f4f4f6;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));gap:14px}
figure{margin:0;border:1px solid #e4e4e7;border-radius:6px;padding:6px;background:#fff}
figure.warn{border-color:#d62728;box-shadow:0 0 0 1px #d62728}
figure img{width:100%;height:auto;display:block}figcaption{font-size:.85em;color:#444;margin-top:2px}
.warnings{border-left:4px solid #d62728;background:#fdf2f2;padding:6px 12px;margin:10px 0}
.ok{border-left:4px solid #2ca02c;background:#f2fbf2;padding:6px 12px;margin:10px 0}
.note{color:#8a5a00;font-size:.85em}
#samples-controls{display:flex;flex-wrap:wrap;gap:12px;align-items:center;margin:8px 0}
td.text{white-space:pre-wrap;max-width:520px;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.85em}
#samples-table .parts{font-size:.85em;color:#333}
.turn{border-left:4px solid;border-radius:3px;padding:2px 6px;margin:3px 0;white-space:pre-wrap}
.turn .who{font-family:system-ui,sans-serif;font-weight:600;font-size:.9em;margin-right:6px}
.turn-assistant{border-color:#1f77b4;background:#f1f6fb}.turn-call{border-color:#9467bd;background:#f6f1fb}
.turn-result{border-color:#2ca02c;background:#f1faf1}.turn-error{border-color:#d62728;background:#fdf0f0}
"""

SCRIPT = r"""
(function(){
  const el = document.getElementById("samples-data");
  if (!el) return;
  const rows = JSON.parse(el.textContent);
  const stepSel = document.getElementById("sample-step"), sortSel = document.getElementById("sample-sort"),
        orderSel = document.getElementById("sample-order"), runSel = document.getElementById("sample-run"),
        body = document.querySelector("#samples-table tbody"), count = document.getElementById("sample-count");
  const gold = document.getElementById("samples-table").dataset.gold === "1";  // a gold column only with gold
  const steps = [...new Set(rows.map(r => r.step).filter(s => s !== null))].sort((a, b) => a - b);
  for (const s of steps) { const o = document.createElement("option"); o.value = String(s); o.textContent = String(s); stepSel.append(o); }
  const num = v => (v === null || v === undefined) ? "n/a" : (Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(4))));
  function cell(tr, text, cls) { const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; tr.append(td); }
  // a multi-turn episode: one box per model turn, tool call, result and error (text only, never markup)
  function turn(td, cls, who, text) {
    const div = document.createElement("div"), label = document.createElement("span");
    div.className = "turn " + cls; label.className = "who"; label.textContent = who;
    div.append(label, document.createTextNode(text)); td.append(div);
  }
  function conversation(tr, turns) {
    const td = document.createElement("td"); td.className = "text conversation";
    for (const t of turns) {
      if (t.role !== "tool") { turn(td, "turn-assistant", t.role === "assistant" ? "model" : t.role, t.text); continue; }
      turn(td, "turn-call", "call", t.name + "(" + t.arguments + ")");
      if (t.error === null) turn(td, "turn-result", "result", t.result);
      else turn(td, "turn-error", "error: " + t.error, t.result);
    }
    tr.append(td);
  }
  function render() {
    const step = stepSel.value, run = runSel ? runSel.value : "all", key = sortSel.value, dir = orderSel.value === "asc" ? 1 : -1;
    let shown = rows.filter(r => (step === "all" || String(r.step) === step) && (run === "all" || r.run === run));
    shown.sort((a, b) => {
      const x = a[key], y = b[key];
      if (x === null || x === undefined) return (y === null || y === undefined) ? 0 : 1;  // missing values last
      if (y === null || y === undefined) return -1;
      return (x - y) * dir;
    });
    body.replaceChildren();
    for (const r of shown) {
      const tr = document.createElement("tr");
      tr.dataset.step = String(r.step); tr.dataset.score = String(r.score); tr.dataset.gold = String(r.gold);
      tr.dataset.kl = String(r.kl); tr.dataset.length = String(r.length);
      if (runSel) cell(tr, r.run);
      cell(tr, num(r.step), "num"); cell(tr, num(r.score), "num"); if (gold) cell(tr, num(r.gold), "num");
      cell(tr, num(r.kl), "num"); cell(tr, num(r.length), "num");
      cell(tr, r.ended === null ? "n/a" : (r.ended ? "yes" : "no"));
      cell(tr, Object.entries(r.parts).map(([k, v]) => k + ": " + num(v)).join("\n"), "parts text");
      cell(tr, r.prompt, "text");
      if (r.turns) { tr.dataset.turns = String(r.turns.length); conversation(tr, r.turns); } else cell(tr, r.response, "text");
      body.append(tr);
    }
    count.textContent = "showing " + shown.length + " of " + rows.length + " samples";
  }
  for (const c of [stepSel, sortSel, orderSel, runSel]) if (c) c.addEventListener("change", render);
  render();
})();
"""


def e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def anchor(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def page(title: str, subtitle: str, blocks: list[str], nav: list[tuple[str, str]] = ()) -> str:
    """The whole document: ``blocks`` of HTML in order, a table of contents from ``nav`` [(anchor, title)]."""
    links = " ".join(f'<a href="#{e(a)}">{e(t)}</a>' for a, t in nav)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{e(title)}</title>'
        f"<style>{CSS}</style></head><body>\n<h1>{e(title)}</h1>\n"
        f'<p class="muted">{e(subtitle)} &middot; written {stamp} by rlhfkit {e(__version__)}</p>\n'
        + (f"<nav>{links}</nav>\n" if links else "")
        + "\n".join(blocks)
        + f"\n<script>{SCRIPT}</script>\n</body></html>\n"
    )


def heading(level: int, text: str, anchor_id: str | None = None) -> str:
    return f'<h{level} id="{e(anchor_id or anchor(text))}">{e(text)}</h{level}>'


def setup_line(run: Run) -> str:
    """The run's model, LoRA and precision (:attr:`Run.setup`) as one line, or nothing."""
    return f'<p class="setup">{e(run.setup)}</p>' if run.setup else ""


def summary_table(run: Run) -> str:
    """The run's ``summary.json`` as figure | value, with readable names; lists (calibration bins,
    examples) are drawn or shown elsewhere."""
    estimator = run.kl_estimator
    rows = []
    for key, value in run.flat_summary().items():
        if isinstance(value, list | dict):
            continue
        rows.append(
            f"<tr><th>{e(run.label(key))}</th><td class=num>{e(fmt(value))}</td>"
            f"<td>{_kl_note(key, value, estimator)}</td></tr>"
        )
    if not rows:
        return '<p class="muted">No summary.json (the run has not finished).</p>'
    return f'<table class="summary"><tr><th>figure</th><th>value</th><th></th></tr>{"".join(rows)}</table>'


def _kl_note(key: str, value: Any, estimator: str | None) -> str:
    if not (key.endswith("kl_mean") or key.endswith("kl/mean")) or not isinstance(value, int | float):
        return ""
    note = health.negative_kl_note(float(value), estimator)
    return f'<span class="note">{e(note)}</span>' if note else ""


def comparison_table(runs: list[Run], warnings: dict[str, list[health.HealthWarning]]) -> str:
    """The runs' summaries in one table: one row per figure, one column per run."""
    flats = [r.flat_summary() for r in runs]
    keys: list[str] = []
    for flat in flats:
        keys += [
            k for k, v in flat.items() if k not in keys and k != "kind" and not isinstance(v, list | dict)
        ]
    head = "".join(f"<th>{e(r.name)}</th>" for r in runs)
    body = [
        f"<tr><th>kind</th>{''.join(f'<td>{e(r.kind)}</td>' for r in runs)}</tr>",
        f"<tr><th>folder</th>{''.join(f'<td>{e(r.path)}</td>' for r in runs)}</tr>",
        f"<tr><th>warning signs</th>{''.join(f'<td class=num>{len(warnings.get(r.name, []))}</td>' for r in runs)}</tr>",
    ]
    for key in keys:
        cells = "".join(f"<td class=num>{e(fmt(flat.get(key)))}</td>" for flat in flats)
        names = {r.label(key) for r in runs}  # runs scored by different sources share the plain words
        body.append(f"<tr><th>{e(names.pop() if len(names) == 1 else label(key))}</th>{cells}</tr>")
    return f'<table class="comparison"><tr><th>figure</th>{head}</tr>{"".join(body)}</table>'


def warnings_block(
    warnings: list[health.HealthWarning], plot_anchor: str = "", shaded: bool = True, short: str | None = None
) -> str:
    """The warning signs that fired, then every rule in words (what was checked); ``shaded``: the plots
    below mark them; ``short``: :func:`rlhfkit.reporting.health.too_short`'s words, said beside "no warning
    sign fired"."""
    rules = "".join(f"<li>{e(text)}</li>" for text, _ in health.RULES.values())
    rules_html = (
        f"<details><summary>The rules checked</summary><ul>{rules}</ul>"
        "<p class=muted>Trend rules compare thirds of the logged points and need at least "
        f"{health.MIN_POINTS} of them.</p></details>"
    )
    if not warnings:
        caveat = f" But {e(short)}." if short else ""
        return f'<div class="ok">No warning sign fired.{caveat}{rules_html}</div>'
    items = "".join(
        f"<li><b>{e(health.describe(w.rule).split(':')[0])}</b> ({e(label(w.metric))}, steps "
        f"{w.first_step}-{w.last_step}): {e(w.message)}</li>"
        for w in warnings
    )
    where = " (shaded red on the plots)" if shaded else ""
    return (
        f'<div class="warnings" id="{e(plot_anchor)}warning-signs"><b>Warning signs</b>{where}'
        f"<ul>{items}</ul>{rules_html}</div>"
    )


def figures_block(figs: list[Plot], warned: set[str] = frozenset(), prefix: str = "") -> str:
    """The plots as a grid of inline PNGs; a plot with a warning sign gets a red frame."""
    cells = []
    for p in figs:
        data = base64.b64encode(p.png).decode("ascii")
        cls = ' class="warn"' if p.name in warned else ""
        cells.append(
            f'<figure id="{e(prefix + p.name)}"{cls}><img alt="{e(p.title)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{e(p.title)}</figcaption></figure>'
        )
    return f'<div class="grid">{"".join(cells)}</div>' if cells else ""


def last_step_block(run: Run) -> str:
    last = run.rows[-1]
    rows = "".join(
        f"<tr><th>{e(run.label(k))}</th><td class=num>{e(fmt(v))}</td><td class=muted>{e(k)}</td></tr>"
        for k, v in last.items()
        if k != "step"
    )
    return (
        f"<details><summary>Every metric of the last logged step ({last['step']})</summary>"
        f"<table><tr><th>metric</th><th>value</th><th>key in metrics.jsonl</th></tr>{rows}</table></details>"
    )


def samples_block(runs: list[Run]) -> str:
    """The sample browser over the runs' ``samples.jsonl``: filter by step (and run), sort by a column."""
    rows = []
    for run in runs:
        rows += [
            {
                **s.to_json(),
                "prompt": printable(s.prompt),
                "response": printable(s.response),
                "turns": _printable_turns(s.turns),
                "run": run.name,
            }
            for s in run.samples.samples
        ]
    skipped = sum(r.samples.skipped_lines for r in runs)
    if not rows:
        return (
            '<p class="muted">No samples.jsonl in this run (the online trainer writes one: '
            "<code>logging.samples_per_step</code>).</p>"
        )
    dropped = max(0, len(rows) - MAX_SAMPLES)
    rows = rows[-MAX_SAMPLES:]
    data = json.dumps(rows, ensure_ascii=False, allow_nan=False).replace("<", "\\u003c")
    many = len(runs) > 1
    run_select = ""
    if many:
        opts = "".join(f'<option value="{e(r.name)}">{e(r.name)}</option>' for r in runs)
        run_select = (
            f'<label>run <select id="sample-run"><option value="all">all</option>{opts}</select></label>'
        )
    # A gold column (and sort) only where an annotator gave gold scores: a run scored by reward functions or a
    # reward model alone has none, and a column of n/a says nothing.
    gold = any(row.get("gold") is not None for row in rows)
    episodes = any(row["turns"] for row in rows)  # a run with tools: its episodes' turns in place of the text
    sort_opts = "".join(
        f'<option value="{k}">{t}</option>'
        for k, t in (
            ("score", "score (as trained)"),
            *((("gold", "gold score"),) if gold else ()),
            ("kl", "KL"),
            ("length", "length"),
            ("step", "step"),
        )
    )
    notes = []
    if dropped:
        notes.append(f"the {dropped} oldest rows are left out of the page")
    if skipped:
        notes.append(f"{skipped} line(s) of samples.jsonl were not JSON objects and are skipped")
    head = "".join(
        f"<th>{t}</th>"
        for t in (["run"] if many else [])
        + ["step", "score (as trained)", *(["gold"] if gold else []), "KL", "length", "ended"]
        + ["reward parts (own scores)", "prompt", "conversation" if episodes else "response"]
    )
    return (
        f'<div id="samples-controls">{run_select}<label>step <select id="sample-step"><option value="all">all'
        f'</option></select></label><label>sort by <select id="sample-sort">{sort_opts}</select></label>'
        '<label>order <select id="sample-order"><option value="desc">highest first</option>'
        '<option value="asc">lowest first</option></select></label><span id="sample-count" class="muted">'
        f"</span></div>{'<p class=muted>' + e('; '.join(notes)) + '</p>' if notes else ''}"
        f'<table id="samples-table" data-gold="{int(gold)}"><thead><tr>{head}</tr></thead><tbody></tbody></table>'
        f'<script type="application/json" id="samples-data">{data}</script>'
    )


def _printable_turns(turns: list[dict] | None) -> list[dict] | None:
    """An episode's turns with every text field's control characters escaped (:func:`printable`)."""
    if turns is None:
        return None
    return [{k: None if v is None else printable(v) for k, v in t.items()} for t in turns]


def examples_block(examples: list[dict[str, Any]]) -> str:
    """The quickstart's side-by-side examples: prompt, then the SFT, DPO (when there) and PPO responses."""
    policies = [
        (k, t) for k, t in (("sft", "SFT"), ("dpo", "DPO"), ("ppo", "PPO")) if any(k in x for x in examples)
    ]
    rows = "".join(
        f'<tr><td class="text">{e(printable(str(x.get("prompt", ""))))}</td>'
        + "".join(f'<td class="text">{e(printable(str(x.get(k, ""))))}</td>' for k, _ in policies)
        + "</tr>"
        for x in examples
    )
    head = "".join(f"<th>{t}</th>" for _, t in policies)
    return (
        f'<table id="examples-table"><tr><th>prompt (held out)</th>{head}</tr>{rows}</table>' if rows else ""
    )


def side_by_side_steps(rows: list[dict[str, Any]]) -> list[int | None]:
    """The steps of ``teacher_samples.jsonl`` rows that the report shows: the first and the last."""
    steps = sorted({r["step"] for r in rows if r["step"] is not None})
    return steps[:1] + steps[1:][-1:] if steps else [None]


def side_by_side_block(rows: list[dict[str, Any]]) -> str:
    """A distillation run's ``teacher_samples.jsonl``: per prompt, the student's response beside the teacher's,
    both sampled at the run's temperature, at the first and the last step it was written."""
    shown = [r for step in side_by_side_steps(rows) for r in rows if r["step"] == step]
    body = "".join(
        f'<tr><td class=num>{e(str(r["step"]))}</td><td class="text prompt">{e(printable(r["prompt"]))}</td>'
        f'<td class="text student">{e(printable(r["student"]))}</td>'
        f'<td class="text teacher">{e(printable(r["teacher"]))}</td></tr>'
        for r in shown
    )
    where = "held-out" if all(r["split"] == "eval" for r in rows) else "training"
    return (
        f'<p class="muted">The student (the policy as trained up to that step) and the teacher '
        f"(<code>online.teacher_model</code>), each sampled once on the same {where} prompts at the run's "
        f"temperature; every evaluation's rows are in <code>teacher_samples.jsonl</code>.</p>"
        f'<table id="side-by-side-table"><tr><th>step</th><th>prompt ({where})</th><th>student</th>'
        f"<th>teacher</th></tr>{body}</table>"
    )
