"""The source is formatted and lint-clean: `ruff format --check` and `ruff check` over the package, the
tests, the benchmarks and the examples, with the settings in pyproject.toml. Part of the suite so that
the README's one test command (which CI runs) also guards the style."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["src", "tests", "benchmarks", "examples"]


def _ruff(*args):
    exe = shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: `pip install -e .[dev]` (or ./setup.sh) installs it")
    return subprocess.run([exe, *args, *TREES], cwd=ROOT, capture_output=True, text=True)


def test_sources_are_formatted():
    done = _ruff("format", "--check")
    assert done.returncode == 0, f"run `ruff format {' '.join(TREES)}`:\n{done.stdout}{done.stderr}"


def test_sources_pass_the_linter():
    done = _ruff("check")
    assert done.returncode == 0, f"run `ruff check {' '.join(TREES)}`:\n{done.stdout}{done.stderr}"
