"""TRL's configuration names and the rlhfkit key that does the same job, for the "unknown key" error
(:func:`trl_hint`) and for docs/coming-from-trl.md.

:data:`TRL_NAMES` maps a field name of TRL's ``GRPOConfig``, ``RLOOConfig``, ``PPOConfig``, ``DPOConfig``,
``RewardConfig``, ``SFTConfig`` (and of ``transformers.TrainingArguments`` and TRL's script arguments, which
they share) to its rlhfkit counterpart per scope: a kind (``"dpo"``), ``"online"`` (ppo, grpo, rloo) or
``"*"`` (every kind). Each entry is ``(rlhfkit key or None, note)``; None means rlhfkit has no such setting
and the note says what it does instead. Names that are already rlhfkit keys in the same section (``seed``,
``output_dir``, ``temperature`` under ``online``) need no entry; a bare key that exists in exactly one
section is completed by :func:`rlhfkit.config.parse` without this table.
"""

from __future__ import annotations

import sys

from rlhfkit.config.fields import get_dotted
from rlhfkit.config.run import KIND_DEFAULTS, ONLINE_KINDS, RunConfig

_BATCH_NOTE = (
    "sequences per forward/backward pass per process; train.batch_size is the global batch: sequences or "
    "pairs per optimizer step of all processes together, and for ppo/grpo/rloo the prompts per rollout "
    "(responses = train.batch_size * online.group_size); gradient accumulation follows from the two"
)

