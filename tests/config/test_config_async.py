"""``online.max_staleness`` / ``online.generation_processes``: the combinations the overlapping loop cannot
run are refused before training, each naming its key and the reason."""

from __future__ import annotations

import pytest

from rlhfkit.config import load_config
from rlhfkit.config.checks import check_process_count
from rlhfkit.errors import ConfigError

GRPO = ["output_dir=runs/x", "model.name_or_path=m", "data.train_file=d.jsonl", "online.reward_model=rm"]
ASYNC = ["online.max_staleness=1", "online.generation_processes=1"]


def test_the_defaults_are_the_synchronous_loop():
    online = load_config(None, GRPO, "grpo").online
    assert (online.max_staleness, online.generation_processes) == (0, 0)
    assert load_config(None, GRPO + ASYNC, "grpo").online.max_staleness == 1


@pytest.mark.parametrize(
    ("overrides", "key", "reason"),
    [
        (["online.max_staleness=1"], "online.max_staleness", "needs processes that only sample"),
        (["online.generation_processes=1"], "online.generation_processes", "needs online.max_staleness >= 1"),
        (["online.max_staleness=-1"], "online.max_staleness", "must be >= 0"),
        ([*ASYNC, "online.generation_backend=vllm"], "online.generation_backend", "vllm is not supported"),
        ([*ASYNC, "online.tools=[a.py:f]"], "online.tools", "tools episodes is not supported"),
        ([*ASYNC, "online.dynamic_sampling=true"], "online.dynamic_sampling", "not supported with"),
        ([*ASYNC, "refresh.every=2"], "refresh.every", "not supported with online.max_staleness > 0"),
        ([*ASYNC, "train.sharding=full_shard"], "train.sharding", "sharding (full_shard) is not supported"),
    ],
)
def test_async_combinations_not_supported_are_named(overrides, key, reason):
    with pytest.raises(ConfigError) as err:
        load_config(None, GRPO + overrides, "grpo")
    assert str(err.value).startswith(key) and reason in str(err.value)


def test_held_out_evaluation_is_accepted_with_async():
    assert load_config(None, GRPO + ASYNC + ["data.eval_file=e.jsonl"], "grpo").data.eval_file == "e.jsonl"


def test_ppo_with_a_critic_is_accepted_with_async():
    assert load_config(None, GRPO + ASYNC, "ppo").online.advantage_estimator == "gae"


def test_the_launch_must_leave_exactly_one_training_process():
    cfg = load_config(None, GRPO + ASYNC, "grpo")
    with pytest.raises(ConfigError, match=r"online\.generation_processes \(1\) must be below the launched"):
        check_process_count(cfg, 1)
    check_process_count(cfg, 2)
    with pytest.raises(ConfigError, match=r"leaves 2 training processes of 3: more than one"):
        check_process_count(cfg, 3)
    two = load_config(None, GRPO + ["online.max_staleness=2", "online.generation_processes=2"], "grpo")
    check_process_count(two, 3)
