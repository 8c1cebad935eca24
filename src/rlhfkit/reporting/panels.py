"""Which figures a run (or several runs side by side) gets, drawn from its metrics and files.

:data:`PANEL` lists the line figures in page order, each with the metric keys it overlays; a figure is drawn
when one of its keys was logged. Policy and value loss have a figure each (their scales differ by orders of
magnitude, so one shared axis flattens the policy loss). Held-out series are dashed; with several runs, each
run has its colour and each series its line style.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhfkit.reporting import health, plots
from rlhfkit.reporting.runs import Run
from rlhfkit.rollout.sandbox import uses_sandbox

STYLES = ("-", ":", "-.")


@dataclass(frozen=True)
class Spec:
    """A line figure: file name, title, y label, [(metric key, legend, held out)], threshold lines."""

    name: str
    title: str
    ylabel: str
    keys: tuple[tuple[str, str, bool], ...]
    thresholds: tuple[float, ...] = ()


PANEL: tuple[Spec, ...] = (
    Spec(
        "scores",
        "Score per response",
        "score",
        (
            ("score/mean", "trained score", False),
            ("gold/mean", "gold, training", False),
            ("eval/score/mean", "held out", True),
            ("eval/gold/mean", "gold, held out", True),
        ),
    ),
    Spec(
        "kl",
        "KL to the reference policy",
        "nats per response",
        (("kl/mean", "training (trained estimator)", False), ("eval/kl/mean", "held out", True)),
    ),
    Spec(
        "teacher_kl",
        "KL to the teacher (on-policy distillation)",
        "nats per token",
        (
            ("distill/teacher_kl", "log pi - log pi_teacher of the sampled tokens, training", False),
            ("eval/distill/teacher_kl", "held out", True),
        ),
    ),
    Spec("entropy", "Policy entropy", "nats per token", (("entropy/mean", "entropy", False),)),
    Spec(
        "response_length",
        "Response length",
        "tokens",
        (("response_length/mean", "training", False), ("eval/response_length/mean", "held out", True)),
    ),
    Spec(
        "ended",
        "Responses that end with a stop token",
        "fraction",
        (
            ("response/ended_frac", "ended, training", False),
            ("eval/response/ended_frac", "ended, held out", True),
            ("score/penalised_frac", "penalised for not ending (score replaced)", False),
        ),
        (health.ENDED_LOW,),
    ),
    Spec(
        "clipfrac",
        "Clip fraction",
        "fraction of tokens clipped",
        (("clipfrac", "policy", False), ("value/clipfrac", "value", False)),
        (health.CLIPFRAC_HIGH,),
    ),
    Spec(
        "approx_kl",
        "Approx. KL between updates",
        "nats per token",
        (("approx_kl", "approx. KL", False),),
        (health.APPROX_KL_HIGH,),
    ),
    Spec(
        "ratio",
        "Probability ratio pi / pi_old",
        "mean ratio",
        (("ratio/mean", "ratio", False),),
        (1 - health.RATIO_BAND, 1 + health.RATIO_BAND),
    ),
    Spec("policy_loss", "Policy loss", "loss", (("loss/policy", "policy", False),)),
    Spec("value_loss", "Value loss", "loss", (("loss/value", "value", False),)),
    Spec(
        "explained_variance",
        "Value explained variance",
        "1 - Var(returns - values) / Var(returns)",
        (("value/explained_variance", "explained variance", False),),
        (0.0,),
    ),
    Spec("losses", "Loss", "loss", (("loss", "training", False), ("eval/loss", "held out", True))),
    Spec(
        "accuracy",
        "Pair accuracy (reward model; DPO: implicit reward)",
        "accuracy",
        (
            ("accuracy", "train", False),
            ("eval/accuracy", "held out vs labels", True),
            ("eval/gold_accuracy", "held out vs gold", True),
        ),
    ),
    Spec(
        "grad_norm",
        "Gradient norm (before clipping)",
        "L2 norm",
        (
            ("grad_norm", "model", False),
            ("grad_norm/actor", "actor", False),
            ("grad_norm/critic", "critic", False),
        ),
    ),
    Spec(
        "learning_rate",
        "Learning rate",
        "learning rate",
        (
            ("learning_rate", "model", False),
            ("learning_rate/actor", "actor", False),
            ("learning_rate/critic", "critic", False),
        ),
    ),
    Spec("kl_coef", "KL coefficient", "kl_coef", (("kl_coef", "kl_coef", False),)),
    # multi-turn runs with tools (online.tools / online.environment); run_keys adds one line per tool and per
    # cause of failure that the run logged
    Spec(
        "tool_calls",
        "Tool calls and model turns per episode",
        "per episode",
        (("tools/calls_per_episode", "tool calls, all tools", False), ("turns/mean", "model turns", False)),
    ),
    Spec(
        "tool_errors",
        "Tool calls that failed, by cause",
        "share of the calls",
        (("tools/errors", "all causes", False),),
    ),
    Spec(
        "episodes_cut",
        "Episodes cut short",
        "share of the episodes",
        (
            ("episodes/truncated", "cut by the length budget (truncated)", False),
            ("episodes/max_turns", "stopped at online.max_turns with a call unanswered", False),
        ),
    ),
    Spec(
        "dpo_logratios",
        "DPO log-ratios log pi / pi_ref",
        "nats per response",
        (
            ("logratio/chosen", "chosen, train", False),
            ("logratio/rejected", "rejected, train", False),
            ("eval/logratio/chosen", "chosen, held out", True),
            ("eval/logratio/rejected", "rejected, held out", True),
        ),
        (0.0,),
    ),
)


@dataclass
class Plot:
    """A drawn figure: its file name (without .png), title and PNG bytes."""

    name: str
    title: str
    png: bytes


def run_warnings(run: Run) -> list[health.HealthWarning]:
    if not run.online:
        return []
    return [*sandbox_warnings(run), *health.check_health(run.series)]


def sandbox_warnings(run: Run) -> list[health.HealthWarning]:
    """A run whose model-written code ran without bubblewrap (``online.sandbox: none``) says so."""
    online = run.config.get("online") or {}
    specs = [*(online.get("tools") or []), *(online.get("reward_functions") or [])]
    if online.get("sandbox") != "none" or not uses_sandbox(specs):
        return []
    steps = run.series("score/mean")[0] or [0]
    message = (
        "online.sandbox=none: model-written code ran as a plain child process with limits only, not isolated "
        "from the machine's files and network"
    )
    return [health.HealthWarning("sandbox_none", "score/mean", steps[0], steps[-1], message)]


def run_keys(spec: Spec, run: Run) -> tuple[tuple[str, str, bool], ...]:
    """The lines of figure ``spec`` for ``run``: the score figure names the trained score after what scored it
    and adds each score part's own score beside it (each reward function and the reward model, before the
    missing-EOS rule), or, for a single part, the score before the rule when that differs; a gain of the
    trained score that its parts do not share came from the rule (learning to stop), not from the reward."""
    if spec.name == "tool_calls":  # one line per tool: its calls per episode
        tools = run.keys_under("tools/calls/")
        return (*spec.keys, *((key, f"{key[len('tools/calls/') :]} calls", False) for key in tools))
    if spec.name == "tool_errors":  # one line per cause that ever happened (the run logs every cause, as 0)
        causes = [key for key in run.keys_under("tools/errors/") if any(run.series(key)[1])]
        return (*spec.keys, *((key, key[len("tools/errors/") :].replace("_", " "), False) for key in causes))
    if spec.name != "scores":
        return spec.keys
    source = run.reward_source
    trained = "trained score"
    if source is not None:
        trained += f" ({source}{' + missing-EOS penalty' if run.penalised else ''})"
    parts = [
        (f"score/{name}", f"{'reward model' if name == 'reward_model' else name}: own score", False)
        for name in run.reward_parts
        if run.series(f"score/{name}")[0]
    ]
    if not parts and run.series("score/raw_mean") != run.series("score/mean"):
        parts = [("score/raw_mean", "before the missing-EOS rule", False)]
    held_out = "held out" + (" (before the missing-EOS rule)" if source is not None else "")
    named = {"score/mean": trained, "eval/score/mean": held_out}
    keys = [(key, named.get(key, legend), heldout) for key, legend, heldout in spec.keys]
    return (keys[0], *parts, *keys[1:])


def line_plots(runs: list[Run], warnings: list[health.HealthWarning] | None = None) -> list[Plot]:
    """Every :data:`PANEL` figure that one of ``runs`` logged, runs overlaid (one colour per run)."""
    many = len(runs) > 1
    xlabel = runs[0].step_label if len({r.step_label for r in runs}) == 1 else "step"
    out = []
    for spec in PANEL:
        lines = []
        for r, run in enumerate(runs):
            for k, (key, legend, heldout) in enumerate(run_keys(spec, run)):
                xs, ys = run.series(key)
                if xs:
                    color = plots.COLORS[(r if many else k) % len(plots.COLORS)]
                    style = "--" if heldout else STYLES[k % len(STYLES)] if many else "-"
                    lines.append(
                        plots.Line(f"{run.name}: {legend}" if many else legend, xs, ys, color, style)
                    )
        if not lines:
            continue
        keys = {key for key, _, _ in spec.keys}
        marks = [(w.first_step, w.last_step) for w in warnings or [] if w.metric in keys]
        png = plots.line_figure(
            plots.Figure(spec.title, spec.ylabel, xlabel, lines, marks, list(spec.thresholds))
        )
        out.append(Plot(spec.name, spec.title, png))
    return out


def gold_vs_kl_points(rows: list[dict]) -> dict[str, tuple[list[float], list[float], list[int]]]:
    """sqrt(KL) against the gold and proxy scores, from the rows that logged both (Gao et al. 2022):
    ``{"gold": (sqrt_kl, score, steps), "proxy": ...}``, held-out figures when there are any; empty without a
    gold score (nothing to compare the proxy with). A negative k1 KL counts as 0."""
    out = {}
    for kl_key, score_key, name in (
        ("eval/kl/mean", "eval/gold/mean", "gold"),
        ("eval/kl/mean", "eval/score/mean", "proxy"),
        ("kl/mean", "gold/mean", "gold"),
        ("kl/mean", "score/mean", "proxy"),
    ):
        if name in out:
            continue
        pts = [
            (math.sqrt(max(r[kl_key], 0.0)), r[score_key], r["step"])
            for r in rows
            if _finite(r.get(kl_key)) and _finite(r.get(score_key))
        ]
        if pts:
            out[name] = ([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts])
    return out if "gold" in out else {}


def gold_vs_kl_plot(runs: list[Run]) -> Plot | None:
    many = len(runs) > 1
    series = []
    for r, run in enumerate(runs):
        for name, (xs, ys, steps) in gold_vs_kl_points(run.rows).items():
            series.append(
                plots.Points(
                    f"{run.name}: {name}" if many else name,
                    xs,
                    ys,
                    steps,
                    plots.COLORS[r % len(plots.COLORS)],
                    "o" if name == "gold" else "^",
                )
            )
    if not series:
        return None
    title = "Gold (o) and proxy (^) score against sqrt(KL)"
    png = plots.scatter_figure(
        title,
        "sqrt(KL to the reference, nats per response)",
        "score",
        series,
        step_label=runs[0].step_label,
        color_by_step=not many,
    )
    return Plot("gold_vs_sqrt_kl", title + " (Gao et al. 2022)", png)


def reward_model_plots(run: Run) -> list[Plot]:
    """Calibration (from ``summary.json``) and held-out score histograms (from the held-out scores file)."""
    out = []
    bins = run.summary.get("calibration_bins")
    if isinstance(bins, list) and any(isinstance(b, dict) and b.get("count") for b in bins):
        out.append(Plot("calibration", "Reward-model calibration (held out)", plots.calibration_figure(bins)))
    rows = [r for r in run.heldout_scores if _finite(r.get("chosen")) and _finite(r.get("rejected"))]
    if rows:
        chosen, rejected = [r["chosen"] for r in rows], [r["rejected"] for r in rows]
        out.append(
            Plot(
                "score_histogram",
                "Held-out reward-model scores",
                plots.histogram_figure(
                    "Held-out scores: chosen vs rejected",
                    "raw reward-model score",
                    [("chosen", chosen, plots.COLORS[2]), ("rejected", rejected, plots.COLORS[3])],
                ),
            )
        )
        margins = [c - r for c, r in zip(chosen, rejected, strict=True)]
        gold = [r for r in rows if _finite(r.get("gold_chosen")) and _finite(r.get("gold_rejected"))]
        if len(gold) == len(rows):
            agree = [m for m, r in zip(margins, rows, strict=True) if r["gold_chosen"] >= r["gold_rejected"]]
            disagree = [
                m for m, r in zip(margins, rows, strict=True) if r["gold_chosen"] < r["gold_rejected"]
            ]
            groups = [
                ("label agrees with gold", agree, plots.COLORS[0]),
                ("label disagrees with gold", disagree, plots.COLORS[1]),
            ]
        else:
            groups = [("all pairs", margins, plots.COLORS[0])]
        out.append(
            Plot(
                "margin_histogram",
                "Held-out score margins",
                plots.histogram_figure(
                    "Held-out margin r_chosen - r_rejected",
                    "margin (> 0: the model agrees with the label)",
                    groups,
                ),
            )
        )
    return out


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
