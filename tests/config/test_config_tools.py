"""`rlhfkit train KIND --help`, `rlhfkit config init KIND` and `rlhfkit config show KIND`: KIND's keys at
KIND's defaults, a configuration checked without a run, and TRL's key names answered with rlhfkit's."""

import json
import re

import pytest
import yaml

from rlhfkit import cli
from rlhfkit.config import load_config
from rlhfkit.config.trl_names import TRL_NAMES
from rlhfkit.errors import ConfigError

REQUIRED = {
    "ppo": ["online.reward_model=rm"],
    "grpo": ["online.reward_model=rm"],
    "rloo": ["online.reward_functions=[{}/rewards.py:fn]"],
}
# one row of each kind's data, for the pre-flight of `config show` (it reads every row)
ROW = {
    "sft": {"prompt": "a", "completion": "b"},
    "reward": {"prompt": "a", "chosen": "b", "rejected": "c"},
    "dpo": {"prompt": "a", "chosen": "b", "rejected": "c"},
    "prm": {"prompt": "a", "steps": ["b"], "labels": [True]},
}


def required(tmp_path, kind):
    """The required keys of ``kind`` (a Hub model name: nothing is loaded), with the data file and the reward
    function they name written under ``tmp_path``."""
    (tmp_path / "d.jsonl").write_text(json.dumps(ROW.get(kind, {"prompt": "a"})) + "\n")
    (tmp_path / "rewards.py").write_text(
        "def fn(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    return [
        f"output_dir={tmp_path / 'run'}",
        "model.name_or_path=m",
        f"data.train_file={tmp_path / 'd.jsonl'}",
        *(item.format(tmp_path) for item in REQUIRED.get(kind, [])),
    ]


