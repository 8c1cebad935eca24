"""The lines ``rlhfkit train`` prints when a run ends: where its files are and the figures a person asks first.

Printed to stdout whether or not it is a terminal (the progress bar is not: a job's log gets these lines and
nothing else), for example::

    rlhfkit: grpo finished: 200 rollouts in 1234.5 s
      run folder:  runs/grpo
      final model: runs/grpo/final
      report:      runs/grpo/report.html
      first -> last logged rollout (1 -> 200):
        trained score (reward function accuracy + missing-EOS penalty): -0.8 -> 0.45
        accuracy: reward function's own score: 0.1 -> 0.12
        responses penalised for not ending (missing EOS): 85% -> 3%
        KL to the reference (nats / response): 0 -> 2.1

A trained score that rises while each reward function's own score stays flat and the penalised share falls is
a policy that learned to stop, not one that learned the reward.
"""

from __future__ import annotations

from pathlib import Path

from rlhfkit.errors import UserError
from rlhfkit.reporting.runs import Run, fmt, load_run

# The figures of each kind of run, in print order (those the run logged); online runs add their score parts.
OFFLINE_KEYS = ("loss", "eval/loss", "accuracy", "eval/accuracy", "eval/gold_accuracy", "eval/gold/mean")
ONLINE_KEYS = (
    "score/mean",
    "score/penalised_frac",
    "response/ended_frac",
    "kl/mean",
    "response_length/mean",
    "eval/score/mean",
    "eval/gold/mean",
)
TEACHER_KL = "distill/teacher_kl"  # online.teacher_model (nats / token)


def headline_keys(run: Run) -> list[str]:
    """The metrics the summary shows for ``run``, in order: for an online run the trained score, then each
    score part's own score (or, for one part, the score before the missing-EOS rule where it differs), the
    penalised share (or, without the penalty, the share that ends), KL, length and the held-out figures. A
    run with a distillation teacher adds its KL to the teacher (first in `train distill`, whose score is 0
    when the teacher alone scores, and then not shown)."""
    if not run.online:
        return [k for k in OFFLINE_KEYS if run.series(k)[0]]
    parts = [f"score/{name}" for name in run.reward_parts if run.series(f"score/{name}")[0]]
    if not parts and run.series("score/raw_mean") != run.series("score/mean"):
        parts = ["score/raw_mean"]
    keys = [ONLINE_KEYS[0], *parts, *ONLINE_KEYS[1:]]
    if run.series("score/penalised_frac")[0]:
        keys.remove("response/ended_frac")  # 1 - penalised: said once
    if not run.scored:  # `train distill` alone: the teacher's term is the whole reward, the score 0
        keys = [k for k in keys if k not in ("score/mean", "score/raw_mean", "eval/score/mean")]
    # on-policy distillation: the KL to the teacher, first in `train distill`, after the reference's elsewhere;
    # the held-out one last, with the held-out figures
    at = 0 if run.kind == "distill" else keys.index("kl/mean") + 1
    keys.insert(at, TEACHER_KL)
    keys.append(f"eval/{TEACHER_KL}")
    return [k for k in keys if run.series(k)[0]]


def end_of_run_lines(run_dir: str | Path) -> list[str]:
    """The summary lines of the finished run in ``run_dir`` (see the module docstring); a folder without
    logged metrics gets its paths only (the summary never fails a run that finished)."""
    try:
        run = load_run(run_dir)
    except UserError:
        return [f"rlhfkit: finished: {run_dir} (no metrics logged)"]
    path = run.path
    steps = run.summary.get("steps", run.rows[-1]["step"])
    wall = run.summary.get("wall_seconds")
    unit = run.step_label + ("s" if steps != 1 else "")
    took = f" in {wall:.1f} s" if isinstance(wall, int | float) else ""
    lines = [f"rlhfkit: {run.kind} finished: {steps} {unit}{took}", f"  run folder:  {path}"]
    if (path / "final").is_dir():
        lines.append(f"  final model: {path / 'final'}")
    if (path / "report.html").is_file():
        lines.append(f"  report:      {path / 'report.html'}")
    figures = []
    first_step, last_step = None, None
    for key in headline_keys(run):
        xs, ys = run.series(key)
        first_step = xs[0] if first_step is None else min(first_step, xs[0])
        last_step = xs[-1] if last_step is None else max(last_step, xs[-1])
        change = _value(key, ys[0]) if len(ys) == 1 else f"{_value(key, ys[0])} -> {_value(key, ys[-1])}"
        figures.append(f"    {run.label(key)}: {change}")
    if figures:
        lines.append(f"  first -> last logged {run.step_label} ({first_step} -> {last_step}):")
        lines += figures
    return lines


def _value(key: str, value: float) -> str:
    return f"{100 * value:.0f}%" if key.endswith("_frac") else fmt(value)
