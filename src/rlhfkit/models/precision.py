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
import os
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


def _frozen_linear_weights(model: torch.nn.Module):
    """(name, parameter) of the frozen float32 weights and biases of ``model``'s linear layers that may be held
    in its autocast dtype: not a weight an embedding also reads (a tied ``lm_head``: the embedding is not
    autocast), not a sharded (DTensor) weight, which is left to its owner."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    seen = set()
    for prefix, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for kind in ("weight", "bias"):
            p = getattr(module, kind)
            if p is None or p.requires_grad or p.dtype != torch.float32 or id(p) in embeddings:
                continue
            if type(p.data) is not torch.Tensor or id(p) in seen:
                continue
            seen.add(id(p))
            yield f"{prefix}.{kind}" if prefix else kind, p


HELD = "rlhfkit_held_float32"  # the model attribute naming the file of a held model's float32 originals


def hold_frozen_linears(model: torch.nn.Module) -> int:
    """Hold a LoRA model's frozen float32 linear weights in its autocast dtype for the whole run, the float32
    originals written once to a safetensors file (a temporary folder, removed with the model or at exit) that
    :func:`restore_frozen_linears` reads back for a merged save.

    Under autocast a linear layer multiplies the bf16-rounded weight whatever the stored dtype, so every forward
    is the same bit for bit (as in :func:`frozen_linears_cast`), but the process no longer holds 4 bytes per
    frozen weight beside the 2 of its cast: about 4 GB less for a 1B-parameter base, ~430 MB for
    SmolLM2-135M (measured: 1,038 -> 741 MiB resident after loading it with LoRA r16). A model without :func:`autocast_forward`'s dtype, or without such weights, is left as it is.
    Returns the number of weights held.
    """
    dtype = getattr(model, "rlhfkit_autocast", None)
    if dtype is None or getattr(model, HELD, None):
        return 0
    weights = list(_frozen_linear_weights(model))
    if not weights:
        return 0
    import shutil
    import tempfile
    import weakref

    from safetensors.torch import save_file

    folder = tempfile.mkdtemp(prefix="rlhfkit-float32-base-")
    file = os.path.join(folder, "frozen_linears.safetensors")
    save_file({name: p.detach().cpu().contiguous() for name, p in weights}, file)
    held = set()
    for _, p in weights:
        p.data = p.data.to(dtype)
        held.add(id(p))
    # transformers maps a safetensors file into memory and the float32 weights are views of that map: once
    # read, its pages count in the process's memory for as long as one view lives. The rest of the frozen
    # weights (embeddings, norms) and the buffers get their own copies, so the map and its pages go.
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in held and not p.requires_grad:
                p.data = p.data.clone()
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.clone()
    setattr(model, HELD, file)
    weakref.finalize(model, shutil.rmtree, folder, True)
    return len(weights)


HALF_HEAD = "rlhfkit_half_weight"  # the output module's attribute holding its weight's autocast-dtype copy


def hold_tied_head_cast(model: torch.nn.Module) -> bool:
    """Give a model whose frozen float32 output projection shares its weight with the input embedding (tied
    embeddings, as SmolLM2, Gemma, Qwen2 0.5B) a copy of that weight in the autocast dtype, which its output
    module multiplies under autocast instead of casting the float32 weight again at every call.

    :func:`hold_frozen_linears` cannot hold such a weight in bf16: the embedding reads it too, and is not
    autocast. Autocast does not keep its cast of a frozen weight, so each call cast the whole (V, H) matrix
    again: 28M values at every decoding step and every read-out chunk of SmolLM2-135M, 20-50 ms each on this
    CPU (torch.profiler). Autocast's cast is a round to nearest of the same values, so the products are the
    same bit for bit (``tests/models/test_held_base.py``). The copy is a plain attribute (not a buffer: no
    state dict, no broadcast), made again should the weight ever change (its version counter).

    Only for a model under :func:`autocast_forward`'s dtype whose output module is a plain ``nn.Linear`` with
    a frozen float32 (not sharded) weight that the input embedding also holds. Returns whether it was set up."""
    dtype = getattr(model, "rlhfkit_autocast", None)
    get_out, get_in = (
        getattr(model, "get_output_embeddings", None),
        getattr(model, "get_input_embeddings", None),
    )
    if dtype is None or get_out is None or get_in is None:
        return False
    head, embedding = get_out(), get_in()
    if type(head) is not torch.nn.Linear or embedding is None or head.weight is not embedding.weight:
        return False
    weight = head.weight
    if weight.requires_grad or weight.dtype != torch.float32 or type(weight.data) is not torch.Tensor:
        return False
    if hasattr(head, HALF_HEAD):  # set up already (the copy itself is made at the first call)
        return True

    def forward(self, x):
        w = self.weight
        if not (
            torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) == dtype
        ):
            return torch.nn.functional.linear(x, w, self.bias)
        held = getattr(self, HALF_HEAD)
        key = (w.data_ptr(), w._version, w.device)
        if held is None or held[0] != key:
            with torch.no_grad():
                held = (key, w.detach().to(dtype))
            setattr(self, HALF_HEAD, held)
        return torch.nn.functional.linear(x, held[1], self.bias)

    setattr(head, HALF_HEAD, None)
    head.forward = types.MethodType(forward, head)
    return True


def restore_frozen_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Put the float32 originals :func:`hold_frozen_linears` wrote back into ``model`` (the held model or a
    copy of it: the weights are found by name), so that merging an adapter into them is exact. Returns
    ``model``; a model that holds none is returned as it is."""
    file = getattr(model, HELD, None)
    if not file:
        return model
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    with safe_open(file, framework="pt") as f:
        for name in f.keys():
            p = params[name]
            p.data = f.get_tensor(name).to(p.device)
    setattr(model, HELD, None)
    return model


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
    held = []
    for _, p in _frozen_linear_weights(model):
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
    with and without autograd (module docstring), so a no-grad forward equals a training one bit for bit. One
    decoding step over a bf16 cache is :mod:`rlhfkit.models.decode_attention`'s float32 arithmetic instead (the
    same function summed in another order; sampling only: no trained forward has one query position)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    autocast = torch.is_autocast_enabled("cpu")
    half = autocast or value.dtype in (torch.bfloat16, torch.float16)
    if query.device.type != "cpu" or not half:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    dtype = torch.get_autocast_dtype("cpu") if autocast else value.dtype
    from rlhfkit.models import decode_attention as decode

    if decode.applies(query, key, value, attention_mask, kwargs):  # one decoding step over a bf16 cache
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        out = decode.decode_attention(query, key, value, attention_mask, scale)
        return out.transpose(1, 2).contiguous().to(dtype), None
    with torch.autocast("cpu", enabled=False):  # autocast would cast the attention back to bf16
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(dtype), weights


