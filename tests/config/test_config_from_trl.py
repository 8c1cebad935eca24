"""A configuration written for TRL: every unknown and TRL-named key answered in one error, the defaults that
differ from TRL's said in one warning, TRL's reward_weights and log_completions, a bare value where a list is
expected, and a warm-up longer than the run."""

import re

import pytest

from rlhfkit import cli
from rlhfkit.config import load_config
from rlhfkit.errors import ConfigError

# A GRPOConfig-style YAML with 8 TRL keys, and the rlhfkit key each is answered with.
TRL_GRPO = {
    "learning_rate": "train.learning_rate",
    "num_generations": "online.group_size",
    "max_completion_length": "online.response_length",
    "per_device_train_batch_size": "train.micro_batch_size",
    "beta": "online.kl_coef",
    "num_iterations": "online.ppo_epochs",
    "reward_weights": "online.reward_weights",
    "log_completions": "logging.samples_per_step",
}
TRL_YAML = """\
learning_rate: 1.0e-6
num_generations: 8
max_completion_length: 256
per_device_train_batch_size: 4
beta: 0.04
num_iterations: 2
reward_weights: [1.0, 0.5]
log_completions: true
"""


def required(tmp_path):
    return [
        f"output_dir={tmp_path / 'run'}",
        "model.name_or_path=m",
        "data.train_file=d.jsonl",
        "online.reward_functions=[r.py:f, r.py:g]",
    ]


def test_a_trl_grpo_config_with_8_trl_keys_is_answered_in_one_run(tmp_path, capsys):
    path = tmp_path / "trl.yaml"
    path.write_text(TRL_YAML)
    assert cli.main(["config", "show", "grpo", "--config", str(path), *required(tmp_path)]) == 2
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if line.startswith("rlhfkit: error: ")]
    assert len(error) == 1 and error[0].startswith("rlhfkit: error: 8 unknown keys, all listed here: ")
    for number, (trl, key) in enumerate(TRL_GRPO.items(), 1):
        assert f"({number}) '{trl}' (TRL's '{trl}' is '{key}' in rlhfkit" in error[0], trl
    # the same error from the run's own loader, and with an unknown key on the command line it is listed too
    with pytest.raises(ConfigError) as caught:
        load_config(path, [*required(tmp_path), "online.num_generation=4"], "grpo")
    message = str(caught.value)
    assert message.startswith("9 unknown keys") and f"{path}: (1) 'learning_rate'" in message
    assert (
        "command-line override 'online.num_generation=4': (9) 'online.num_generation' (did you mean"
        in message
    )


def test_one_unknown_key_keeps_its_one_line_message(tmp_path):
    with pytest.raises(ConfigError, match=r"^command-line override 'lora_r=8': unknown key 'lora_r' \(TRL's"):
        load_config(None, [*required(tmp_path), "lora_r=8"], "grpo")


def test_trl_names_warn_once_of_the_rlhfkit_defaults_in_force(tmp_path, capsys):
    path = tmp_path / "trl.yaml"
    path.write_text("num_generations: 8\nbeta: 0.04\n")  # beta given: only the others are defaults in force
    with pytest.raises(ConfigError):
        load_config(path, required(tmp_path), "grpo")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert "online.ppo_epochs=4 (TRL: num_iterations=1" in warnings[0]
    assert "online.temperature=0.7 (TRL: temperature=1.0" in warnings[0]
    assert "online.kl_coef" not in warnings[0]
    # set under rlhfkit's name, a key is not a default in force; without TRL names, or for dpo, no warning
    with pytest.raises(ConfigError):
        load_config(path, [*required(tmp_path), "online.temperature=1.0", "online.ppo_epochs=1"], "grpo")
    assert "warning" not in capsys.readouterr().err
    with pytest.raises(ConfigError):
        load_config(None, [*required(tmp_path), "online.group_sise=4"], "grpo")
    assert "warning" not in capsys.readouterr().err
    path.write_text("num_generations: 8\n")
    with pytest.raises(ConfigError):
        load_config(path, required(tmp_path), "grpo")
    assert "online.kl_coef=0.05 (TRL: beta=0.0" in capsys.readouterr().err


def test_reward_weights_one_per_function_checked_at_start_up(tmp_path):
    cfg = load_config(None, [*required(tmp_path), "online.reward_weights=[2.0, 0.5]"], "grpo")
    assert cfg.online.reward_weights == [2.0, 0.5]
    assert load_config(None, required(tmp_path), "grpo").online.reward_weights is None
    with pytest.raises(ConfigError, match=r"online.reward_weights \(set in .*\): 3 weight\(s\) for 2 reward"):
        load_config(None, [*required(tmp_path), "online.reward_weights=[1, 2, 3]"], "grpo")
    with pytest.raises(ConfigError, match="online.reward_weights .*every weight must be a finite number"):
        load_config(None, [*required(tmp_path), "online.reward_weights=[1, .nan]"], "grpo")


def test_a_bare_value_is_a_one_element_list_where_a_list_is_expected(tmp_path):
    base = [f"output_dir={tmp_path / 'run'}", "model.name_or_path=m", "data.train_file=d.jsonl"]
    cfg = load_config(
        None, [*base, "online.reward_functions=rewards.py:fn", "online.reward_weights=0.5"], "grpo"
    )
    assert cfg.online.reward_functions == ["rewards.py:fn"] and cfg.online.reward_weights == [0.5]
    path = tmp_path / "c.yaml"
    path.write_text("online:\n  reward_functions: pkg.module:fn\n  tools: tools.py:search\n")
    cfg = load_config(path, base, "grpo")
    assert cfg.online.reward_functions == ["pkg.module:fn"] and cfg.online.tools == ["tools.py:search"]


def test_a_warmup_longer_than_the_run_warns_with_the_rate_it_reaches(tmp_path, capsys):
    base = [*required(tmp_path), "train.learning_rate=1e-4"]
    load_config(None, [*base, "train.warmup_steps=100", "train.max_steps=30"], "grpo")
    err = capsys.readouterr().err
    assert re.search(
        r"rlhfkit: warning: train.warmup_steps=100 \(set in command-line override .*\) is longer than "
        r"train.max_steps=30: .* reaches only 30% of train.learning_rate=0.0001 at the last step",
        err,
    ), err
    load_config(None, [*base, "train.warmup_steps=30", "train.max_steps=30"], "grpo")
    assert capsys.readouterr().err == ""
