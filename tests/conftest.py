"""Shared test set-up: torch threads per test, offline hubs, deterministic seeds, learning-test figures.

Learning tests (``@pytest.mark.learning``: a loss must fall, an accuracy or score must rise) take their seed
from the ``learning_seed`` fixture. By default every run uses seed 0 at one torch thread; to see how such a
test's figures spread over machines-like variation, ``benchmarks/learning_spread.py`` reruns them with
``RLHFKIT_TEST_SEED`` and ``RLHFKIT_TEST_THREADS`` set, and collects what each test reports through the
``learning_figures`` fixture (written as JSON lines to ``RLHFKIT_TEST_FIGURES`` when that is set).
"""

import io
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The tokenisation cache (rlhfkit.data.prepare) goes under the datasets cache: one fresh folder per test session.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="rlhfkit-tests-datasets-"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

TEST_THREADS = int(os.environ.get("RLHFKIT_TEST_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)


import pytest  # noqa: E402


def pytest_report_header(config):
    return machine_line()


def machine_line() -> str:
    """Where the tests run: a failure report from another machine says which CPU path torch took."""
    cores = os.cpu_count()
    return (
        f"rlhfkit tests: torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{cores} cores, torch threads per test {TEST_THREADS}, learning seed "
        f"{os.environ.get('RLHFKIT_TEST_SEED', '0')}"
    )


LONG_TESTS = os.environ.get("RLHFKIT_LONG_TESTS") == "1"


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.long`` tests (a whole pipeline, minutes) run only with ``RLHFKIT_LONG_TESTS=1``: CI runs
    them in a step of their own, so the suite stays within its time."""
    if LONG_TESTS:
        return
    skip = pytest.mark.skip(reason="minutes long: run with RLHFKIT_LONG_TESTS=1 (CI's long step does)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


def pytest_sessionstart(session):
    # The report header is hidden under -q (the project's default): print the machine line regardless.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.option.verbose < 0:
        reporter.write_line(machine_line())


@pytest.fixture(autouse=True)
def _torch_threads(monkeypatch):
    """Commands run in-process set torch's thread count from ``RLHFKIT_NUM_THREADS`` (else cores //
    processes): pin both to the test thread count so that every test computes the same numbers whatever ran
    before it and whatever the machine's core count."""
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", str(TEST_THREADS))
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(TEST_THREADS)


@pytest.fixture
def learning_seed() -> int:
    """The seed of a learning test's data, model initialisation and trainer (0 unless RLHFKIT_TEST_SEED)."""
    return int(os.environ.get("RLHFKIT_TEST_SEED", "0"))


@pytest.fixture
def learning_figures(request):
    """``learning_figures(name=value, ...)`` records what a learning test measured (for the spread script)."""

    def record(**figures):
        path = os.environ.get("RLHFKIT_TEST_FIGURES")
        if path:
            row = {
                "test": request.node.nodeid,
                "seed": int(os.environ.get("RLHFKIT_TEST_SEED", "0")),
                "threads": TEST_THREADS,
                **{k: float(v) for k, v in figures.items()},
            }
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return record


# The folders whose tests look at the report's figures themselves: there every figure is drawn. Elsewhere a run's
# report is still built from its metrics, page and all, but each figure's pixels are a constant 1x1 PNG: drawing
# them with matplotlib costs 0.3-0.5 s a figure, over a second a run, and minutes over the suite's runs.
DRAWN_FIGURES = ("reporting", "quickstart", "examples")


def _one_pixel_png() -> bytes:
    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    Image.new("RGB", (1, 1), "white").save(buf, format="PNG")
    return buf.getvalue()


ONE_PIXEL_PNG = _one_pixel_png()


@pytest.fixture(autouse=True)
def _figures_drawn_only_where_looked_at(request, monkeypatch):
    parts = request.node.path.relative_to(request.config.rootpath).parts
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in DRAWN_FIGURES:
        return
    monkeypatch.setattr("rlhfkit.reporting.plots._png", lambda fig: ONE_PIXEL_PNG)