def attention_in_float32(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``model`` (possibly wrapped), run on ``device``, computes a half-precision attention in float32
    (:func:`float32_attention_on_cpu`): its decoding cache may then hold float32 keys and values
    (:func:`rlhfkit.models.decode_cache.reserve_positions`)."""
    from rlhfkit.models.readout import hf_model

    config = getattr(hf_model(model), "config", None)
    return (
        torch.device(device).type == "cpu"
        and getattr(config, "_attn_implementation", None) == FLOAT32_CPU_SDPA
    )


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


def carry_precision(source: torch.nn.Module, target: torch.nn.Module) -> torch.nn.Module:
    """Give ``target``, a model built apart from ``source`` on ``source``'s config (the whole-weights copy of a
    sharded actor that generates: rlhfkit.trainers.online.sharding), ``source``'s :func:`autocast_forward`
    dtype, decode (:func:`rlhfkit.models.static_decode.set_decode`) and draw
    (:func:`rlhfkit.models.sampler.set_sampler`), so that both compute and sample the same function.
    (The attention implementation, float32 on a CPU included, is
    in the config they share.) Returns ``target``."""
    from rlhfkit.models.sampler import sampler_of, set_sampler
    from rlhfkit.models.static_decode import decode_of, set_decode

    set_decode(target, decode_of(source))  # the gathered copy decodes as the actor does (online.hf_decode)
    set_sampler(target, sampler_of(source))  # and draws as it does (online.sampler)
    return autocast_forward(target, getattr(source, "rlhfkit_autocast", None))


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
