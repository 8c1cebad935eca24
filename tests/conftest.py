"""Shared test set-up: one torch thread per test process, offline hubs, deterministic seeds."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The tokenisation cache (rlhfkit.data.prepare) goes under the datasets cache: one fresh folder per test session.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="rlhfkit-tests-datasets-"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Commands run in-process set torch's thread count (cores // processes); put it back to one so that
    every test computes the same numbers whatever ran before it."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)
