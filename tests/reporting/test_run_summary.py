"""What a run tells its user: the score named after what scored it (reward model, reward functions by name,
or both), each reward function's own score beside the trained one (missing-EOS penalty included), the share of
responses penalised for not ending, no gold column without a gold annotator, and the summary `rlhfkit train`
prints at its end (also when stdout is not a terminal)."""

import json
import re

from test_report import SAMPLES, write_run

from rlhfkit.cli import main
from rlhfkit.reporting import health
from rlhfkit.reporting.headline import end_of_run_lines
from rlhfkit.reporting.panels import PANEL, line_plots, run_keys
from rlhfkit.reporting.report import write_report
from rlhfkit.reporting.runs import load_run
from tests.trainers.online.online_fixtures import online_cli_args, write_online_problem


def config(reward_model=None, functions=(), missing_eos="penalty"):
    lines = ["kind: grpo", "online:", f"  missing_eos: {missing_eos}"]
    if reward_model:
        lines.append(f"  reward_model: {reward_model}")
    lines.append(f"  reward_functions: {json.dumps(list(functions))}")
    return "\n".join(lines) + "\n"


def stopping_rows(n=6):
    """A run whose trained score rises only because responses learn to end: its reward function's own score
    stays flat while the share penalised for not ending falls."""
    return [
        {
            "step": s,
            "score/mean": 0.1 * (1 - p) - p,
            "score/raw_mean": 0.1,
            "score/accuracy": 0.1,
            "score/penalised_frac": p,
            "response/ended_frac": 1 - p,
            "kl/mean": 0.2 * s,
            "response_length/mean": 30 - s,
        }
        for s, p in zip(range(1, n + 1), (0.9, 0.7, 0.5, 0.3, 0.1, 0.0), strict=True)
    ]


def no_gold_samples():
    return "".join(
        json.dumps(
            {"step": 1, "prompt": f"p{i}", "response": f"r{i}", "score": -1.0, "parts": {"accuracy": 0.0}}
            | {"kl": 0.1, "length": 5, "ended": False}
        )
        + "\n"
        for i in range(3)
    )