TRL_NAMES: dict[str, dict[str, tuple[str | None, str]]] = {
    # transformers.TrainingArguments, shared by every TRL config
    "learning_rate": {"*": ("train.learning_rate", "")},
    "per_device_train_batch_size": {"*": ("train.micro_batch_size", _BATCH_NOTE)},
    "per_device_eval_batch_size": {
        "online": ("online.rollout_batch_size", "responses per generate() call, per process"),
        "*": ("train.micro_batch_size", "evaluation uses the training micro-batch size"),
    },
    "gradient_accumulation_steps": {
        "*": (
            "train.batch_size",
            "no key of its own: accumulation steps = train.batch_size / (train.micro_batch_size * processes)",
        )
    },
    "num_train_epochs": {
        "*": ("train.max_steps", "rlhfkit counts optimizer steps (ppo/grpo/rloo: rollouts), not epochs")
    },
    "max_steps": {"*": ("train.max_steps", "")},
    "warmup_steps": {"*": ("train.warmup_steps", "")},
    "warmup_ratio": {"*": ("train.warmup_steps", "a number of steps, not a ratio of train.max_steps")},
    "lr_scheduler_type": {"*": ("train.lr_schedule", "constant, linear or cosine")},
    "weight_decay": {"*": ("train.weight_decay", "")},
    "adam_beta1": {"*": ("train.adam_beta1", "")},
    "adam_beta2": {"*": ("train.adam_beta2", "")},
    "adam_epsilon": {"*": ("train.adam_eps", "")},
    "max_grad_norm": {"*": ("train.max_grad_norm", "")},
    "logging_steps": {"*": ("train.log_steps", "")},
    "save_steps": {"*": ("train.save_steps", "")},
    "save_total_limit": {"*": ("train.keep_last_checkpoints", "")},
    "eval_steps": {"*": ("train.eval_steps", "")},
    "bf16": {"*": ("model.dtype", "model.dtype=bfloat16 (auto picks it on a GPU that supports it)")},
    "fp16": {"*": ("model.dtype", "float16 is not offered; model.dtype=bfloat16 or float32")},
    "gradient_checkpointing": {"*": ("model.gradient_checkpointing", "")},
    "report_to": {"*": ("logging.wandb", "logging.wandb=true and/or logging.tensorboard=true")},
    "run_name": {"*": ("logging.wandb_run_name", "")},
    "disable_tqdm": {"*": ("logging.progress_bar", "the opposite sense: logging.progress_bar=false")},
    "dataset_num_proc": {"*": ("data.num_proc", "")},
    "disable_dropout": {"*": ("model.disable_dropout", "")},
    "model_init_kwargs": {"*": ("model.dtype", "model.dtype and model.trust_remote_code")},
    "chat_template_path": {"*": ("data.chat_template", "a Jinja string or the path of a file")},
    "eval_strategy": {"*": ("train.eval_steps", "held-out data is evaluated every train.eval_steps")},
    "save_strategy": {"*": ("train.save_steps", "")},
    "resume_from_checkpoint": {
        "*": (None, "pass --resume to `rlhfkit train`: the newest complete checkpoint")
    },
    "neftune_noise_alpha": {"*": (None, "no noise is added to the embeddings")},
    # TRL's script arguments (ScriptArguments, ModelConfig of trl scripts)
    "model_name_or_path": {"*": ("model.name_or_path", "")},
    "dataset_name": {"*": ("data.train_file", "a hub name, a datasets folder or a file")},
    "dataset_config": {"*": ("data.dataset_config", "")},
    "dataset_train_split": {"*": ("data.train_split", "")},
    "dataset_test_split": {"*": ("data.eval_split", "")},
    "torch_dtype": {"*": ("model.dtype", "auto, float32 or bfloat16")},
    "use_peft": {"*": ("model.lora_rank", "LoRA is on when model.lora_rank > 0")},
    "lora_r": {"*": ("model.lora_rank", "")},
    # GRPOConfig / RLOOConfig / PPOConfig
    "num_generations": {"*": ("online.group_size", "responses per prompt")},
    "rloo_k": {"*": ("online.group_size", "responses per prompt")},
    "max_completion_length": {
        "online": ("online.response_length", "most tokens generated per response"),
        "*": ("data.max_length", "prompt + response, in tokens"),
    },
    "response_length": {"*": ("online.response_length", "")},
    "max_prompt_length": {"*": ("data.max_prompt_length", "")},
    "max_length": {"*": ("data.max_length", "")},
    "max_seq_length": {"*": ("data.max_length", "")},
    "beta": {
        "dpo": ("dpo.beta", ""),
        "online": (
            "online.kl_coef",
            "the KL coefficient; in the reward by default, in the loss with online.kl_in_loss=true "
            "(TRL's GRPO puts it in the loss)",
        ),
    },
    "kl_coef": {"*": ("online.kl_coef", "")},
    "kl_estimator": {"*": ("online.kl_estimator", "")},
    "epsilon": {"*": ("online.clip_eps", "")},
    "cliprange": {"*": ("online.clip_eps", "")},
    "epsilon_high": {"*": ("online.clip_eps_high", "")},
    "delta": {"*": ("online.dual_clip", "a bound on the ratio of negative-advantage tokens (dual clip)")},
    "cliprange_value": {"*": ("online.value_clip_eps", "")},
    "vf_coef": {"*": ("online.vf_coef", "")},
    "num_iterations": {"*": ("online.ppo_epochs", "passes over each rollout")},
    "num_ppo_epochs": {"*": ("online.ppo_epochs", "")},
    "num_mini_batches": {"*": ("online.num_minibatches", "")},
    "steps_per_generation": {"*": ("online.num_minibatches", "optimizer steps per rollout and epoch")},
    "scale_rewards": {
        "*": ("online.normalize_advantages", "true divides by the group's std (grpo); false = Dr. GRPO")
    },
    "loss_type": {
        "dpo": ("dpo.loss", "sigmoid or ipo"),
        "*": (
            "online.loss_agg_mode",
            "token-mean (TRL's dapo and bnpo), seq-mean-token-mean (grpo), seq-mean-token-sum-norm (dr_grpo)",
        ),
    },
    "mask_truncated_completions": {
        "*": ("online.missing_eos", "online.missing_eos=mask leaves responses without a stop token out")
    },
    "missing_eos_penalty": {
        "*": (
            "online.missing_eos_score",
            "with online.missing_eos=penalty the score of a response without a stop token is replaced by "
            "this value (TRL subtracts its penalty from the score)",
        )
    },
    "stop_token": {"*": ("online.stop_token", "")},
    "top_p": {"*": ("online.top_p", "")},
    "top_k": {"*": ("online.top_k", "")},
    "use_vllm": {"*": ("online.generation_backend", "online.generation_backend=vllm")},
    "vllm_gpu_memory_utilization": {"*": ("online.vllm_kv_cache_gib", "whole GiB of the device")},
    "vllm_importance_sampling_correction": {
        "*": ("online.rollout_correction", "online.rollout_correction=tis")
    },
    "vllm_importance_sampling_cap": {"*": ("online.rollout_correction_cap", "")},
    "reward_funcs": {"*": ("online.reward_functions", "'path/to/file.py:fn' or 'pkg.module:fn'")},
    "reward_weights": {"*": ("online.reward_weights", "one weight per reward function; null = all 1")},
    "log_completions": {
        "*": ("logging.samples_per_step", "responses per rollout written to samples.jsonl; 0 = none")
    },
    "num_completions_to_print": {"*": ("logging.samples_per_step", "")},
    "reward_model_path": {"*": ("online.reward_model", "")},
    "sft_model_path": {"*": ("model.name_or_path", "the policy starts from it")},
    "whiten_rewards": {"*": ("online.normalize_advantages", "rlhfkit whitens advantages, not rewards")},
    "local_rollout_forward_batch_size": {"*": ("online.rollout_batch_size", "")},
    "total_episodes": {"*": ("train.max_steps", "rollouts of train.batch_size prompts, not episodes")},
    "generation_batch_size": {
        "*": ("train.batch_size", "prompts per rollout; responses = train.batch_size * online.group_size")
    },
    "dynamic_sampling": {"*": ("online.dynamic_sampling", "")},
    # DPOConfig
    "reference_free": {"*": (None, "DPO always compares with a frozen reference (dpo.reference_model)")},
    "label_smoothing": {"*": ("dpo.label_smoothing", "")},
    "ref_model": {"*": ("dpo.reference_model", "")},
    "truncation_mode": {"*": ("data.truncation", "left keeps the end of a prompt, right its start")},
    "precompute_ref_log_probs": {"*": (None, "the reference's log-probs are computed with every batch")},
    # RewardConfig
    "center_rewards_coefficient": {"*": ("reward.center_coef", "")},
    # SFTConfig
    "dataset_text_field": {"*": ("data.columns", "data.columns={text: your_column}")},
    "packing": {"*": (None, "sequences are padded, never packed")},
    "completion_only_loss": {
        "*": (None, "the SFT loss is always on the completion (or the assistant turns) only")
    },
    "assistant_only_loss": {
        "*": (None, "the SFT loss is always on the completion (or the assistant turns) only")
    },
}


