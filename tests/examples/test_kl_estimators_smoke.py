"""examples/experiments/kl_estimators.py end to end at a smoke size: the categorical part reproduces the claim
(k1 and k3 unbiased for KL(pi || ref), k3 never negative, the reversed k3 unbiased for chi^2 - KL instead), and the
policy part runs on a tiny random policy and reference of the built-in task."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from rlhfkit.tasks import get_task
from tests.examples.loader import EXAMPLES
from tests.helpers import tiny_llama


def _script():
    spec = importlib.util.spec_from_file_location(
        "kl_estimators", EXAMPLES / "experiments" / "kl_estimators.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_kl_estimator_experiment_runs_and_shows_the_claim(tmp_path, capsys):
    task = get_task("reviews", seed=0)
    folders = {}
    for name, seed in (("reference", 0), ("policy", 1)):
        folders[name] = tmp_path / name
        tokenizer = task.build_tokenizer(folders[name])
        ids = dict(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        tiny_llama(seed=seed, **ids).save_pretrained(folders[name])
    out = tmp_path / "exp"
    result = _script().main(
        ["--out", str(out), "--distances", "0.1", "1.0", "--samples", "100000", "--seeds", "0", "1"]
        + ["--policy", str(folders["policy"]), "--reference", str(folders["reference"])]
        + ["--prompts", "8", "--max-new-tokens", "8"]
    )
    assert {p.name for p in out.iterdir()} == {"kl_estimators.json", "kl_estimators.md", "kl_estimators.png"}
    assert (
        json.loads((out / "kl_estimators.json").read_text())["categorical_summary"]
        == result["categorical_summary"]
    )
    assert "| k3_rev |" in capsys.readouterr().out

    far = next(s for s in result["categorical_summary"] if s["distance"] == 1.0)
    assert far["k3_mean"] == pytest.approx(far["kl"], rel=0.03) and far["k1_mean"] == pytest.approx(
        far["kl"], rel=0.03
    )
    assert far["k2_mean"] > far["kl"] * 1.1  # k2 is biased upwards at this distance
    assert far["k3_rev_mean"] == pytest.approx(far["chi2"] - far["kl"], rel=0.05)  # another quantity...
    assert far["k3_rev_mean"] > 1.5 * far["kl"]  # ...well away from KL
    assert all(r["k3_mean"] >= 0 for r in result["categorical"]) and far["k1_negative_share"] > 0.1

    policy = result["policy_samples"]
    assert policy["responses"] == 8 and policy["tokens"] > 0 and policy["kl_exact_mean"] > 0
    assert all(policy[f"{k}_mean"] == policy[f"{k}_mean"] for k in ("k1", "k2", "k3", "k3_rev"))  # not NaN
