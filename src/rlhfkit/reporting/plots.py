"""The report's figures, drawn with matplotlib's object interface (no pyplot state) and returned as PNG bytes.

Conventions, the same in every figure: steps are whole numbers, so step axes get integer ticks; a series of
fewer than :data:`MARKERS_BELOW` points gets a marker on each point (a held-out series of five evaluations
is five visible points, not a loose line); a warning sign shades the steps it covers in red; a threshold
from :mod:`rlhfkit.reporting.health` is a dotted grey line.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

MARKERS_BELOW = 12
WARN_COLOR = "#d62728"
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


@dataclass
class Line:
    """One series: legend label, x and y, and how it is drawn."""

    label: str
    xs: list[float]
    ys: list[float]
    color: str | None = None
    style: str = "-"  # matplotlib line style: "-", "--", ":", "-."


@dataclass
class Figure:
    """What a line figure shows besides the series."""

    title: str
    ylabel: str
    xlabel: str
    lines: list[Line]
    marks: list[tuple[float, float]] = field(default_factory=list)  # step ranges shaded as warnings
    thresholds: list[float] = field(default_factory=list)  # dotted horizontal lines
    integer_x: bool = True


def _new(width: float = 5.6, height: float = 3.4):
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(width, height), dpi=100)
    return fig, fig.add_subplot()


def _png(fig) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def line_figure(spec: Figure) -> bytes:
    """Lines over steps, markers on short series, integer step ticks, warnings shaded."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _new()
    for x0, x1 in spec.marks:
        if x0 == x1:
            ax.axvline(x0, color=WARN_COLOR, alpha=0.5, linewidth=2)
        else:
            ax.axvspan(x0, x1, color=WARN_COLOR, alpha=0.12, linewidth=0)
    for y in spec.thresholds:
        ax.axhline(y, color="#555555", linestyle=":", linewidth=1)
    for line in spec.lines:
        ax.plot(
            line.xs,
            line.ys,
            label=line.label,
            color=line.color,
            linestyle=line.style,
            marker="o" if len(line.xs) < MARKERS_BELOW else None,
            markersize=4,
            linewidth=1.5,
        )
    if spec.integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(spec.title, fontsize=11)
    ax.set_xlabel(spec.xlabel)
    ax.set_ylabel(spec.ylabel)
    ax.grid(alpha=0.3)
    if len(spec.lines) > 1:
        ax.legend(fontsize=8)
    return _png(fig)


@dataclass
class Points:
    """Scatter points with the step each was taken at."""

    label: str
    xs: list[float]
    ys: list[float]
    steps: list[int]
    color: str | None = None
    marker: str = "o"


def scatter_figure(
    title: str,
    xlabel: str,
    ylabel: str,
    series: list[Points],
    step_label: str = "step",
    color_by_step: bool = True,
) -> bytes:
    """Points, not joined (their order along x is not the order in time); with ``color_by_step`` the
    colour says when each point was taken, otherwise each series has its own colour."""
    fig, ax = _new()
    mappable = None
    for s in series:
        if color_by_step:
            mappable = ax.scatter(
                s.xs,
                s.ys,
                c=s.steps,
                cmap="viridis",
                marker=s.marker,
                s=36,
                label=s.label,
                edgecolors="black",
                linewidths=0.4,
            )
        else:
            ax.scatter(
                s.xs,
                s.ys,
                color=s.color,
                marker=s.marker,
                s=36,
                label=s.label,
                edgecolors="black",
                linewidths=0.4,
            )
    if mappable is not None:
        bar = fig.colorbar(mappable, ax=ax)
        bar.set_label(step_label)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        legend = ax.legend(fontsize=8)
        if color_by_step:
            for handle in legend.legend_handles:
                handle.set_facecolor("white")
    return _png(fig)


def calibration_figure(bins: list[dict]) -> bytes:
    """Reward-model calibration: mean confidence sigmoid(|r_c - r_r|) against how often the preferred
    response is the chosen one, per bin (marker area ~ pairs in the bin); the diagonal is perfect."""
    fig, ax = _new(4.6, 3.8)
    ax.plot([0.5, 1.0], [0.5, 1.0], color="#555555", linestyle=":", linewidth=1, label="perfectly calibrated")
    full = [
        b
        for b in bins
        if b.get("count") and b.get("confidence") is not None and b.get("observed") is not None
    ]
    if full:
        total = sum(b["count"] for b in full)
        ax.plot(
            [b["confidence"] for b in full],
            [b["observed"] for b in full],
            color=COLORS[0],
            linewidth=1,
            label="reward model",
        )
        ax.scatter(
            [b["confidence"] for b in full],
            [b["observed"] for b in full],
            s=[20 + 250 * b["count"] / total for b in full],
            color=COLORS[0],
            zorder=3,
            alpha=0.8,
        )
        for b in full:
            ax.annotate(
                str(b["count"]),
                (b["confidence"], b["observed"]),
                textcoords="offset points",
                xytext=(0, 11),
                ha="center",
                fontsize=7,
            )
    ax.set_xlim(0.48, 1.02)
    ax.set_ylim(min([0.0] + [b["observed"] - 0.05 for b in full]), 1.05)
    ax.set_title("Reward-model calibration (held out)", fontsize=11)
    ax.set_xlabel("confidence sigmoid(|r_chosen - r_rejected|)")
    ax.set_ylabel("fraction where the preferred is chosen")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _png(fig)


def histogram_figure(
    title: str, xlabel: str, groups: list[tuple[str, list[float], str]], bins: int = 30
) -> bytes:
    """Overlaid histograms on shared bins: ``groups`` = [(label, values, colour)]."""
    import numpy as np

    fig, ax = _new(4.6, 3.8)
    values = [v for _, vs, _ in groups for v in vs]
    edges = np.histogram_bin_edges(values, bins=bins) if values else bins
    for name, vs, color in groups:
        ax.hist(vs, bins=edges, alpha=0.5, color=color, label=f"{name} (n={len(vs)})", edgecolor=color)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("pairs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)
