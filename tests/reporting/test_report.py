"""`rlhfkit report`: the PNGs, report.md, report.html (self-contained), the warning rules, the samples reader,
readable names, and several runs side by side."""

import base64
import json
import math
import re

import pytest

from rlhfkit.cli import main
from rlhfkit.errors import UserError
from rlhfkit.reporting import health, plots
from rlhfkit.reporting.report import compare_path, gold_vs_kl_points, write_report, write_reports
from rlhfkit.reporting.runs import fmt, label, load_run
from rlhfkit.reporting.sample_file import printable, read_samples

PNG = b"\x89PNG\r\n\x1a\n"


def online_rows(n=10, kl_speed=0.5, runaway=False):
    rows = []
    for s in range(1, n + 1):
        row = {
            "step": s,
            "score/mean": 0.1 * s,
            "gold/mean": 0.03 * s,
            "kl/mean": kl_speed * s,
            "entropy/mean": 1.0 - 0.01 * s,
            "response_length/mean": 20 + s,
            "loss/policy": -0.01 * s,
            "loss/value": 1.0 / s,
            "clipfrac": 0.05,
            "approx_kl": 0.001,
            "ratio/mean": 1.0,
            "value/explained_variance": 0.1 * s,
            "grad_norm/actor": 1.0,
            "learning_rate/actor": 1e-4,
        }
        if runaway:
            row.update(
                {
                    "kl/mean": 0.1 * s**3,
                    "entropy/mean": math.exp(-s / 3),
                    "clipfrac": 0.03 * s,
                    "response_length/mean": 10 + 3 * s,
                    "gold/mean": 0.05 * s - 0.004 * s * s,
                }
            )
        rows.append(row)
    return rows


def write_run(path, rows, summary=None, samples=None, config="kind: ppo\nonline:\n  kl_estimator: k1\n"):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(
        json.dumps(summary if summary is not None else {"ppo": {"gold_mean": 0.1, "kl_mean": 5.0}})
    )
    if config:
        (path / "config.yaml").write_text(config)
    if samples is not None:
        (path / "samples.jsonl").write_text(samples)
    return rows


SAMPLES = (
    "".join(
        json.dumps(r) + "\n"
        for r in [
            {
                "step": 1,
                "prompt": "p one",
                "response": "bell\x07 </script><b>x</b>",
                "score": 0.5,
                "gold": 0.1,
                "kl": 0.2,
                "length": 7,
                "ended": True,
                "parts": {"rm": 0.4, "format": 0.1},
            },
            {
                "step": 2,
                "prompt": [{"role": "user", "content": "hi"}],
                "response": "two",
                "score": 0.9,
                "kl": 0.1,
                "length": 3,
                "ended": False,
                "score/format": -1.0,
            },
            {"step": 2, "response": "no prompt, no score"},
        ]
    )
    + '{"step": 3, "prompt": "cut of'
)  # a partial last line, as a killed run leaves it


