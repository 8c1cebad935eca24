"""The four claim experiments (examples/experiments/ppo_epochs.py, critic_init.py, length_bias.py,
overfit_reward.py) end to end on a random tiny stage (tests/examples/claim_stage.py): each arm's settings reach
PPO's configuration, the figures each table is built from are logged, and the tables and figure are written.
The figures themselves come from the full runs (docs/experiments.md)."""

from __future__ import annotations

import pytest
import yaml

from tests.examples.claim_stage import tiny_args, tiny_sizes, tiny_stage
from tests.examples.loader import load_example

arms = load_example("experiments/ppo_arms")
temperature = load_example("experiments/temperature")


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    return tiny_stage(tmp_path_factory.mktemp("claims") / "seed-0")


def _config(folder):
    return yaml.safe_load((folder / "config.yaml").read_text())


@pytest.mark.slow
def test_ppo_epochs_logs_each_epochs_drift_and_reports_it(stage, tmp_path):
    ex = load_example("experiments/ppo_epochs")
    s = tiny_sizes(temperature.SIZES["smoke"])
    args = tiny_args(tmp_path, epochs=[1, 2])
    result = ex.run_stage(tmp_path / "seed-0", stage, 0, s, args)
    assert set(result["arms"]) == {"epochs1", "epochs2"}
    for n in (1, 2):
        cfg = _config(tmp_path / "seed-0" / f"epochs{n}")
        assert cfg["online"]["ppo_epochs"] == n and cfg["online"]["epoch_stats"] is True
        train = result["arms"][f"epochs{n}"]["train"]
        assert [t["rollout"] for t in train] == [1, 2]
        assert all(f"approx_kl/epoch{n}" in t and f"approx_kl/epoch{n + 1}" not in t for t in train)
        assert [e["rollout"] for e in result["arms"][f"epochs{n}"]["eval"]] == [1, 2]
    drift = ex.epoch_drift([result], ex.arms_of((1, 2)))
    assert [(d["arm"], d["epoch"]) for d in drift] == [("epochs1", 1), ("epochs2", 1), ("epochs2", 2)]
    text = ex.report(tmp_path, [result, {**result, "seed": 1}], (1, 2))
    assert "| 2 epochs | 2 |" in text and "Paired per seed against 1 epoch" in text
    assert {p.name for p in tmp_path.iterdir()} >= {"ppo_epochs.md", "ppo_epochs.png", "ppo_epochs_rows.csv"}
