"""rlhfkit.algos stays pure (docs/design.md, "The layers"); the batch dataclasses in rlhfkit.types."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

import rlhfkit.algos
from rlhfkit.types import PreferenceBatch, Rollout

HEAVY = ("transformers", "accelerate", "datasets", "safetensors", "yaml", "omegaconf", "tqdm", "matplotlib")


def test_algos_imports_only_torch_stdlib_and_types():
    for path in pathlib.Path(rlhfkit.algos.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                assert top not in HEAVY, f"{path.name} imports {name}"
                if top == "rlhfkit":
                    assert name.startswith(("rlhfkit.algos", "rlhfkit.types")), f"{path.name} imports {name}"
                assert name not in ("io", "json", "pickle", "os", "pathlib", "requests"), (
                    f"{path.name} does I/O: {name}"
                )


def test_importing_algos_loads_nothing_heavy():
    frameworks = ("transformers", "accelerate", "datasets")  # (torch itself loads tqdm)
    code = (
        "import sys, rlhfkit.algos; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {frameworks!r} or m.startswith('rlhfkit')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)  # a printed list of module names
    assert all(m == "rlhfkit" or m.startswith(("rlhfkit.algos", "rlhfkit.types")) for m in loaded), loaded


def _rollout(B=4, P=3, T=5, **kw):
    return Rollout(
        query_ids=torch.zeros(B, P, dtype=torch.long),
        query_mask=torch.ones(B, P),
        response_ids=torch.arange(B * T).view(B, T),
        mask=torch.ones(B, T, dtype=torch.bool),
        logprobs=torch.zeros(B, T),
        ref_logprobs=torch.zeros(B, T),
        **kw,
    )


def test_rollout_select_and_to():
    r = _rollout(scores=torch.arange(4.0), group_ids=torch.tensor([0, 0, 1, 1]))
    assert r.batch_size == 4
    part = r.select(torch.tensor([3, 1]))
    assert part.batch_size == 2 and part.values is None
    assert torch.equal(part.scores, torch.tensor([3.0, 1.0]))
    assert torch.equal(part.response_ids[0], r.response_ids[3])
    assert torch.equal(r.select(slice(0, 2)).group_ids, torch.tensor([0, 0]))
    assert r.to("cpu").scores is not None


def test_rollout_checks_shapes():
    with pytest.raises(ValueError, match="batch size"):
        _rollout(scores=torch.zeros(3))
    with pytest.raises(ValueError, match="Rollout.values"):
        _rollout(values=torch.zeros(4, 6))


def test_preference_batch_from_collator_dict():
    batch = {
        "chosen_input_ids": torch.ones(2, 4, dtype=torch.long),
        "chosen_attention_mask": torch.ones(2, 4),
        "rejected_input_ids": torch.ones(2, 4, dtype=torch.long),
        "rejected_attention_mask": torch.ones(2, 4),
        "something_else": [1, 2],
    }
    pb = PreferenceBatch.from_dict(batch)
    assert pb.batch_size == 2 and pb.margin is None
    assert pb.select([1]).batch_size == 1
