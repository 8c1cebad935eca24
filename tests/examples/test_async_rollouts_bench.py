"""benchmarks/async_rollouts.py: the phase-time model of docs/distributed.md ("When overlapping pays") by hand
and against an event-by-event run of the schedule that rlhfkit.trainers.online.async_loop follows; a run's
figures from its metrics.jsonl and the prediction from them by hand; the cache that lets a measurement continue;
and (CI's long step) the smoke measurement end to end."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

from tests.examples.loader import ROOT, load_example


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run as a script from benchmarks/
    try:
        yield load_example("async_rollouts", ROOT / "benchmarks")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_model_by_hand(bench):
    t = bench.predicted_async_seconds  # (U, A, W, G, g, k), R = W unless given
    # one generator, one version behind: the generator's 10 s bound it (max(4, 10, (10 + 4) / 2))
    assert t(4.0, 0.0, 0.0, 10.0, g=1, k=1) == 10.0
    # with a 0.5 s send: the trainer's step is 4.5, the generator's rollout 10.5 (its receive of the weights)
    assert t(4.0, 0.0, 0.5, 10.0, g=1, k=1) == 10.5
    # two generators at k = 1: each has 20 s per rollout, but rollout s waits for update s - 2: (10 + 4) / 2
    assert t(4.0, 0.0, 0.0, 10.0, g=2, k=1) == 7.0
    # two generators at k = 2: throughput 10 / 2 = 5 beats latency (10 + 4) / 3
    assert t(4.0, 0.0, 0.0, 10.0, g=2, k=2) == 5.0
    # four generators at k = 3: latency (10 + 0.1 + 2.6) / 4, over the trainer's 2.6 and throughput 10.1 / 4
    assert t(2.0, 0.5, 0.1, 10.0, g=4, k=3) == pytest.approx(3.175)
    # the trainer is the bottleneck: 8 + 1 + 0
    assert t(8.0, 1.0, 0.0, 4.0, g=1, k=1) == 9.0
    assert t(4.0, 0.0, 0.5, 10.0, g=1, k=1, receive=0.0) == 10.0
    assert bench.sync_seconds(3.0, 2.0, 1.0) == 6.0
    with pytest.raises(ValueError, match="k >= 1"):
        t(4.0, 0.0, 0.0, 10.0, g=1, k=0)


def test_the_model_is_the_steady_state_of_the_codes_schedule(bench):
    """The closed form against :func:`simulated_async_seconds`, which runs async_loop's own sampling_version and
    sampler_of, over trainer-bound, throughput-bound and latency-bound cases (within the finite run's edge)."""
    cases = itertools.product(
        (0.5, 2.0, 8.0), (0.0, 0.5), (0.0, 0.3), (1.0, 10.0, 30.0), (1, 2, 4), (1, 2, 3)
    )
    for update, fixed, send, generate, g, k in cases:
        closed = bench.predicted_async_seconds(update, fixed, send, generate, g, k)
        simulated = bench.simulated_async_seconds(update, fixed, send, generate, g, k)
        assert simulated == pytest.approx(closed, rel=0.02), (update, fixed, send, generate, g, k)


def _rows(async_run: bool) -> list[dict]:
    rows = []
    for step, seconds in ((1, 9.0), (2, 2.0), (3, 4.0)):
        row = {
            "step": step,
            "time/step_seconds": seconds,
            "response_length/mean": 8.0,
            "time/generate": 1.0,
            "time/forward": 0.25,
            "time/score": 0.25,
            "time/update": 0.5,
        }
        if async_run:
            row.update(
                {
                    "async/generation_seconds": 2.5 * step,
                    "async/trainer_idle_seconds": 0.5,
                    "async/weight_transfer_seconds": 0.25 if step < 3 else 0.0,
                    "async/staleness_max": float(step > 1),
                }
            )
        rows.append(row)
    return rows


def test_a_runs_figures_by_hand(bench):
    sync = bench.run_figures("sync", _rows(False), responses=4)
    # rollouts 2 and 3: 6 s for 2 rollouts of 4 x 8 tokens
    assert sync["rollouts_timed"] == 2 and sync["seconds_per_rollout"] == 3.0
    assert sync["rollouts_per_hour"] == 1200.0 and sync["tokens_per_second"] == pytest.approx(64 / 6)
    assert sync["phases"] == {"G": 1.25, "U": 0.75, "A": 1.0}
    overlap = bench.run_figures("k1", _rows(True), responses=4)
    # busy: 2 - 0.5 - 0.25 and 4 - 0.5 - 0; W over the one update of the window that sent weights
    assert overlap["phases"] == {"G": 6.25, "U+A": 2.375, "W": 0.25}
    assert overlap["stages"]["async/staleness_max"] == 1.0 and overlap["stages"]["time/generate"] == 1.0


def test_the_prediction_and_the_gains_from_the_runs(bench):
    args = bench.main_args(["--smoke"])
    sync = {"seconds_per_rollout": 12.0, "rollouts_per_hour": 300.0, "tokens_per_second": 1.0, "stages": {}}
    sync.update(phases={"G": 8.0, "U": 3.0, "A": 1.0}, peak_rss_mib=[100.0, 100.0])
    runs = {"sync": [sync]}
    for name, seconds in (("k1", 10.0), ("k2", 8.0)):
        run = dict(sync, seconds_per_rollout=seconds, phases={"G": 9.0, "U+A": 4.0, "W": 0.5})
        runs[name] = [run]
    got = bench.summarise(args, runs)["configs"]
    # k = 1, g = 1: max(4.5, 9.5, 14 / 2) = 9.5; k = 2: max(4.5, 9.5, 14 / 3) = 9.5
    for name, measured in (("k1", 10.0), ("k2", 8.0)):
        assert got[name]["predicted_seconds_per_rollout"] == 9.5
        assert got[name]["predicted_gain"] == pytest.approx(12.0 / 9.5)
        assert got[name]["measured_gain"] == pytest.approx(12.0 / measured)
        assert got[name]["measured_over_predicted"] == pytest.approx(9.5 / measured)
    assert "predicted_gain" not in got["sync"]
    table = bench.report(bench.summarise(args, runs))
    assert "| k1 | 10.000 | 300 |" in table and "| 9.500 | 1.20 | 1.26 | 0.95 |" in table


def test_an_interrupted_measurement_continues_from_its_cache(bench, tmp_path, monkeypatch):
    """Rounds alternate with the order rotating; a (configuration, round) already in --out is not run again."""
    args = bench.main_args(["--smoke", "--repeats", "2", "--out", str(tmp_path)])
    monkeypatch.setattr(bench, "prepare_inputs", lambda a, work: {"model": "m", "prompts": "p"})
    launched = []

    def launch(a, inputs, name, folder):
        launched.append(folder.name)
        run = bench.run_figures(name, _rows(name != "sync"), responses=4)
        return {**run, "peak_rss_mib": [1.0, 1.0]}

    monkeypatch.setattr(bench, "launch", launch)
    cache = tmp_path / bench.settings_tag(args)
    cache.mkdir(parents=True)
    done = launch(args, {}, "k1", cache / "k1-round2")
    (cache / "k1-round2.json").write_text(json.dumps(done))
    launched.clear()
    bench.measure(args)
    assert launched == ["sync-round1", "k1-round1", "k2-round1", "k2-round2", "sync-round2"]
    launched.clear()
    bench.measure(args)  # everything cached now
    assert launched == []


@pytest.mark.long  # three torchrun launches of two processes: a minute or two on two shared cores
def test_the_smoke_measurement_runs_every_configuration(tmp_path):
    out, result = tmp_path / "out", tmp_path / "result.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "async_rollouts.py"), "--smoke", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [*command, "--json", str(result)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(result.read_text())
    assert list(r["configs"]) == ["sync", "k1", "k2"] and r["rollouts"] == 2 and r["response_length"] == 8
    for name, m in r["configs"].items():
        assert m["seconds_per_rollout"] > 0 and m["tokens_per_second"] > 0 and m["rollouts_per_hour"] > 0, (
            name
        )
        assert all(x > 0 for x in m["peak_rss_mib"]), name
    for name, k in (("k1", 1), ("k2", 2)):
        m = r["configs"][name]
        assert 0 < m["stages"]["async/staleness_max"] <= k and m["stages"]["async/dropped"] == 0, name
        assert m["phases"]["G"] > 0 and m["phases"]["U+A"] > 0 and m["predicted_gain"] > 0, name
    assert "| config | s / rollout | rollouts / h |" in done.stdout and "| k2 |" in done.stdout
    again = subprocess.run([*command], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("(cached)") == 3
