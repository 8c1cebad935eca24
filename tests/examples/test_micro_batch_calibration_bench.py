"""benchmarks/micro_batch_calibration.py: one configuration measured in this process on the tiny online problem,
and the check of the committed peaks against the estimate (the command docs/performance.md quotes)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.examples.loader import ROOT, load_example
from tests.trainers.online.online_fixtures import write_online_problem

PEAKS = Path(__file__).resolve().parents[1] / "trainers" / "online" / "micro_batch_peaks.json"


def test_the_calibration_measures_one_update_and_records_its_shape(tmp_path):
    paths = write_online_problem(tmp_path, reward_model=False)
    bench = load_example("micro_batch_calibration", ROOT / "benchmarks")
    record = bench.measure(str(paths["policy"]), "float32", True, True, 2, 5, 6)
    assert (
        record["peak_bytes"] >= 0 and record["trained_parameters"] > 0 and record["seconds"] > 0
    )  # a tiny model
    assert (record["rows"], record["prompt"], record["response"], record["critic"]) == (2, 5, 6, True)
    assert bench.estimate({"model": "tiny", **record}) > 0


def test_the_check_passes_on_the_committed_peaks_and_fails_below_one(capsys):
    bench = load_example("micro_batch_calibration", ROOT / "benchmarks")
    records = json.loads(PEAKS.read_text())
    assert bench.check(records) == 0
    assert "the smallest estimate / peak: 1." in capsys.readouterr().out
    high = [{**records[0], "peak_bytes": 10 * records[0]["peak_bytes"]}]
    assert bench.check(high) == 1
