"""Precision and mode of the models while they train: float32 master weights, bf16 autocast, eval-mode updates.

Mixed precision as TRL, OpenRLHF and verl run it: a *trained* role (the policy, the critic, an SFT or reward
model) keeps float32 weights, so AdamW's updates (often ~1e-3 of a weight or less, below bf16's 2**-8
resolution) are not rounded away, and float32 optimizer state; ``model.dtype: bfloat16`` runs its forwards
under ``torch.autocast(bfloat16)`` (matrix products in bf16, reductions in float32). A *frozen* role (the PPO
reference, the reward model during PPO) is never updated, so it may hold bf16 weights; it runs under the same
autocast (docs/performance.md, "Measurements behind the code's choices", has what was measured).

Attention on a CPU under bf16 autocast (:func:`float32_attention_on_cpu`): torch's CPU flash-attention backward
is several times slower in bf16 than in float32 (docs/performance.md). So on a CPU the models' ``sdpa`` attention
runs in float32 (its inputs upcast, its output cast back) in every forward, with or without a backward: the PPO
update must recompute the very function that gave the rollout's old log-probs, and a bf16 no-grad attention
beside a float32 training one made the first ratio differ from 1 by ~1e-3 on a 2-layer model. On a
GPU it is the same ``sdpa`` call as before.

Training mode (:func:`set_update_mode`): with dropout off, a transformers model's ``train()`` mode adds
nothing but randomness that is not dropout (PhiMoE's router samples experts in train mode whatever its jitter
setting; Mixtral's ``router_jitter_noise``; OPT's ``layerdrop``) and gradient checkpointing. The PPO update
must recompute the very function that produced the rollout's log-probs (in eval mode), or the ratio is not 1
before the first step; so its forwards run with every module in eval mode except the gradient-checkpointing
layers' own flag, which only switches checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings

import torch

_WARNED: set[str] = set()


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX); without them bf16 is emulated and slow."""
    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        check = getattr(cpu, probe, None)
        if check is not None and check():
            return True
    return False


def warn_slow_bf16(device: torch.device | str) -> None:
    """Warn once per process that bf16 on a CPU without bf16 instructions is slow (emulated)."""
    if torch.device(device).type != "cpu" or cpu_has_bf16() or "cpu-bf16" in _WARNED:
        return
    _WARNED.add("cpu-bf16")
    warnings.warn(
        "model.dtype is bfloat16 on a CPU without bf16 instructions: every forward is emulated and "
        "runs many times slower than float32; "
        "use model.dtype=float32 (or auto) here",
        UserWarning,
        stacklevel=2,
    )


def autocast_forward(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """Run every forward of ``model`` (training, scoring, ``generate``) under ``torch.autocast(dtype)``.

    The weights keep their dtype. The forward is replaced on the instance by a bound method, so wrappers
    (DDP, accelerate) and ``generate`` go through it, and ``copy.deepcopy`` binds it to the copy. float32 (or
    None) leaves the model as it is.

    Args:
        model: a Hugging Face model (modified in place and returned).
        dtype: the autocast dtype, e.g. ``torch.bfloat16``.
    """
    if dtype is None or dtype == torch.float32:
        return model
    forward = type(model).forward

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        with autocast_region(self):
            return forward(self, *args, **kwargs)

    model.forward = types.MethodType(run, model)
    model.rlhfkit_autocast = dtype
    return model


def autocast_region(model: torch.nn.Module):
    """One autocast region around many forwards of a model :func:`autocast_forward` wrapped (a ``generate``
    call): inside it the float32 weights are cast to the half precision once, not at every decode step (autocast
    keeps its casts until its outermost region ends). A null context for any other model."""
    dtype = getattr(model, "rlhfkit_autocast", None)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=next(model.parameters()).device.type, dtype=dtype)


@contextlib.contextmanager
def frozen_linears_cast(model: torch.nn.Module):
    """Within this block the frozen float32 weights and biases of ``model``'s linear layers are held in its
    autocast dtype (one cast each), their float32 values put back after; for a region of many forwards (a
    ``generate`` call). Autocast keeps its casts of trained leaves for a whole region, but casts a frozen
    weight (a LoRA base, requires_grad False) again at every forward: 135M parameters each decode step.
    Autocast gives a linear layer's bf16 product of the bf16-rounded weight either way, so the outputs are the
    same bit for bit. A weight an embedding also reads (tied embeddings) stays as it is: the embedding is not
    autocast. A null context without :func:`autocast_forward`'s dtype."""
    dtype = getattr(model, "rlhfkit_autocast", None)
    if dtype is None:
        yield model
        return
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    held = []
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for p in (module.weight, module.bias):
            if p is None or p.requires_grad or p.dtype != torch.float32 or id(p) in embeddings:
                continue
            if type(p.data) is not torch.Tensor:  # a sharded (DTensor) weight is left to its owner
                continue
            held.append((p, p.data))
            p.data = p.data.to(dtype)
    try:
        yield model
    finally:
        for p, data in held:
            p.data = data


FLOAT32_CPU_SDPA = "rlhfkit_sdpa_float32_on_cpu"


def _sdpa_float32_on_cpu(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``sdpa`` attention, in float32 when it would run in half precision on a CPU (under autocast,
    or with half-precision inputs); the output in the dtype that attention would have given. The same kernel
    with and without autograd (module docstring), so a no-grad forward equals a training one bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    autocast = torch.is_autocast_enabled("cpu")
    half = autocast or value.dtype in (torch.bfloat16, torch.float16)
    if query.device.type != "cpu" or not half:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    dtype = torch.get_autocast_dtype("cpu") if autocast else value.dtype
    with torch.autocast("cpu", enabled=False):  # autocast would cast the attention back to bf16
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(dtype), weights


def float32_attention_on_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """Give a half-precision model whose attention is ``sdpa`` the same attention computed in float32 on a CPU
    (module docstring); any other attention implementation is left as it is. Returns ``model``."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return model
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FLOAT32_CPU_SDPA, _sdpa_float32_on_cpu)
    AttentionMaskInterface.register(FLOAT32_CPU_SDPA, sdpa_mask)  # the masks sdpa gets
    model.set_attn_implementation(FLOAT32_CPU_SDPA)
    return model


def set_update_mode(model: torch.nn.Module, dropout: bool) -> torch.nn.Module:
    """Put a trained role in the mode of the PPO update's forwards (module docstring).

    Args:
        model: the role (possibly wrapped by DDP / accelerate).
        dropout: the run keeps dropout (``model.disable_dropout: false``): plain ``train()``, the randomness is
            wanted. Otherwise eval mode, except that gradient-checkpointing layers keep ``training = True``
            for themselves (not their children), which transformers reads only to decide on checkpointing.
    Returns:
        ``model``.
    """
    if dropout:
        return model.train()
    model.eval()
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True
    return model
