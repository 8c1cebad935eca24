"""examples/experiments/gae_lambda.py end to end at a smoke size on a tiny random policy and reward model of the
built-in task: the two ends of lambda behave as GAE says whatever the critic (lambda = 0 has no variance once
(s_t, a_t) is given; lambda = 1 has the final reward's variance), and the tables and plot are written."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from rlhfkit.tasks import get_task
from tests.examples.loader import EXAMPLES
from tests.helpers import tiny_llama


def _script():
    spec = importlib.util.spec_from_file_location("gae_lambda", EXAMPLES / "experiments" / "gae_lambda.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gae_lambda_experiment_runs_and_its_ends_behave(tmp_path, capsys):
    task = get_task("reviews", seed=0)
    folders = {}
    for name, kind in (("policy", "causal"), ("reward", "scalar")):
        folders[name] = tmp_path / name
        tokenizer = task.build_tokenizer(folders[name])
        ids = dict(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        tiny_llama(kind, seed=1, **ids).save_pretrained(folders[name])
    out = tmp_path / "exp"
    rows = _script().main(
        ["--out", str(out), "--policy", str(folders["policy"]), "--reward-model", str(folders["reward"])]
        + ["--prompts", "3", "--continuations", "4", "--max-new-tokens", "5", "--seeds", "0"]
    )
    assert {p.name for p in out.iterdir()} == {"gae_lambda.json", "gae_lambda.md", "gae_lambda.png"}
    assert json.loads((out / "gae_lambda.json").read_text()) == rows
    assert "| 0.95 |" in capsys.readouterr().out
    (row,) = rows
    assert row["pairs"] >= 3 and row["return_variance"] > 0
    assert row["variance_0"] == pytest.approx(0.0, abs=1e-9)  # delta_t: the next state is fixed by (s_t, a_t)
    assert row["variance_1"] == pytest.approx(row["return_variance"], rel=1e-6)  # R - V(s_t)
    assert row["variance_0.5"] < row["variance_1"]
