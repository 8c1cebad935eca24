"""examples/experiments/overfit_reward.py without training: its defaults, the over-fitted reward model's settings,
and the definition of "over-fitted" that its report checks per seed, fed hand-made accuracies. The end-to-end
smoke test is in test_claim_experiments.py."""

from __future__ import annotations

import pytest
import yaml

from tests.examples.loader import load_example

ex = load_example("experiments/overfit_reward")


def _fit(train=1.0, gold=0.62, usual_gold=0.70, pairs=231):
    return {
        "overfit": {"train_pairs": 512, "train_accuracy": train, "heldout_accuracy": 0.6,
                    "heldout_gold_accuracy": gold, "heldout_gold_pairs": pairs},
        "reward": {"train_pairs": 1019, "train_accuracy": 0.85, "heldout_accuracy": 0.65,
                   "heldout_gold_accuracy": usual_gold, "heldout_gold_pairs": pairs},
    }  # fmt: skip


def test_defaults_are_the_calibrated_over_fitted_reward_model(tmp_path):
    args = ex.parse_args(["--out", str(tmp_path)])
    assert (args.overfit_pairs, args.overfit_steps, args.overfit_lr) == (768, 450, 5e-4)
    assert ex.overfit_settings(args) == {
        "train.max_steps": 450,
        "train.learning_rate": 5e-4,
        "train.weight_decay": 0.0,
        "train.batch_size": 32,
        "reward.keep_best": False,
    }
    with pytest.raises(SystemExit):
        ex.parse_args(["--out", str(tmp_path), "--overfit-lr", "0"])


def test_over_fitted_means_near_perfect_on_its_pairs_above_chance_and_below_the_usual_model_held_out():
    assert ex.overfit_failures(_fit()) == []
    assert ex.overfit_failures(_fit(train=0.97)) == []  # the threshold itself is near-perfect
    assert ex.overfit_failures(_fit(train=0.96))[0].startswith("training accuracy 0.960 < 0.97")
    # 0.55 on 231 pairs is within two standard errors (0.033 each) of chance; 0.58 is not (floor 0.515)
    assert "within 2 standard errors of chance" in ex.overfit_failures(_fit(gold=0.55))[0]
    assert ex.heldout_floor(0.58, 231) == pytest.approx(0.58 - 2 * (0.58 * 0.42 / 231) ** 0.5)
    assert ex.overfit_failures(_fit(gold=0.58)) == []
    assert ex.overfit_failures(_fit(gold=0.58, pairs=60)) != []  # the same accuracy on fewer pairs: not clear
    assert (
        "not below the usual model's 0.700" in ex.overfit_failures(_fit(gold=0.70))[0]
    )  # equal is not below
    assert "not below" in ex.overfit_failures(_fit(gold=0.72))[0]
    assert len(ex.overfit_failures(_fit(train=0.5, gold=0.5, usual_gold=0.5))) == 3
    assert ex.overfit_failures(_fit(gold=None)) == ["no held-out gold accuracy"]


def test_the_fit_table_shows_both_models_per_seed_and_checks_every_seed():
    good, chance = _fit(), _fit(gold=0.51)
    text = ex.fit_table([{"seed": 0, "fit": good}, {"seed": 3, "fit": chance}])
    rows = text.splitlines()
    assert rows[2] == "| 0 | 1.000 / 0.600 / 0.620 | 0.850 / 0.650 / 0.700 | yes |"
    assert rows[3].startswith("| 3 | 1.000 / 0.600 / 0.510 | 0.850 / 0.650 / 0.700 | no: held-out gold")
    assert rows[-1].startswith("Over-fitted (training accuracy >= 0.97;") and rows[-1].endswith(
        "NOT in every seed; fails in seed(s) 3."
    )
    text = ex.fit_table([{"seed": 0, "fit": good}, {"seed": 1, "fit": good}])
    assert text.splitlines()[-1].endswith("yes, in every seed (2 of 2).")


def test_a_reward_model_trained_with_other_settings_is_not_reused(tmp_path):
    folder = tmp_path / "reward-overfit"
    folder.mkdir()
    (folder / "summary.json").write_text("{}")
    trained = {
        "train": {"max_steps": 600, "learning_rate": 5e-4},
        "data": {"train_file": "p/pairs_first128.jsonl"},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(trained))
    args = ex.parse_args(["--out", str(tmp_path)])
    subset = tmp_path / f"pairs_first{args.overfit_pairs}.jsonl"
    with pytest.raises(SystemExit, match="was trained with .*600.*rerun with --overwrite"):
        ex._same_settings(folder, ex.overfit_settings(args), subset, args)
    args.overwrite = True
    ex._same_settings(folder, ex.overfit_settings(args), subset, args)  # --overwrite retrains it
    args = ex.parse_args(["--out", str(tmp_path), "--overfit-pairs", "128", "--overfit-steps", "600"])
    ex._same_settings(folder, ex.overfit_settings(args), tmp_path / "pairs_first128.jsonl", args)  # the same