def trl_hint(name: str, kind: str) -> tuple[str | None, str] | None:
    """``(rlhfkit key, note)`` for the TRL name ``name`` under ``rlhfkit train kind``, or None when ``name`` is
    not one of :data:`TRL_NAMES`; an entry with no scope for ``kind`` gives its first scope's key."""
    scopes = TRL_NAMES.get(name)
    if scopes is None:
        return None
    for scope in (kind, "online" if kind in ONLINE_KINDS else None, "*"):
        if scope in scopes:
            return scopes[scope]
    return next(iter(scopes.values()))


# Defaults of TRL's GRPOConfig that differ from rlhfkit's for ppo / grpo / rloo: TRL name -> (rlhfkit key, TRL's
# value, what TRL does with it). A configuration copied from TRL that leaves them out trains differently.
TRL_ONLINE_DEFAULTS: dict[str, tuple[str, object, str]] = {
    "beta": ("online.kl_coef", 0.0, "no KL term; a KL set there goes in the loss, rlhfkit's in the reward"),
    "num_iterations": ("online.ppo_epochs", 1, "one pass over each rollout"),
    "temperature": ("online.temperature", 1.0, "sampling at temperature 1"),
}


def trl_defaults_warning(kind: str, unknown: list[str], set_by: dict[str, str]) -> None:
    """One ``rlhfkit: warning:`` line when the unknown keys of a ``ppo`` / ``grpo`` / ``rloo`` configuration
    include TRL names (it was written for TRL): the rlhfkit defaults in force where TRL's GRPOConfig defaults
    differ, for the keys the configuration sets under neither name (:data:`TRL_ONLINE_DEFAULTS`)."""
    names = {key.rsplit(".", 1)[-1] for key in unknown}
    if kind not in ONLINE_KINDS or not names & (set(TRL_NAMES) | set(TRL_ONLINE_DEFAULTS)):
        return
    defaults = RunConfig()
    in_force = []
    for trl_name, (key, trl_value, meaning) in TRL_ONLINE_DEFAULTS.items():
        if key in set_by or trl_name in names:
            continue
        value = KIND_DEFAULTS.get(kind, {}).get(key, get_dotted(defaults, key))
        in_force.append(f"{key}={value} (TRL: {trl_name}={trl_value}, {meaning})")
    if not in_force:
        return
    print(
        "rlhfkit: warning: this configuration uses TRL's names; where TRL's GRPOConfig defaults differ, "
        f"rlhfkit's are in force: {'; '.join(in_force)}. Set these keys to train as TRL's defaults would",
        file=sys.stderr,
    )