def test_train_kind_help_lists_only_its_sections_at_its_defaults(capsys):
    assert cli.main(["train", "grpo", "--help"]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"\b(dpo|reward|refresh)\.[a-z_]+ \(", out)
    assert "online.group_size (int, default: 4)" in out
    assert "refresh.*: not listed: `rlhfkit train` has no labeller" in " ".join(out.split())
    assert "REINFORCE++ is ppo with online.advantage_estimator=reinforce_pp" in " ".join(out.split())
    assert cli.main(["train", "dpo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "dpo.beta (float, default: 0.1)" in out and not re.search(r"\bonline\.[a-z_]+ \(", out)
    assert cli.main(["train", "ppo", "--help"]) == 0
    assert "online.group_size (int, default: 1)" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["sft", "reward", "prm", "dpo", "ppo", "grpo", "rloo"])
def test_config_init_passes_config_show_with_only_the_required_keys(kind, tmp_path, capsys):
    assert cli.main(["config", "init", kind]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"# rlhfkit train {kind}:") and "\n  # " in text  # commented
    path = tmp_path / f"{kind}.yaml"
    path.write_text(text)
    assert cli.main(["config", "show", kind, "--config", str(path), *required(tmp_path, kind)]) == 0
    out = capsys.readouterr().out
    shown = yaml.safe_load(out)
    assert shown["kind"] == kind and shown["model"]["name_or_path"] == "m"
    assert ("online" in shown) == (kind in ("ppo", "grpo", "rloo")) and ("dpo" in shown) == (kind == "dpo")
    assert "refresh" not in shown
    # the printed configuration is itself a valid file for the same command
    again = tmp_path / "shown.yaml"
    again.write_text(out)
    assert load_config(again, [], kind).model.name_or_path == "m"
    if kind == "grpo":
        assert shown["online"]["group_size"] == 4 and "group_size: 4\n" in text


def test_config_show_gives_the_runs_own_error_and_exit_2(tmp_path, capsys):
    path = tmp_path / "grpo.yaml"
    path.write_text("online:\n  group_size: 1\n")
    argv = ["config", "show", "grpo", "--config", str(path), *required(tmp_path, "grpo")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlhfkit: error: online.group_size (set in ") and "needs group_size >= 2" in err
    with pytest.raises(ConfigError) as run_error:
        load_config(path, required(tmp_path, "grpo"), "grpo")
    assert str(run_error.value) in err
    assert not (tmp_path / "run").exists()  # nothing written
    assert cli.main([*argv, "online.group_size=2", "refresh.every=2"]) == 2
    assert "refresh.every=2: `rlhfkit train` has no labeller" in capsys.readouterr().err


def test_train_refuses_a_refresh_before_anything_is_written(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("refresh:\n  every: 3\n")
    assert cli.main(["train", "ppo", "--config", str(path), *required(tmp_path, "ppo")]) == 2
    assert "refresh.every=3: `rlhfkit train` has no labeller" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "kind, override, expected",
    [
        ("grpo", "online.num_generations=8", "TRL's 'num_generations' is 'online.group_size'"),
        ("grpo", "beta=0.04", "TRL's 'beta' is 'online.kl_coef'"),
        ("dpo", "beta=0.1", "TRL's 'beta' is 'dpo.beta'"),
        ("grpo", "max_completion_length=256", "TRL's 'max_completion_length' is 'online.response_length'"),
        ("sft", "learning_rate=1e-5", "TRL's 'learning_rate' is 'train.learning_rate'"),
        ("reward", "center_rewards_coefficient=0.01", "is 'reward.center_coef'"),
        ("sft", "packing=true", "TRL's 'packing' has no rlhfkit key"),
        ("grpo", "lora_alpha=32", "did you mean 'model.lora_alpha'?"),
        ("grpo", "batch_size=8", "did you mean 'train.batch_size'?"),  # refresh.batch_size: not read by grpo
        ("grpo", "train.group_size=8", "did you mean 'online.group_size'?"),
    ],
)
def test_a_trl_name_or_a_bare_key_gets_the_rlhfkit_key(tmp_path, kind, override, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(None, [*required(tmp_path, kind), override], kind)


def test_per_device_batch_size_says_what_train_batch_size_is(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(None, [*required(tmp_path, "grpo"), "per_device_train_batch_size=4"], "grpo")
    message = str(error.value)
    assert "'train.micro_batch_size'" in message and "train.batch_size is the global batch" in message
    assert "prompts per rollout" in message


def test_every_trl_name_points_at_a_real_key():
    from rlhfkit.config.describe import keys

    known = {k.name for k in keys()}
    for name, scopes in TRL_NAMES.items():
        for scope, (key, note) in scopes.items():
            assert key is None and note or key in known, (name, scope, key)


def test_config_show_loads_no_model(tmp_path):
    """A fresh process: `config show` resolves and prints without importing transformers or any trainer."""
    import subprocess
    import sys

    code = (
        "import sys; from rlhfkit import cli; "
        f"code = cli.main(['config', 'show', 'grpo', *{required(tmp_path, 'grpo')!r}]); "
        "loaded = [m for m in ('transformers', 'datasets', 'rlhfkit.trainers') if m in sys.modules]; "
        "print(code, loaded, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "0 []", done.stderr
    assert "(1 data rows read)" in done.stdout  # the pre-flight read the data, without transformers
    assert "group_size: 4" in done.stdout


def test_a_trl_name_is_looked_up_by_kind_then_online_then_everywhere_then_its_first_scope():
    from rlhfkit.config.trl_names import trl_hint

    assert trl_hint("per_device_eval_batch_size", "grpo")[0] == "online.rollout_batch_size"  # online
    assert trl_hint("per_device_eval_batch_size", "dpo")[0] == "train.micro_batch_size"  # everywhere
    assert trl_hint("beta", "dpo")[0] == "dpo.beta" and trl_hint("beta", "rloo")[0] == "online.kl_coef"
    assert trl_hint("beta", "sft") == ("dpo.beta", "")  # no scope for sft: the first one
    assert trl_hint("not_a_trl_name", "sft") is None


def test_a_trl_name_with_no_scope_for_the_kind_is_still_named(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("TRL's 'beta' is 'dpo.beta' in rlhfkit")):
        load_config(None, [*required(tmp_path, "sft"), "beta=0.1"], "sft")
