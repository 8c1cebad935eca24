"""Keys of earlier versions: online.norm_by_std and online.whiten_advantages are read into
online.normalize_advantages for the estimators they applied to, with a warning line; a saved config.yaml
of an earlier version trains as it did."""

import pytest

from rlhfkit.config import load_config
from rlhfkit.errors import ConfigError

ONLINE = ["output_dir=runs/x", "model.name_or_path=m", "data.train_file=d.jsonl", "online.reward_model=rm"]


def normalize(kind, *overrides, path=None):
    return load_config(path, [*ONLINE, *overrides], kind).online.normalize_advantages


def test_each_old_key_sets_the_new_one_for_its_estimators(capsys):
    assert normalize("grpo", "online.norm_by_std=false") is False  # Dr. GRPO, as before
    err = capsys.readouterr().err
    assert err.startswith("rlhfkit: warning: online.norm_by_std (set in command-line override")
    assert "read as online.normalize_advantages=false" in err and err.count("\n") == 1
    assert normalize("ppo", "online.whiten_advantages=false") is False
    reinforce = "online.advantage_estimator=reinforce_pp"
    assert normalize("ppo", reinforce, "online.whiten_advantages=false") is False
    # an old key for another estimator did nothing before, and does nothing now
    assert normalize("ppo", "online.norm_by_std=false") is True
    assert "ignored: it does nothing with advantage_estimator=gae" in capsys.readouterr().err
    assert normalize("grpo", "online.whiten_advantages=false") is True
    assert normalize("rloo", "online.norm_by_std=false", "online.whiten_advantages=false") is True


def test_a_saved_config_of_an_earlier_version_loads_as_it_trained(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    for estimator, kind, expected in (("gae", "ppo", False), ("grpo", "grpo", True)):
        path.write_text(
            "online:\n"
            f"  advantage_estimator: {estimator}\n  group_size: 2\n"
            "  norm_by_std: true\n  whiten_advantages: false\n"
        )
        assert normalize(kind, path=path) is expected
        assert capsys.readouterr().err.count("rlhfkit: warning: ") == 2
    assert normalize("ppo", "online.whiten_advantages=true", path=path) is True  # the later layer wins


def test_the_new_key_and_an_old_one_must_agree():
    assert normalize("ppo", "online.whiten_advantages=false", "online.normalize_advantages=false") is False
    with pytest.raises(
        ConfigError, match="online.whiten_advantages .* and online.normalize_advantages .* disagree"
    ):
        normalize("ppo", "online.whiten_advantages=false", "online.normalize_advantages=true")
    with pytest.raises(ConfigError, match="online.norm_by_std: expected true or false, got 'yes please'"):
        normalize("grpo", "online.norm_by_std='yes please'")