def test_grpo_with_a_reward_function_names_it_plots_its_own_score_and_prints_a_summary(tmp_path, capsys):
    """A real (tiny) GRPO run from the command line, scored by one reward function and no reward model."""
    paths = write_online_problem(tmp_path, reward_model=False)
    out = tmp_path / "run"
    args = online_cli_args(paths, out, "train.max_steps=2", "logging.progress_bar=false", kind="grpo")
    assert main(args) == 0

    # metrics.jsonl: the function's own score, and the penalised share, agree with the responses themselves
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 8  # every response of both rollouts (4 prompts x 2)
    for row in rows:
        mine = [s for s in samples if s["step"] == row["step"]]
        unended = [s for s in mine if not s["ended"]]
        assert row["score/penalised_frac"] == len(unended) / len(mine)
        assert row["score/cat_count"] == sum(s["parts"]["cat_count"] for s in mine) / len(mine)
        assert abs(row["score/mean"] - sum(s["score"] for s in mine) / len(mine)) < 1e-6
        assert all(s["score"] == -1.0 for s in unended)  # the penalty replaced their score
    assert any(row["score/penalised_frac"] > 0 for row in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["score_penalised_frac"] == rows[-1]["score/penalised_frac"]
    assert summary["score_cat_count"] == rows[-1]["score/cat_count"]

    # the summary on stdout (captured: not a terminal)
    printed = capsys.readouterr().out.splitlines()
    trained = "trained score (reward function cat_count + missing-EOS penalty)"
    first, last = rows[0], rows[-1]
    assert printed[0].startswith("rlhfkit: grpo finished: 2 rollouts in ")
    assert printed[1:4] == [
        f"  run folder:  {out}",
        f"  final model: {out / 'final'}",
        f"  report:      {out / 'report.html'}",
    ]
    assert printed[4] == "  first -> last logged rollout (1 -> 2):"
    assert printed[5] == f"    {trained}: {first['score/mean']:.4g} -> {last['score/mean']:.4g}"
    assert printed[6].startswith("    cat_count: reward function's own score: ")
    penalised = f"{100 * first['score/penalised_frac']:.0f}% -> {100 * last['score/penalised_frac']:.0f}%"
    assert printed[7] == f"    responses penalised for not ending (missing EOS): {penalised}"
    assert (out / "final" / "config.json").is_file() and (out / "report.html").is_file()

    # the report: the source by name, no reward model, no gold column, the function's own score plotted
    page = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    table = re.search(r'<table class="summary">(.*?)</table>', page, re.S).group(1)
    md_summary = md.split("## Summary")[1].split("\n## ")[0]
    for text in (table, md_summary):
        assert trained in text and "reward model" not in text and "proxy" not in text
    assert 'data-gold="0"' in page and "<th>gold</th>" not in page and 'value="gold"' not in page
    run = load_run(out)
    scores = next(spec for spec in PANEL if spec.name == "scores")
    assert [key for key, _, _ in run_keys(scores, run)][:2] == ["score/mean", "score/cat_count"]
    ended = next(spec for spec in PANEL if spec.name == "ended")
    assert "score/penalised_frac" in [key for key, _, _ in run_keys(ended, run)]


def test_each_source_is_named_as_it_is(tmp_path):
    cases = {
        "rm": (config(reward_model="rm/final"), "trained score (reward model + missing-EOS penalty)"),
        "fns": (
            config(functions=["r.py:accuracy", "pkg.fmt:format"], missing_eos="mask"),
            "trained score (reward functions accuracy, format)",
        ),
        "both": (
            config(reward_model="rm", functions=["r.py:accuracy"]),
            "trained score (reward model + reward function accuracy + missing-EOS penalty)",
        ),
    }
    for name, (text, words) in cases.items():
        write_run(tmp_path / name, stopping_rows(), summary={"score_mean": 0.1}, config=text)
        run = load_run(tmp_path / name)
        assert run.label("score/mean") == words and run.label("score_mean") == words, name
    both = load_run(tmp_path / "both")
    assert both.reward_parts == ["reward_model", "accuracy"]
    assert both.label("score/accuracy") == "accuracy: reward function's own score"
    assert both.label("score/reward_model") == "reward model: its own score"
    assert both.label("eval.eval/score/mean").startswith("held-out score (reward model + reward function")
    # a function named like a metric the trainer logs itself gets its index, as the trainer names it
    write_run(
        tmp_path / "clash", stopping_rows(), config=config(functions=["a.py:mean", "b.py:ok", "c.py:ok"])
    )
    assert load_run(tmp_path / "clash").reward_parts == ["mean_0", "ok_1", "ok_2"]
    # the reward trainer's own score_mean is not an online score
    write_run(
        tmp_path / "reward", [{"step": 1, "loss": 0.5}], summary={"score_mean": 0.3}, config="kind: reward\n"
    )
    assert "trained score" not in load_run(tmp_path / "reward").label("score_mean")


def test_a_gain_from_learning_to_stop_shows_beside_the_flat_own_score(tmp_path, monkeypatch):
    """The scores figure draws the function's own (flat) score beside the trained (rising) one; the ended
    figure draws the penalised share; the summary lines say both; no gold column without gold."""
    from rlhfkit.reporting import plots

    rows = write_run(
        tmp_path / "run",
        stopping_rows(),
        summary={"steps": 6, "wall_seconds": 12.0},
        samples=no_gold_samples(),
        config=config(functions=["r.py:accuracy"]),
    )
    drawn = {}
    original = plots.line_figure
    monkeypatch.setattr(
        plots, "line_figure", lambda fig: drawn.setdefault(fig.title, fig.lines) and original(fig)
    )
    line_plots([load_run(tmp_path / "run")])
    lines = {line.label: line.ys for line in drawn["Score per response"]}
    assert lines == {
        "trained score (reward function accuracy + missing-EOS penalty)": [r["score/mean"] for r in rows],
        "accuracy: own score": [0.1] * 6,
    }
    ended = {line.label: line.ys for line in drawn["Responses that end with a stop token"]}
    assert ended["penalised for not ending (score replaced)"] == [r["score/penalised_frac"] for r in rows]

    assert end_of_run_lines(tmp_path / "run")[-6:] == [
        "  first -> last logged rollout (1 -> 6):",
        "    trained score (reward function accuracy + missing-EOS penalty): -0.89 -> 0.1",
        "    accuracy: reward function's own score: 0.1 -> 0.1",
        "    responses penalised for not ending (missing EOS): 90% -> 0%",
        "    KL to the reference (nats / response): 0.2 -> 1.2",
        "    response length (tokens): 29 -> 24",
    ]

    # the warning sign says it in words, on the score figure; a run whose own score rose as much does not fire
    run = load_run(tmp_path / "run")
    fired = health.check_health(run.series)
    assert [(w.rule, w.metric, w.first_step, w.last_step) for w in fired] == [
        ("gain_from_stopping", "score/mean", 5, 6)
    ]
    assert "the share penalised for not ending fell from 80% to 5%" in fired[0].message
    learned = [r | {"score/raw_mean": r["score/mean"] + 1.0} for r in rows]
    assert (
        health.gain_from_stopping(lambda key: ([r["step"] for r in learned], [r[key] for r in learned])) == []
    )

    page = write_report(tmp_path / "run").read_text()
    assert "Gain from stopping</b>" in page
    head = re.search(r'<table id="samples-table" data-gold="0"><thead><tr>(.*?)</tr>', page).group(1)
    assert "gold" not in head and 'value="gold"' not in page
    # with gold scores in the samples (a task's annotators), the column is there
    write_run(tmp_path / "gold", stopping_rows(), samples=SAMPLES, config=config(reward_model="rm"))
    assert 'data-gold="1"' in write_report(tmp_path / "gold").read_text()


def test_offline_run_summary_lines(tmp_path):
    write_run(
        tmp_path / "sft",
        [{"step": s, "loss": 2.0 / s, "eval/loss": 2.5 / s} for s in (1, 2, 4)],
        summary={"kind": "sft", "steps": 4, "wall_seconds": 3.0},
        config="kind: sft\n",
    )
    (tmp_path / "sft" / "final").mkdir()
    lines = end_of_run_lines(tmp_path / "sft")
    assert lines == [
        "rlhfkit: sft finished: 4 optimizer steps in 3.0 s",
        f"  run folder:  {tmp_path / 'sft'}",
        f"  final model: {tmp_path / 'sft' / 'final'}",
        "  first -> last logged optimizer step (1 -> 4):",
        "    training loss: 2 -> 0.5",
        "    held-out loss: 2.5 -> 0.625",
    ]
