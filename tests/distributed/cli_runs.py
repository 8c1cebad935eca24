"""Several ``rlhfkit`` command lines in one launch: one process group for all of them, left at the end.

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.cli_runs PLAN.json

``PLAN.json``: ``{"float64": true|false, "reports": true|false, "record": FOLDER, "tool_sampler": [i, ...],
"runs": [[argv...], ...]}`` (``record`` optional: :mod:`tests.distributed.recording`; ``tool_sampler``: the
indices of the runs whose turns a scripted policy writes, :mod:`tests.distributed.tool_turns`). With ``float64``,
``model.dtype=float32`` loads float64 weights (the config offers no float64: a test-only switch), so that
comparisons between process counts are exact up to summation order. ``"reports": false`` skips the report every
trainer writes at its end (report.html and its plots: several seconds a run here, and tested in
tests/reporting), for tests that read no report. Stops at the first command that fails (exit code as its).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

import rlhfkit.cli as cli
from rlhfkit.engine.accel import end_processes
from rlhfkit.models import loading
from rlhfkit.trainers import common


def float64_models() -> None:
    loading.DTYPES["float32"] = torch.float64


def no_reports() -> None:
    common.write_report = lambda run_dir: None


@contextlib.contextmanager
def sampler(scripted: bool):
    """With ``scripted``, the online trainer's turns are written by :mod:`tests.distributed.tool_turns` (which
    still runs the sampler it replaces, recorder included), for the duration."""
    if not scripted:
        yield
        return
    from rlhfkit.trainers.online import collect
    from tests.distributed.tool_turns import RankedToolSampler

    real = collect.generate_responses
    collect.generate_responses = RankedToolSampler(real)
    try:
        yield
    finally:
        collect.generate_responses = real


def run_all(
    runs: list[list[str]],
    float64: bool = False,
    reports: bool = True,
    record: str | None = None,
    tool_sampler: tuple[int, ...] = (),
) -> int:
    if float64:
        float64_models()
    if not reports:
        no_reports()
    recorder = None
    if record is not None:
        from tests.distributed.recording import Recorder

        recorder = Recorder()
    cli._leave_process_group = lambda wait: None  # one group for all the runs of this launch
    try:
        for i, argv in enumerate(runs):
            with sampler(i in tool_sampler):
                code = cli.main(argv)
            if code:
                print(f"cli_runs: {' '.join(argv)} exited {code}", file=sys.stderr)
                return code
            if recorder is not None:
                recorder.write(Path(record) / f"run-{i}")
    finally:
        end_processes()
    return 0


if __name__ == "__main__":
    plan = json.loads(Path(sys.argv[1]).read_text())
    settings = {k: plan[k] for k in ("float64", "reports", "record") if k in plan}
    sys.exit(run_all(plan["runs"], **settings, tool_sampler=tuple(plan.get("tool_sampler", ()))))
