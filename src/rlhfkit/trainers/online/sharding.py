"""The online loop under ``train.sharding`` (FSDP2, :mod:`rlhfkit.engine.sharded`): which roles are sharded,
the unsharded copy that generates, the sharded checkpoints and the whole models of ``final/``.

- The actor and the critic are sharded (:func:`rlhfkit.trainers.online.roles.shard_roles`) with their gradients and AdamW state (1/N per process); the frozen
  reference and reward model are sharded too, forward-only (``train.frozen_models=shard``, the default: it
  saves memory), or whole on every process (``replicate``). The process reward model stays whole.
- Generation: Hugging Face ``generate`` on a sharded actor would all-gather every layer for every new token,
  and the processes would have to take the same number of decoding steps (their all-gathers pair up) although
  their responses end at different lengths. Instead the actor's whole weights are gathered once per rollout
  into a plain copy (:func:`generation_model`), which each process samples from alone and then frees (multi-turn
  episodes with tools play every turn from it, so a process whose episodes end sooner makes fewer ``generate``
  calls and no collective waits for it; tests/distributed/test_sharded_online.py); the
  log-prob forwards of the rollout and the update use the sharded actor (every process runs as many of them:
  equal shares of every rollout, cut into the same micro-batches). Measured on 2 CPU processes (gloo, a shared
  machine; ``benchmarks/sharded_generation.py``, docs/performance.md "Sharded training"): ``generate`` on the
  sharded actor (``synced_gpus``) took 3.2x the gathered copy's time per rollout at the tiny preset and 7.1x
  at the small one, gather included. With ``online.generation_backend=vllm`` nothing is gathered into a copy:
  each process's engine gets the actor's weights streamed one gathered parameter at a time
  (:func:`rlhfkit.rollout.engine_weights.streamed_weights`; docs/distributed.md "vLLM with sharding").
- The update is the data-parallel one: FSDP's reduce-scatter averages gradients as DDP's all-reduce does, so
  :func:`rlhfkit.engine.accel.dp_scale` and the whole-minibatch normaliser apply unchanged.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from rlhfkit.engine import sharded
from rlhfkit.models.precision import carry_precision
from rlhfkit.trainers.online.roles import Roles

if TYPE_CHECKING:
    from rlhfkit.trainers.online.context import OnlineContext


def is_sharded(ctx: OnlineContext) -> bool:
    return sharded.is_sharded(ctx.roles.actor)


@contextlib.contextmanager
def generation_model(ctx: OnlineContext, engine: bool = False):
    """The actor to sample from: itself, or a sharded actor's whole weights gathered into a plain copy (one
    all-gather of the model per rollout, a collective) with the actor's precision set-up (bf16 autocast, float32
    CPU attention: the copy samples from the policy the update trains), freed on exit. With ``engine`` (the
    vllm backend samples; the model handed on is not read) the actor itself: nothing is gathered."""
    if engine or not is_sharded(ctx):
        yield ctx.roles.actor
        return
    copy = carry_precision(ctx.roles.actor, sharded.unshard(ctx.roles.actor))
    copy.eval()
    try:
        yield copy
    finally:
        del copy


def reshard(roles: Roles) -> None:
    """Free the gathered parameters of the sharded trained roles after no-grad forwards (a trained root, and
    under shard_grad_op every unit, stays gathered after a forward, for its backward:
    :func:`rlhfkit.engine.sharded.shard_model`)."""
    for model in trained_roles(roles).values():
        for unit in model.modules():
            if sharded.is_sharded(unit):
                unit.reshard()


def final_models(ctx: OnlineContext) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """(actor, critic) whole, for ``final/`` and ``final_critic/``: gathered when sharded (a collective)."""
    actor, critic = ctx.roles.actor, ctx.roles.critic
    if not is_sharded(ctx):
        return actor, critic
    whole_critic = None if critic is None else carry_precision(critic, sharded.unshard(critic))
    return carry_precision(actor, sharded.unshard(actor)), whole_critic


def micro_batch_passes(ctx: OnlineContext, micros: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The micro-batches (local row indices) of a minibatch, None for a zero-weighted pass (no row of this
    process's own). Sharded, every process makes as many passes as the process with the most (one
    all-reduce): each forward and backward of a sharded model is a collective, so a process with fewer
    micro-batches joins the others' with passes that add nothing (data parallel needs this only when a
    process holds no row: DDP synchronises once per minibatch)."""
    passes: list[torch.Tensor | None] = list(micros) or [None]
    if is_sharded(ctx) and ctx.accelerator.num_processes > 1:
        most = torch.tensor([len(passes)], device=ctx.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        passes += [None] * (int(most) - len(passes))
    return passes


def trained_roles(roles: Roles) -> dict[str, torch.nn.Module]:
    """The trained roles by name (``actor``, and ``critic`` when there is one)."""
    out = {"actor": roles.actor}
    if roles.critic is not None:
        out["critic"] = roles.critic
    return out
