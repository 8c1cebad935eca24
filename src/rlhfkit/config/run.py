"""The whole run's configuration (:class:`RunConfig`), the kinds of run, and the per-command defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from rlhfkit.config.fields import option
from rlhfkit.config.online import OnlineConfig, RefreshConfig
from rlhfkit.config.sections import (
    DataConfig,
    DPOConfig,
    LoggingConfig,
    ModelConfig,
    RewardConfig,
    TrainConfig,
)

Kind = Literal["sft", "reward", "prm", "ppo", "grpo", "rloo", "dpo"]
KINDS: tuple[str, ...] = get_args(Kind)
ONLINE_KINDS = ("ppo", "grpo", "rloo")


@dataclass
class RunConfig:
    """Everything one `rlhfkit train <kind>` run needs."""

    output_dir: str = option(
        "", "The run folder: config.yaml, metrics.jsonl, checkpoints/, final/. Required."
    )
    seed: int = option(0, "Seeds python, numpy and torch (and the data order).")
    kind: Kind = option("sft", "What is trained; set by the command (`rlhfkit train <kind>`).")
    model: ModelConfig = option(ModelConfig, "The model.")
    data: DataConfig = option(DataConfig, "The data.")
    train: TrainConfig = option(TrainConfig, "The optimisation loop.")
    online: OnlineConfig = option(OnlineConfig, "Online RL (ppo / grpo / rloo only).")
    refresh: RefreshConfig = option(
        RefreshConfig, "The online reward-model refresh (ppo / grpo / rloo only)."
    )
    reward: RewardConfig = option(RewardConfig, "Reward-model training (reward / prm only).")
    dpo: DPOConfig = option(DPOConfig, "Direct Preference Optimization (dpo only).")
    logging: LoggingConfig = option(LoggingConfig, "Extra metric sinks.")


# Per-command defaults, applied under the file and the command line. `forced` keys may not be set to
# another value: `train grpo` with advantage_estimator=rloo is a contradiction, not a preference.
KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"online.group_size": 4},
    "rloo": {"online.group_size": 4},
}
KIND_FORCED: dict[str, dict[str, Any]] = {
    "grpo": {"online.advantage_estimator": "grpo"},
    "rloo": {"online.advantage_estimator": "rloo"},
}

# The sections each command reads, besides output_dir and seed: what `rlhfkit train KIND --help`, `rlhfkit
# config init KIND` and `rlhfkit config show KIND` list. `refresh` is left out of the online kinds: a refresh
# needs a labeller of new pairs (the quickstart's simulated annotators, or OnlineHooks.refresh_reward_model
# from Python), which `rlhfkit train` has not, so `train ppo|grpo|rloo` refuses refresh.every > 0.
KIND_SECTIONS: dict[str, tuple[str, ...]] = {
    "sft": ("model", "data", "train", "logging"),
    "reward": ("model", "data", "train", "reward", "logging"),
    "prm": ("model", "data", "train", "reward", "logging"),
    "dpo": ("model", "data", "train", "dpo", "logging"),
    **{kind: ("model", "data", "train", "online", "logging") for kind in ONLINE_KINDS},
}