def test_report_writes_every_plot_markdown_and_a_self_contained_page(tmp_path, capsys):
    write_run(tmp_path / "run", online_rows(), samples=SAMPLES)
    assert main(["report", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'run' / 'report.html'}"
    plots_written = sorted(p.name for p in (tmp_path / "run" / "report").iterdir())
    assert plots_written == [
        "approx_kl.png",
        "clipfrac.png",
        "entropy.png",
        "explained_variance.png",
        "gold_vs_sqrt_kl.png",
        "grad_norm.png",
        "kl.png",
        "learning_rate.png",
        "policy_loss.png",
        "ratio.png",
        "response_length.png",
        "scores.png",
        "value_loss.png",
    ]
    for p in (tmp_path / "run" / "report").iterdir():
        assert p.read_bytes()[:8] == PNG
    md = (tmp_path / "run" / "report.md").read_text()
    assert "ppo: gold score" in md and "report/gold_vs_sqrt_kl.png" in md and "report/scores.png" in md
    assert "eval.eval/" not in md and "## Warning signs" in md
    # report.md's samples: newest / best / worst, one line each, control characters escaped
    assert "### Newest (rollout 2)" in md and "bell\\x07 </script><b>x</b>" in md and "\x07" not in md

    page = (tmp_path / "run" / "report.html").read_text()
    # self-contained: no address outside the page (plots are data: URIs), nothing fetched
    assert not re.search(r'(src|href)="(?!data:|#)', page) and "http" not in page.replace("http-equiv", "")
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 13 and all(base64.b64decode(i)[:8] == PNG for i in images)
    # the samples travel as JSON that no response can end early, control characters written as escapes
    data = re.search(r'<script type="application/json" id="samples-data">(.*?)</script>', page, re.S).group(1)
    rows = json.loads(data)
    assert [r["step"] for r in rows] == [1, 2, 2] and "\\x07" in rows[0]["response"] and "\x07" not in page
    assert rows[1]["prompt"] == "user: hi" and rows[1]["parts"] == {"score/format": -1.0}
    assert rows[2]["score"] is None and rows[2]["prompt"] == ""
    assert "1 line(s) of samples.jsonl were not JSON objects" in page


def test_plots_mark_short_series_and_use_integer_step_ticks(tmp_path, monkeypatch):
    drawn = []
    from matplotlib.axes import Axes

    original = Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((self, kwargs.get("marker")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    plots.line_figure(
        plots.Figure(
            "t",
            "y",
            "rollout",
            [plots.Line("few", [1, 2, 3], [1.0, 2.0, 0.5]), plots.Line("many", list(range(12)), [0.0] * 12)],
        )
    )
    assert [m for _, m in drawn] == ["o", None]
    plots.line_figure(
        plots.Figure("t", "y", "rollout", [plots.Line("three steps", [1, 2, 3], [1.0, 2.0, 0.5])])
    )
    ax = drawn[-1][0]
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks == [1.0, 2.0, 3.0]  # not 1.0, 1.25, 1.5, ...
    assert ax.get_xlabel() == "rollout"


def test_policy_and_value_loss_get_their_own_figure_and_offline_runs_their_unit(tmp_path):
    rows = write_run(tmp_path / "ppo", online_rows())
    run = load_run(tmp_path / "ppo")
    assert run.step_label == "rollout" and run.series("loss/policy") == (
        [r["step"] for r in rows],
        [r["loss/policy"] for r in rows],
    )
    write_run(
        tmp_path / "sft",
        [{"step": s, "loss": 2.0 / s, "learning_rate": 1e-3} for s in range(1, 4)],
        summary={"kind": "sft"},
        config=None,
    )
    sft = load_run(tmp_path / "sft")
    assert sft.kind == "sft" and sft.step_label == "optimizer step"
    write_report(tmp_path / "sft")
    assert sorted(p.name for p in (tmp_path / "sft" / "report").iterdir()) == [
        "learning_rate.png",
        "losses.png",
    ]
    assert "Warning signs" not in (tmp_path / "sft" / "report.html").read_text()  # PPO rules only


def test_gold_vs_kl_points_are_sqrt_kl_with_their_steps_and_need_gold(tmp_path):
    rows = online_rows()
    points = gold_vs_kl_points(rows)
    xs, ys, steps = points["gold"]
    assert xs[3] == math.sqrt(rows[3]["kl/mean"]) and ys[3] == rows[3]["gold/mean"] and steps[3] == 4
    assert points["proxy"][1][3] == rows[3]["score/mean"]
    rows[0]["kl/mean"] = -0.2  # a negative k1 estimate sits at sqrt(0)
    assert gold_vs_kl_points(rows)["gold"][0][0] == 0.0
    assert gold_vs_kl_points([{k: v for k, v in r.items() if k != "gold/mean"} for r in rows]) == {}


def test_gold_vs_kl_is_drawn_as_points_not_a_line_in_step_order(monkeypatch):
    from matplotlib.axes import Axes

    calls = []
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **k: calls.append("plot"))
    original = Axes.scatter
    monkeypatch.setattr(
        Axes, "scatter", lambda self, *a, **k: calls.append("scatter") or original(self, *a, **k)
    )
    plots.scatter_figure("t", "x", "y", [plots.Points("gold", [0.0, 2.0, 1.0], [0.1, 0.3, 0.2], [1, 2, 3])])
    assert calls == ["scatter"]


def test_warning_rules_fire_on_a_run_away_run_and_stay_quiet_on_a_calm_one(tmp_path):
    calm = write_run(tmp_path / "calm", online_rows())
    bad = write_run(tmp_path / "bad", online_rows(runaway=True))
    assert health.check_health(load_run(tmp_path / "calm").series) == []
    fired = {w.rule for w in health.check_health(load_run(tmp_path / "bad").series)}
    assert fired == {"kl_runaway", "entropy_collapse", "clipfrac_high", "length_blowup", "overoptimization"}
    assert calm and bad

    # Each rule at its threshold: just below does not fire, just above does.
    def series(values):
        return lambda key: (list(range(1, len(values) + 1)), values) if key == "clipfrac" else ([], [])

    assert health.check_health(series([0.19] * 9)) == []
    assert [w.rule for w in health.check_health(series([0.21] * 9))] == ["clipfrac_high"]
    gold = {"eval/gold/mean": [0.1, 0.4, 0.3, 0.2], "eval/score/mean": [0.0, 0.5, 0.8, 1.0]}
    hacked = health.check_health(lambda k: ([0, 5, 10, 15], gold[k]) if k in gold else ([], []))
    assert [(w.rule, w.first_step, w.last_step) for w in hacked] == [("overoptimization", 5, 15)]
    for recovered in ([0.1, 0.4, 0.3, 0.35], [0.5, 0.1, 0.4, 0.3]):  # one fall is not two in a row: no flag
        gold["eval/gold/mean"] = recovered
        assert health.check_health(lambda k: ([0, 5, 10, 15], gold[k]) if k in gold else ([], [])) == []


def test_warning_marks_reach_the_page(tmp_path):
    write_run(tmp_path / "bad", online_rows(runaway=True))
    page = write_report(tmp_path / "bad").read_text()
    assert page.count('class="warn"') == 5  # score (gold falls), KL, entropy, clip fraction, length frames
    assert "KL running away" in page and "The rules checked" in page


def test_a_calm_run_too_short_for_the_trend_rules_says_so(tmp_path):
    """ "No warning sign fired" on 4 rollouts says that the trend rules (6 points) could not fire; on 10 it does
    not; on 2 no rule could."""
    for name, n, words in (
        ("short", 4, "the run logged only 4 points: the trend rules (KL running away"),
        ("tiny", 2, "the run logged only 2 points: none of the rules could fire"),
        ("long", 10, None),
    ):
        write_run(tmp_path / name, online_rows(n))
        page = write_report(tmp_path / name).read_text()
        md = (tmp_path / name / "report.md").read_text()
        assert "No warning sign fired." in page and "None of the rules fired" in md
        if words is None:
            assert "the run logged only" not in page and "the run logged only" not in md
        else:
            assert f"No warning sign fired. But {words}" in page and f"; but {words}" in md, name
    assert health.too_short(load_run(tmp_path / "short").series).endswith("so no sign here says little")


def test_the_report_names_the_model_lora_and_precision(tmp_path):
    config = (
        '# run: {"device": "cuda", "precision": "bfloat16", "world_size": 1}\n'
        "kind: grpo\nmodel:\n  name_or_path: runs/sft/final\n  dtype: auto\n  lora_rank: 16\n"
        "  lora_alpha: 32.0\n  lora_target_modules: q_proj,v_proj\n"
    )
    write_run(tmp_path / "lora", online_rows(), config=config)
    setup = (
        "model runs/sft/final; LoRA rank 16, alpha 32 on q_proj,v_proj; precision bfloat16 (model.dtype auto)"
    )
    assert load_run(tmp_path / "lora").setup == setup
    assert setup in write_report(tmp_path / "lora").read_text()
    assert f"Setup: {setup}." in (tmp_path / "lora" / "report.md").read_text()
    write_run(
        tmp_path / "full", online_rows(), config="kind: ppo\nmodel:\n  name_or_path: m\n  dtype: float32\n"
    )
    assert load_run(tmp_path / "full").setup == "model m; no LoRA (full fine-tuning); precision float32"
    assert load_run(tmp_path / "lora").run_info["device"] == "cuda"


def test_readable_names_na_and_the_negative_kl_note(tmp_path):
    assert label("eval.eval/gold/mean") == "held-out gold score"
    assert label("ppo.kl_mean") == "ppo: KL to the reference (nats / response)"
    assert fmt(None) == fmt(float("nan")) == "n/a" and fmt(0.123456) == "0.1235"
    write_run(tmp_path / "run", online_rows(), summary={"ppo": {"kl_mean": -0.03, "gold_mean": None}})
    write_report(tmp_path / "run")
    md = (tmp_path / "run" / "report.md").read_text()
    assert "| ppo: gold score | n/a |" in md and "-0.03 (negative: the k1 estimator" in md
    assert "negative: the k1 estimator" in (tmp_path / "run" / "report.html").read_text()


def test_sample_reader_is_tolerant_and_printable_escapes_control_characters(tmp_path):
    (tmp_path / "s.jsonl").write_text(SAMPLES + "\n[1, 2]\n\n")
    read = read_samples(tmp_path / "s.jsonl")
    assert len(read.samples) == 3 and read.skipped_lines == 2
    first = read.samples[0]
    assert (first.step, first.score, first.gold, first.kl, first.length, first.ended) == (
        1,
        0.5,
        0.1,
        0.2,
        7,
        True,
    )
    assert first.parts == {"rm": 0.4, "format": 0.1}
    assert read_samples(tmp_path / "missing.jsonl").samples == []
    assert printable("a\x1b[31mb\tc\nd") == "a\\x1b[31mb\\tc\nd"
    assert printable("a\nb", keep_newlines=False) == "a\\nb"


def test_two_runs_side_by_side(tmp_path, capsys):
    write_run(tmp_path / "runs" / "kl01", online_rows(), summary={"ppo": {"gold_mean": 0.1}}, samples=SAMPLES)
    write_run(tmp_path / "runs" / "kl02", online_rows(runaway=True), summary={"ppo": {"gold_mean": 0.3}})
    assert main(["report", str(tmp_path / "runs" / "kl01"), str(tmp_path / "runs" / "kl02")]) == 0
    out = capsys.readouterr().out.split()
    assert out[-1] == str(tmp_path / "runs" / "compare.html")
    page = (tmp_path / "runs" / "compare.html").read_text()
    # one table: one column per run
    table = re.search(r'<table class="comparison">(.*?)</table>', page, re.S).group(1)
    assert "<th>kl01</th><th>kl02</th>" in table and re.search(
        r"ppo: gold score</th><td class=num>0.1</td>"
        r"<td class=num>0.3</td>",
        table,
    )
    assert "shaded red" not in page  # overlaid curves carry no per-run marks
    assert 'id="sample-run"' in page and (tmp_path / "runs" / "kl02" / "report.html").is_file()
    runs = [tmp_path / "runs" / "kl01", tmp_path / "b" / "kl02"]
    assert compare_path(runs) == tmp_path / "compare.html"
    assert compare_path(runs, tmp_path / "c.html") == tmp_path / "c.html"
    assert compare_path(runs, tmp_path / "runs") == tmp_path / "runs" / "compare.html"


def test_runs_overlay_in_one_figure_per_metric(tmp_path):
    from rlhfkit.reporting.panels import line_plots

    write_run(tmp_path / "a", online_rows())
    write_run(tmp_path / "b", online_rows(n=6))
    figs = {p.name: p for p in line_plots([load_run(tmp_path / "a"), load_run(tmp_path / "b")])}
    assert "kl" in figs and "policy_loss" in figs and len(figs) == 12


def test_report_errors_are_user_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(UserError, match="metrics.jsonl"):
        write_report(tmp_path)
    write_run(tmp_path / "a", online_rows())
    assert main(["report", str(tmp_path / "a"), "--out", str(tmp_path / "x.html")]) == 2
    assert "--out" in capsys.readouterr().err
    with pytest.raises(UserError, match="twice"):
        write_reports([tmp_path / "a", tmp_path / "a"])
    (tmp_path / "a" / "summary.json").write_text("{oops")
    assert main(["report", str(tmp_path / "a")]) == 2
    assert "summary.json: not valid JSON" in capsys.readouterr().err
