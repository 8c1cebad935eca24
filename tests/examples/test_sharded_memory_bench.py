"""Smoke test of benchmarks/sharded_memory.py: one PPO rollout + update on 1 process and on 2 FSDP2-sharded
processes (torchrun, gloo) of the tiny preset, and the figures it reports per process."""

from __future__ import annotations

import json

import pytest

from tests.examples.loader import ROOT, load_example


@pytest.mark.long  # end to end, tens of seconds: CI's long step (the suite stays under 15 minutes)
def test_sharded_processes_hold_half_the_parameters_each(capsys):
    bench = load_example("sharded_memory", ROOT / "benchmarks")
    args = ["--preset", "tiny", "--batch-size", "2", "--response-length", "4", "--configs", "1,2-sharded"]
    assert bench.main(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    one, sharded = lines
    assert (one["config"], one["processes"], sharded["config"], sharded["processes"]) == (
        "1",
        1,
        "2-sharded",
        2,
    )
    assert len(sharded["peak_mib_per_process"]) == 2
    peaks, bases = one["peak_mib_per_process"], one["baseline_mib_per_process"]
    assert all(peak > base > 0 for peak, base in zip(peaks, bases, strict=True))
    # Each sharded process holds its own shards: about half of the four models' parameters (a layer's rows
    # split unevenly and unsharded leftovers make it not exactly half). A DTensor's data_ptr counted as the
    # parameter's storage collapses the count to a few hundred (the bug this checks).
    held_one, held_sharded = one["parameters_held_per_process"], sharded["parameters_held_per_process"]
    assert 0.45 * held_one <= held_sharded <= 0.6 * held_one, (held_one, held_sharded)
    trained_one, trained_sharded = (
        one["parameters_trained_per_process"],
        sharded["parameters_trained_per_process"],
    )
    assert 0.45 * trained_one <= trained_sharded <= 0.6 * trained_one, (trained_one, trained_sharded)
    # The parts: each process's resident set after each is in memory, and the last rollout's phase peaks.
    for line in (one, sharded):
        assert line["world_size"] == line["processes"]
        for stages, phases, peak in zip(
            line["stages_mib_per_process"],
            line["last_rollout_phase_peak_mib_per_process"],
            line["peak_mib_per_process"],
            strict=True,
        ):
            assert list(stages) == ["start", "roles", "engine", "update_1", "end"]
            assert stages["start"] < stages["roles"] <= stages["engine"]  # no engine under hf: equal
            assert list(phases) == ["generate", "score", "update"]
            assert all(stages["start"] < value <= peak for value in phases.values()), (phases, peak)
