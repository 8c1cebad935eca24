"""The refresh settings as the ``refresh`` section of the run configuration."""

import pytest

from rlhfkit.config import RefreshConfig, config_help, load_config
from rlhfkit.errors import ConfigError

ONLINE = ["output_dir=runs/x", "model.name_or_path=m", "data.train_file=d.jsonl", "online.reward_model=rm"]


def test_the_refresh_section_loads_checks_and_documents_its_keys():
    cfg = load_config(None, [*ONLINE, "refresh.every=3", "refresh.pairs=64"], "ppo")
    assert cfg.refresh == RefreshConfig(every=3, pairs=64)
    assert load_config(None, ONLINE, "ppo").refresh.every == 0  # off unless asked for
    with pytest.raises(ConfigError, match=r"^refresh\.fresh_fraction \(set in command-line override .*\): "):
        load_config(None, [*ONLINE, "refresh.fresh_fraction=1.5"], "ppo")
    with pytest.raises(ConfigError, match=r"^refresh\.pairs: must be >= 1, got 0"):
        RefreshConfig(pairs=0)  # built from Python: checked too
    assert "refresh.every (int, default: 0)" in config_help()


def test_a_refresh_without_a_hook_stops_before_anything_is_written(tmp_path):
    from rlhfkit.trainers import online

    out = tmp_path / "run"
    cfg = load_config(None, [*ONLINE, f"output_dir={out}", "refresh.every=2"], "ppo")
    with pytest.raises(ConfigError, match="refresh.every=2: nothing refreshes the reward model"):
        online.train(cfg)
    assert not out.exists()
