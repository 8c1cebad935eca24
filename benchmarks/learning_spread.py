"""How the learning tests' figures spread over seeds and torch thread counts.

A learning test asserts that training moves a figure past a threshold. Its trajectory depends on the
machine (vector instructions, thread count, reduction order), so each threshold is set from the spread this
script shows: every ``@pytest.mark.learning`` test is run under ``--seeds`` x ``--threads`` (as separate
pytest processes, with ``RLHFKIT_TEST_SEED`` / ``RLHFKIT_TEST_THREADS``), and each figure the tests record
through the ``learning_figures`` fixture is printed with its minimum, median and maximum, beside how many
of the runs passed.

    python benchmarks/learning_spread.py                     # seeds 0-4 x threads 1, 2
    python benchmarks/learning_spread.py --seeds 0 1 --threads 1 -k refresh
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(seed: int, threads: int, figures: Path, select: str | None) -> dict[str, str]:
    """Run the learning tests once; return test id -> 'passed' / 'failed'."""
    env = {
        **os.environ,
        "RLHFKIT_TEST_SEED": str(seed),
        "RLHFKIT_TEST_THREADS": str(threads),
        "RLHFKIT_TEST_FIGURES": str(figures),
    }
    report = figures.with_suffix(f".{seed}.{threads}.txt")
    cmd = [sys.executable, "-m", "pytest", "-m", "learning", "-p", "no:cacheprovider", "-rA", "-q"]
    if select:
        cmd += ["-k", select]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    report.write_text(done.stdout + done.stderr)
    outcome = {}
    for line in done.stdout.splitlines():
        for word in ("PASSED", "FAILED", "ERROR"):
            if line.startswith(word + " "):
                outcome[line.split()[1]] = word.lower()
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        figures = Path(tmp) / "figures.jsonl"
        outcomes: dict[str, list[str]] = defaultdict(list)
        for threads in args.threads:
            for seed in args.seeds:
                for test, result in run(seed, threads, figures, args.select).items():
                    outcomes[test].append(result)
                print(f"seed {seed}, {threads} thread(s): done", file=sys.stderr, flush=True)
        rows = [json.loads(line) for line in figures.read_text().splitlines()] if figures.exists() else []

    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        for key, value in row.items():
            if key not in ("test", "seed", "threads"):
                values[row["test"]][key].append(value)
    for test in sorted(set(outcomes) | set(values)):
        results = outcomes.get(test, [])
        print(f"\n{test}: {results.count('passed')}/{len(results)} passed")
        for key, vs in values[test].items():
            print(
                f"    {key:32s} min {min(vs):9.4f}  median {statistics.median(vs):9.4f}  max {max(vs):9.4f}  "
                f"(n={len(vs)})"
            )


if __name__ == "__main__":
    main()
