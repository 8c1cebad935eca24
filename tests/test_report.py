"""`rlhfkit report`: one PNG per logged group of metrics, gold/proxy against sqrt(KL), a report.md."""

import json
import math

import pytest

from rlhfkit.cli import main
from rlhfkit.errors import UserError
from rlhfkit.report import gold_vs_kl_points, write_report


def _online_run(path):
    path.mkdir()
    rows = [{"step": s, "score/mean": 0.1 * s, "gold/mean": 0.05 * s - 0.004 * s * s, "kl/mean": 0.5 * s,
             "entropy/mean": 1.0 - 0.01 * s, "response_length/mean": 20 + s, "loss/policy": -0.01 * s,
             "loss/value": 1.0 / s} for s in range(1, 11)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"ppo": {"gold_mean": 0.1, "kl_mean": 5.0}}))
    return rows


def test_report_writes_every_plot_and_the_markdown(tmp_path):
    _online_run(tmp_path / "run")
    assert main(["report", str(tmp_path / "run")]) == 0
    plots = sorted(p.name for p in (tmp_path / "run" / "report").iterdir())
    assert plots == ["entropy.png", "gold_vs_sqrt_kl.png", "kl.png", "losses.png", "response_length.png", "scores.png"]
    for p in (tmp_path / "run" / "report").iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "run" / "report.md").read_text()
    assert "ppo.gold_mean" in md and "report/gold_vs_sqrt_kl.png" in md and "report/scores.png" in md


def test_gold_vs_kl_points_use_sqrt_of_the_kl(tmp_path):
    rows = _online_run(tmp_path / "run")
    points = gold_vs_kl_points(rows)
    xs, ys = points["gold"]
    assert xs[3] == math.sqrt(rows[3]["kl/mean"]) and ys[3] == rows[3]["gold/mean"]
    assert points["proxy"][1][3] == rows[3]["score/mean"]
    # Without a gold score there is nothing to compare the proxy with: no plot.
    assert gold_vs_kl_points([{k: v for k, v in r.items() if k != "gold/mean"} for r in rows]) == {}


def test_report_on_a_folder_without_metrics_is_a_user_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(UserError, match="metrics.jsonl"):
        write_report(tmp_path)
