"""The four roles of PPO and their optimizers (docs/design.md, "Models"; Huang et al. 2024).

- **actor**: the policy, trained, loaded from ``model.name_or_path`` (the SFT policy);
- **reference**: a frozen copy of the same weights; the KL penalty is measured against it;
- **reward model**: frozen (``online.reward_model``), its scores already normalised by the reward trainer;
- **teacher** (on-policy distillation, ``online.teacher_model``): frozen like the reference; its per-token
  log-probs of the actor's samples take the reference's place in a KL term of the reward;
- **critic**: trained, a scalar model loaded from ``online.critic_model``, else from the reward model
  (Huang et al. 2024: the critic starts as the reward model), else from the policy with a fresh head.
  Its values are read like the reward model's scores, ``gain * head + bias`` with the normalisation
  stored in its config (:func:`rlhfkit.rollout.scoring.reward_normalization`; (1, 0) for a fresh head), so
  a critic made from a reward model starts at the normalised scores the rewards are made of, and
  ``final_critic/`` keeps the same read-out.
  Only the ``gae`` estimator has one; GRPO / RLOO / REINFORCE++ are critic-free.

LoRA (``model.lora_rank`` > 0, :mod:`rlhfkit.models.lora`): the reference is the actor with its adapter
disabled, and the critic (from the reward model) is a second adapter with its own value head on the reward
model's weights, the reward model being those weights with that adapter disabled. Two copies of base weights
(policy, reward model) instead of four, and gradients and AdamW state for the adapters and the head only.
A critic from elsewhere (``online.critic_model``, or the policy when there is no reward model), or any
critic when the reward model is refreshed during the run, gets its own frozen base (weights only).

Dropout is off in all four (``model.disable_dropout``, on by default) so that the PPO ratio is exactly 1
before the first update (huggingface/trl#454). The frozen roles are in eval mode with
``requires_grad=False``. The trained roles (actor, critic) keep float32 weights and run under bf16 autocast
when ``model.dtype`` is bfloat16; only the frozen ones hold bf16 weights then (:mod:`rlhfkit.models.precision`).
A tokenizer without a pad token gives every role that grows an embedding row for it the same row. The actor
and the critic each get their own AdamW and learning-rate schedule (the critic's rate is
``online.critic_learning_rate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfkit.config import RunConfig
from rlhfkit.data import TokenLimits
from rlhfkit.engine.optim import optimizer_and_scheduler
from rlhfkit.engine.sharded import shard_model
from rlhfkit.errors import ConfigError
from rlhfkit.models import (
    AdapterDisabled,
    check_same_vocabulary,
    load_causal_lm,
    load_scalar_model,
    prepare_trained,
)
from rlhfkit.models.readout import hf_model
from rlhfkit.models.sampler import set_sampler
from rlhfkit.models.static_decode import set_decode
from rlhfkit.rollout.process_rewards import step_end_table


@dataclass
class Roles:
    """The models of an online run (``critic`` and ``reward_model`` may be None)."""

    actor: torch.nn.Module
    reference: torch.nn.Module
    critic: torch.nn.Module | None
    reward_model: torch.nn.Module | None
    teacher: torch.nn.Module | None = None


def critic_source(cfg: RunConfig) -> str | None:
    """Where the critic is loaded from, or None for the critic-free estimators."""
    online = cfg.online
    if online.advantage_estimator != "gae":
        return None
    return online.critic_model or online.reward_model or cfg.model.name_or_path


def build_roles(
    cfg: RunConfig, tokenizer, device: torch.device | str = "cpu", train_reward_model: bool = False
) -> Roles:
    """Load the actor, the reference, the reward model and the critic as ``cfg`` says, on ``device``.

    ``train_reward_model``: the reward model is trained in place between rollouts (a refresh hook), so it
    keeps float32 weights like the trained roles.

    With ``model.lora_rank`` > 0 the reference is the actor with its adapter disabled
    (:class:`rlhfkit.models.AdapterDisabled`: no second copy of the policy), and a critic loaded from the
    reward model is an adapter (and a trained copy of the head) on the reward model's own weights, the reward
    model being that same model with the adapter disabled; that shared reward model then keeps float32 weights,
    since the critic's trained head and adapters live on it. With ``train_reward_model`` the critic gets its own
    copy instead (the refresh trains the reward model in place).

    Raises:
        ConfigError: a reward or critic model whose tokenizer numbers tokens differently from the policy's.
    """
    model_cfg = cfg.model
    common = dict(trust_remote_code=model_cfg.trust_remote_code, dtype=model_cfg.dtype, tokenizer=tokenizer)
    dropout = not model_cfg.disable_dropout
    lora = model_cfg.lora_rank > 0
    actor = prepare_trained(load_causal_lm(model_cfg.name_or_path, dropout=dropout, **common), model_cfg).to(
        device
    )
    set_decode(actor, cfg.online.hf_decode)  # every hf sampler of the run (online.hf_decode)
    set_sampler(actor, cfg.online.sampler)  # and its draw (online.sampler)
    reference = (
        AdapterDisabled(actor)
        if lora
        else _frozen(load_causal_lm(model_cfg.name_or_path, frozen=True, **common).to(device))
    )
    source = critic_source(cfg)
    # LoRA: the critic's adapters and trained head copy live on the reward model's own weights (unless a
    # refresh trains the reward model in place), so that shared base is a trained role's: float32 weights
    share = (
        lora
        and not train_reward_model
        and bool(cfg.online.reward_model)
        and source == cfg.online.reward_model
    )
    reward_model = None
    if cfg.online.reward_model:
        check_same_vocabulary(
            tokenizer,
            cfg.online.reward_model,
            "online.reward_model",
            model_cfg.trust_remote_code,
            model_cfg.name_or_path,
        )
        reward_model = _frozen(
            load_scalar_model(cfg.online.reward_model, frozen=not (train_reward_model or share), **common).to(
                device
            )
        )
    critic = None
    if source is not None:
        if source != model_cfg.name_or_path:
            check_same_vocabulary(
                tokenizer, source, "online.critic_model", model_cfg.trust_remote_code, model_cfg.name_or_path
            )
        if share:
            # adapters injected into the reward model's modules
            critic = prepare_trained(reward_model, model_cfg)
            reward_model = AdapterDisabled(critic)
        else:
            critic = prepare_trained(load_scalar_model(source, dropout=dropout, **common), model_cfg).to(
                device
            )
    teacher = None
    if cfg.online.teacher_model:  # on-policy distillation: frozen like the reference (vocabulary: preflight)
        teacher = _frozen(load_causal_lm(cfg.online.teacher_model, frozen=True, **common).to(device))
        _check_teacher_width(cfg, actor, teacher)
    return Roles(actor, reference, critic, reward_model, teacher)


def shard_roles(roles: Roles, mode: str, frozen_models: str) -> Roles:
    """Shard ``roles`` in place over the process group (``mode``: full_shard / shard_grad_op): the actor and
    the critic always, the reference, the reward model and a teacher when ``frozen_models == "shard"``."""
    shard_model(roles.actor, mode)
    if roles.critic is not None:
        shard_model(roles.critic, mode)
    if frozen_models == "shard":
        shard_model(roles.reference, mode)
        for frozen in (roles.reward_model, roles.teacher):
            if frozen is not None:
                shard_model(frozen, mode)
    return roles


def _check_teacher_width(cfg: RunConfig, actor: torch.nn.Module, teacher: torch.nn.Module) -> None:
    """ConfigError when a full-vocabulary ``distill.loss`` would compare output layers of different widths (a
    model family may pad its embedding table to another multiple: the tokenizers agree, the logits do not); the
    sampled reverse_kl reads one log-prob per token and takes them."""
    if cfg.kind != "distill" or cfg.distill.loss == "reverse_kl":
        return
    widths = [m.get_output_embeddings().weight.shape[0] for m in (hf_model(actor), hf_model(teacher))]
    if widths[0] != widths[1]:
        raise ConfigError(
            f"distill.loss={cfg.distill.loss}: the student's output layer has {widths[0]} entries and the "
            f"teacher's ({cfg.online.teacher_model}) {widths[1]}; the full-vocabulary losses compare them entry "
            "by entry. Use distill.loss=reverse_kl (one log-prob per sampled token), or a teacher of the "
            "student's width"
        )


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def build_optimizers(cfg: RunConfig, roles: Roles) -> tuple[dict, dict]:
    """AdamW + schedule for the actor and (when there is one) the critic: ``({name: opt}, {name: sched})``.

    Both schedules count rollouts (one scheduler step per rollout, ``train.max_steps`` in all).
    """
    optimizers, schedulers = {}, {}
    optimizers["actor"], schedulers["actor"] = optimizer_and_scheduler(roles.actor, cfg.train)
    if roles.critic is not None:
        lr = cfg.online.critic_learning_rate or cfg.train.learning_rate
        optimizers["critic"], schedulers["critic"] = optimizer_and_scheduler(roles.critic, cfg.train, lr=lr)
    return optimizers, schedulers


def load_process_reward_model(
    cfg: RunConfig, tokenizer, device
) -> tuple[torch.nn.Module | None, torch.Tensor | None]:
    """The frozen PRM of ``online.process_reward_model`` and its step-end table (None, None without one)."""
    path = cfg.online.process_reward_model
    if not path:
        return None, None
    check_same_vocabulary(tokenizer, path, "online.process_reward_model", cfg.model.trust_remote_code)
    model = load_scalar_model(
        path,
        frozen=True,
        trust_remote_code=cfg.model.trust_remote_code,
        dtype=cfg.model.dtype,
        tokenizer=tokenizer,
    ).to(device)
    model.eval().requires_grad_(False)
    return model, step_end_table(tokenizer, TokenLimits().step_separator)
