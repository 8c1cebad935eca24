"""The whole run's configuration (:class:`RunConfig`), the kinds of run, and the per-command defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from rlhfkit.config.fields import option
from rlhfkit.config.online import DistillConfig, OnlineConfig, RefreshConfig
from rlhfkit.config.sections import (
    DataConfig,
    DPOConfig,
    LoggingConfig,
    ModelConfig,
    RewardConfig,
    TrainConfig,
)

Kind = Literal["sft", "reward", "prm", "ppo", "grpo", "rloo", "distill", "dpo"]
KINDS: tuple[str, ...] = get_args(Kind)
ONLINE_KINDS = ("ppo", "grpo", "rloo", "distill")


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
    online: OnlineConfig = option(OnlineConfig, "Online RL (ppo / grpo / rloo / distill only).")
    refresh: RefreshConfig = option(
        RefreshConfig, "The online reward-model refresh (ppo / grpo / rloo only)."
    )
    reward: RewardConfig = option(RewardConfig, "Reward-model training (reward / prm only).")
    dpo: DPOConfig = option(DPOConfig, "Direct Preference Optimization (dpo only).")
    distill: DistillConfig = option(DistillConfig, "On-policy distillation (distill only).")
    logging: LoggingConfig = option(LoggingConfig, "Extra metric sinks.")


# Per-command defaults, applied under the file and the command line. `forced` keys may not be set to
# another value: `train grpo` with advantage_estimator=rloo is a contradiction, not a preference.
KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"online.group_size": 4},
    "rloo": {"online.group_size": 4},
    # on-policy distillation: the teacher's term is the whole reward, each token's own (gamma 0, Thinking
    # Machines' recipe; summed to the end at gamma 1 it paid a shorter response: a quickstart student learned to
    # end at once, docs/quickstart-and-tasks.md), centred, not whitened; one on-policy update per rollout, no KL
    # to the initial policy, and a response cut at response_length keeps its tokens' terms
    "distill": {
        "online.gamma": 0.0,
        "online.normalize_advantages": False,
        "online.kl_coef": 0.0,
        "online.ppo_epochs": 1,
        "online.missing_eos": "none",
    },
}
KIND_FORCED: dict[str, dict[str, Any]] = {
    "grpo": {"online.advantage_estimator": "grpo"},
    "rloo": {"online.advantage_estimator": "rloo"},
    "distill": {"online.advantage_estimator": "reinforce_pp"},
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
    "distill": ("model", "data", "train", "online", "distill", "logging"),
}
