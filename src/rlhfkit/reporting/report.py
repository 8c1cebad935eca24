"""The report of a run folder: ``report.html`` (one self-contained page), ``report.md`` and the PNGs behind it.

``rlhfkit report RUN_DIR`` writes, into ``RUN_DIR``: ``report/*.png`` (one figure per group of metrics the
run logged), ``report.md`` that shows them beside the summary figures, and ``report.html``: the same
figures inline, the warning signs of an online run marked on them (:mod:`rlhfkit.reporting.health`: each
a stated rule), the reward model's calibration and held-out score histograms, a browser over the run's
``samples.jsonl`` and, in a run with a distillation teacher (``online.teacher_model``), the student's and the
teacher's responses to the same few prompts side by side (``teacher_samples.jsonl``). Every trainer calls :func:`write_report` at its end, so a finished run always has them.

``rlhfkit report RUN_A RUN_B ...`` also writes one page with the runs side by side (curves overlaid,
summaries in one table): ``compare.html`` in the folder that holds them, or ``--out FILE``.

The plots a person looks at first in RLHF (Zheng et al. 2023, "Secrets of RLHF": watch KL, length and
entropy, not only the reward): the score as trained, named after what scored it (the reward model, the reward
functions, or both) and with the missing-EOS penalty in it, beside each reward function's (and the reward
model's) own score and the share of responses penalised for not ending, so that a gain that came from
learning to stop does not pass for a gain in the reward; on a task with a gold scorer, the gold score; the KL
to the reference; entropy; response length; then the health of the PPO update (clip fraction, approx-KL,
ratio, value loss and explained variance, gradient norms, learning rate). With a gold scorer, gold and
proxy score against sqrt(KL): the axis on which Gao et al. (2022) describe reward-model overoptimization.
A run with tools (``online.tools`` / ``online.environment``) also gets its tool calls and model turns per
episode (a line per tool), the share of calls that failed by cause, and the episodes cut short; its sample
browser shows each episode as a conversation (model turns, calls, results and errors set apart).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlhfkit.errors import UserError
from rlhfkit.reporting import health, page
from rlhfkit.reporting.panels import (
    Plot,
    gold_vs_kl_plot,
    gold_vs_kl_points,
    line_plots,
    reward_model_plots,
    run_warnings,
)
from rlhfkit.reporting.runs import Run, fmt, load_run
from rlhfkit.reporting.sample_file import as_text, printable, read_turns, turns_text

__all__ = ["gold_vs_kl_points", "write_report", "write_reports", "write_quickstart_page"]


def run_plots(run: Run, warnings: list[health.HealthWarning]) -> list[Plot]:
    """Every figure of one run: the line figures, gold/proxy against sqrt(KL), the reward-model figures."""
    figs = line_plots([run], warnings)
    gold = gold_vs_kl_plot([run])
    if gold is not None:
        figs.insert(min(2, len(figs)), gold)
    return figs + reward_model_plots(run)


def write_report(run_dir: str | Path) -> Path:
    """Write ``report/*.png``, ``report.md`` and ``report.html`` for the run in ``run_dir``; return the
    path of ``report.html``."""
    run = load_run(run_dir)
    warnings = run_warnings(run)
    figs = run_plots(run, warnings)
    plot_dir = run.path / "report"
    plot_dir.mkdir(exist_ok=True)
    for old in plot_dir.glob("*.png"):  # figures of an earlier report that this one no longer draws
        old.unlink()
    for p in figs:
        (plot_dir / f"{p.name}.png").write_bytes(p.png)
    (run.path / "report.md").write_text(_markdown(run, figs, warnings), encoding="utf-8")
    out = run.path / "report.html"
    nav = [("summary", "Summary"), ("curves", _curves_title(run))]
    if any(p.name in ("calibration", "score_histogram") for p in figs):
        nav.append(("reward-model", "Reward model"))
    if run.online or run.samples.samples:
        nav.append(("samples", "Samples"))
    if run.side_by_side:
        nav.append(("student-teacher", "Student and teacher"))
    out.write_text(
        page.page(
            f"rlhfkit report: {run.name}",
            f"{run.kind} run in {run.path}",
            run_blocks(run, warnings, figs),
            nav,
        ),
        encoding="utf-8",
    )
    return out


def _curves_title(run: Run) -> str:
    return "PPO health" if run.online else "Training curves"


def run_blocks(
    run: Run, warnings: list[health.HealthWarning], figs: list[Plot], prefix: str = "", level: int = 2
) -> list[str]:
    """The HTML sections of one run: summary, warning signs, curves, reward model, samples, last step."""
    warned = {p.name for p in figs if _plot_keys(p.name) & {w.metric for w in warnings}}
    curves = [p for p in figs if p.name not in ("calibration", "score_histogram", "margin_histogram")]
    reward = [p for p in figs if p.name in ("calibration", "score_histogram", "margin_histogram")]
    blocks = [
        page.heading(level, "Summary", prefix + "summary"),
        page.setup_line(run),
        page.summary_table(run),
    ]
    blocks += [page.heading(level, _curves_title(run), prefix + "curves")]
    if run.online:
        blocks.append(page.warnings_block(warnings, prefix, short=health.too_short(run.series)))
    blocks.append(page.figures_block(curves, warned, prefix))
    if reward:
        blocks += [
            page.heading(level, "Reward model", prefix + "reward-model"),
            page.figures_block(reward, prefix=prefix),
        ]
    if run.online or run.samples.samples:
        blocks += [page.heading(level, "Samples", prefix + "samples"), page.samples_block([run])]
    if run.side_by_side:  # a distillation run: the student's responses beside the teacher's
        blocks += [
            page.heading(level, "Student and teacher", prefix + "student-teacher"),
            page.side_by_side_block(run.side_by_side),
        ]
    blocks.append(page.last_step_block(run))
    return blocks


def _plot_keys(name: str) -> set[str]:
    from rlhfkit.reporting.panels import PANEL

    return {key for spec in PANEL if spec.name == name for key, _, _ in spec.keys}


def write_reports(run_dirs: list[str | Path], out: str | Path | None = None) -> list[Path]:
    """:func:`write_report` for each run folder and, for several, the side-by-side page (``out``, default
    ``compare.html`` in the folder that holds them all). Returns the pages written, the comparison last."""
    if not run_dirs:
        raise UserError("no run folder given")
    names = [Path(d).resolve().name for d in run_dirs]
    if len(set(map(str, (Path(d).resolve() for d in run_dirs)))) < len(run_dirs):
        raise UserError("the same run folder is given twice")
    written = [write_report(d) for d in run_dirs]
    if len(run_dirs) == 1:
        return written
    runs = [load_run(d, name=_unique(names, i)) for i, d in enumerate(run_dirs)]
    target = compare_path(run_dirs, out)
    target.write_text(compare_page(runs), encoding="utf-8")
    return [*written, target]


def compare_path(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Where the side-by-side page goes: ``out`` (a folder: ``compare.html`` in it), else ``compare.html`` in
    the folder that holds all the runs."""
    if out is None:
        return Path(os.path.commonpath([str(Path(d).resolve().parent) for d in run_dirs])) / "compare.html"
    return Path(out) / "compare.html" if Path(out).is_dir() else Path(out)


def _unique(names: list[str], i: int) -> str:
    """A run's name for legends: its folder name, with its position when two folders share a name."""
    return names[i] if names.count(names[i]) == 1 else f"{names[i]} ({i + 1})"


def compare_page(runs: list[Run]) -> str:
    """Several runs on one page: summaries in one table, warning signs per run, curves overlaid, samples."""
    warnings = {r.name: run_warnings(r) for r in runs}
    figs = line_plots(runs)
    gold = gold_vs_kl_plot(runs)
    if gold is not None:
        figs.insert(min(2, len(figs)), gold)
    blocks = [page.heading(2, "Summaries", "summary"), page.comparison_table(runs, warnings)]
    online = [r for r in runs if r.online]
    if online:
        blocks.append(page.heading(2, "Warning signs", "warnings"))
        for r in online:
            blocks += [
                page.heading(3, r.name, f"warnings-{page.anchor(r.name)}"),
                page.warnings_block(
                    warnings[r.name],
                    f"{page.anchor(r.name)}-",
                    shaded=False,
                    short=health.too_short(r.series),
                ),
            ]
    blocks += [page.heading(2, "Curves, overlaid", "curves"), page.figures_block(figs)]
    if any(r.samples.samples for r in runs):
        blocks += [page.heading(2, "Samples", "samples"), page.samples_block(runs)]
    nav = [("summary", "Summaries"), ("curves", "Curves"), ("samples", "Samples")]
    return page.page(
        f"rlhfkit: {len(runs)} runs side by side", ", ".join(str(r.path) for r in runs), blocks, nav
    )


def write_quickstart_page(
    out: str | Path,
    rows: list[tuple[str, str]],
    summary: dict[str, Any],
    stages: tuple[tuple[str, str], ...] = (("sft", "SFT"), ("reward", "Reward model"), ("ppo", "PPO")),
    comparison: list[list[str]] | None = None,
) -> Path:
    """The quickstart's ``report.html``: its figures (``rows``: [(figure, value)]), the policies side by side
    (``comparison``: a header row, then one row per figure), then each stage's run as on that run's own page,
    and the policies' responses to the same held-out prompts."""
    out = Path(out)
    table = "".join(
        f"<tr><th>{page.e(name)}</th><td class=num>{page.e(value)}</td><td>"
        f"{_quickstart_note(name, value)}</td></tr>"
        for name, value in rows
    )
    blocks = [page.heading(2, "Summary", "summary"), f"<table>{table}</table>"]
    nav = [("summary", "Summary")]
    if comparison:
        head = "".join(f"<th>{page.e(cell)}</th>" for cell in comparison[0])
        body = "".join(
            f"<tr><th>{page.e(row[0])}</th>"
            + "".join(f"<td class=num>{page.e(c)}</td>" for c in row[1:])
            + "</tr>"
            for row in comparison[1:]
        )
        blocks += [
            page.heading(2, "The policies side by side", "policies"),
            f'<table id="policies-table"><tr>{head}</tr>{body}</table>',
        ]
        nav.append(("policies", "Policies"))
    for folder, title in stages:
        if not (out / folder / "metrics.jsonl").is_file():
            continue
        run = load_run(out / folder)
        warnings = run_warnings(run)
        blocks += [
            page.heading(2, f"{title} ({folder}/)", folder),
            f'<p class="muted">This stage\'s own page: <a href="{page.e(folder)}/report.html">'
            f"{page.e(folder)}/report.html</a></p>",
        ]
        blocks += run_blocks(run, warnings, run_plots(run, warnings), prefix=f"{folder}-", level=3)
        nav.append((folder, title))
    if summary.get("examples"):
        blocks += [
            page.heading(2, "What the policies write (held-out prompts, sampled)", "examples"),
            page.examples_block(summary["examples"]),
        ]
        nav.append(("examples", "Examples"))
    path = out / "report.html"
    path.write_text(
        page.page("rlhfkit quickstart", f"every stage of the quickstart in {out}", blocks, nav),
        encoding="utf-8",
    )
    return path


def _quickstart_note(name: str, value: str) -> str:
    if "KL" in name and value.startswith("-"):
        return f'<span class="note">{page.e(health.negative_kl_note(-1.0, "k1"))}</span>'
    return ""


def _markdown(run: Run, figs: list[Plot], warnings: list[health.HealthWarning]) -> str:
    estimator = run.kl_estimator
    lines = [f"# rlhfkit report: {run.name}", "", "The same figures, with the samples, in `report.html`.", ""]
    if run.setup:
        lines += [f"Setup: {_md(run.setup)}.", ""]
    flat = {k: v for k, v in run.flat_summary().items() if not isinstance(v, list | dict)}
    if flat:
        lines += ["## Summary", "", "| figure | value |", "|---|---|"]
        for k, v in flat.items():
            note = (
                health.negative_kl_note(v, estimator)
                if k.endswith("kl_mean") and isinstance(v, int | float)
                else None
            )
            lines.append(f"| {_md(run.label(k))} | {fmt(v)}{' (' + note + ')' if note else ''} |")
        lines.append("")
    if run.online:
        lines += ["## Warning signs", ""]
        lines += [
            f"- **{health.describe(w.rule).split(':')[0]}** (steps {w.first_step}-{w.last_step}): {_md(w.message)}"
            for w in warnings
        ] or [
            "None of the rules fired (the rules are listed in report.html)"
            + (f"; but {_md(short)}." if (short := health.too_short(run.series)) else ".")
        ]
        lines.append("")
    last = run.rows[-1]
    lines += [f"## Last logged step ({last['step']})", "", "| metric | value |", "|---|---|"]
    lines += [f"| {_md(run.label(k))} | {fmt(v)} |" for k, v in last.items() if k != "step"]
    lines.append("")
    for p in figs:
        lines += [f"## {p.title}", "", f"![{p.title}](report/{p.name}.png)", ""]
    lines += samples_section(run.path)
    lines += side_by_side_section(run.side_by_side)
    return "\n".join(lines)


def side_by_side_section(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown for a distillation run's ``teacher_samples.jsonl``: the student's and the teacher's response to
    each prompt, at the first and the last step written (:func:`rlhfkit.reporting.page.side_by_side_block`)."""
    if not rows:
        return []
    lines = [
        "## Student and teacher",
        "",
        "From `teacher_samples.jsonl`: each prompt sampled once by the student and once by the teacher, at the "
        "run's temperature.",
        "",
        "| step | split | prompt | student | teacher |",
        "|---|---|---|---|---|",
    ]
    for step in page.side_by_side_steps(rows):
        lines += [
            f"| {r['step']} | {r['split']} | {_cell(r['prompt'])} | {_cell(r['student'])} | {_cell(r['teacher'])} |"
            for r in rows
            if r["step"] == step
        ]
    return [*lines, ""]


def samples_section(run: Path, count: int = 3) -> list[str]:
    """Markdown for ``samples.jsonl`` (online runs): the newest rollout's responses, and the best- and
    worst-scored of the run, each with its score, parts, KL, length and whether it ended with a stop token;
    a multi-turn episode's response as its turns and tool calls (every sample, filtered and sorted, and each
    episode as a conversation, is in ``report.html``)."""
    from rlhfkit.rollout.samples import SAMPLES_FILE, pick_samples, read_samples

    path = run / SAMPLES_FILE
    picked = pick_samples(read_samples(path), count) if path.is_file() else {}
    if not picked:
        return []
    lines = [
        "## Samples",
        "",
        f"From `{SAMPLES_FILE}` (every line is one response; `score` is what entered the "
        "rewards, null when nothing scored it).",
        "",
    ]
    titles = {
        "newest": f"Newest (rollout {picked['newest'][0]['step']})",
        "best": "Best-scored",
        "worst": "Worst-scored",
    }
    for key, title in titles.items():
        if not picked[key]:
            continue
        lines += [
            f"### {title}",
            "",
            "| step | score | parts | KL | length | ended | prompt | response |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in picked[key]:
            parts = ", ".join(f"{k} {fmt(v)}" for k, v in (row.get("parts") or {}).items())
            # a multi-turn episode: its turns and calls, not the row's text
            turns = read_turns(row.get("turns"))
            cells = [
                row["step"],
                fmt(row.get("score")),
                _md(parts),
                fmt(row.get("kl")),
                row.get("length"),
                row.get("ended"),
                _cell(row.get("prompt")),
                _cell(row.get("response")) if turns is None else _cell(turns_text(turns), limit=400),
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    return lines


def _cell(value: Any, limit: int = 200) -> str:
    """Text for a Markdown table cell: messages as 'role: content', one line, control characters escaped,
    pipes escaped, cut at ``limit``."""
    text = _md(as_text(value).replace("\n", " / "))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _md(text: str) -> str:
    """One table cell or list item of markdown: no control characters, no line breaks, no bare pipes."""
    return printable(text, keep_newlines=False).replace("|", "\\|")
