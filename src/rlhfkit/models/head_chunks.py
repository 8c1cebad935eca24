"""Token log-probs and entropies from the last hidden states, the output projection applied a chunk of tokens
at a time, so that no (B, T, V) logits tensor is ever held, with or without grad.

A causal LM's read-out used to take the whole ``(B, T, V)`` logits from the model and a float32 copy of them:
at V = 49k and B x T = 32 x 100 that is 0.6 GB a copy, for a 135M model. Here the model runs with
``logits_to_keep=1`` (its own projection of one column, unused), a forward hook takes the decoder's last hidden
states ``(B, L, H)``, and :func:`chunked_readout` applies the model's own output module (``lm_head``: tied
embeddings, a bias, or a peft LoRA layer on it alike) to ``chunk_tokens`` positions at a time. Under autograd
each chunk runs inside ``torch.utils.checkpoint`` (non-reentrant): its backward recomputes that chunk's logits
from the saved hidden states instead of keeping them (Liger-Kernel's fused linear cross-entropy and Cut Your
Losses in Large-Vocabulary Language Models, Wijmans et al. 2024, do the same in one kernel). Peak memory of the
read-out: the (B, T, H) hidden states plus a few (chunk_tokens, V) float32 blocks.

Which models take this path (:func:`chunkable`, :func:`head_transform`) is decided by what the model computes,
not by its name: its causal-LM forward must accept ``logits_to_keep``, it must not be sharded by FSDP (its head's
weight a DTensor outside the forward, where the chunks would apply it), and its logits must be ``lm_head(last
hidden state)`` up to a final transform the chunks apply too: a constant scale (Cohere's ``logit_scale``,
Granite's division by ``logits_scaling``, FalconH1's ``lm_head_multiplier``) and a soft-capping ``cap * tanh(
logits / cap)`` (Gemma 2/3's ``final_logit_softcapping``). The candidates come from those config fields, and the
one applied is the one that a probe confirms: once per model, a no-grad forward of a fixed batch compares the
model's own last-position logits with the transformed ``lm_head`` of the last hidden state. A model that
transforms its logits in any other way matches no candidate and takes the plain path
(:func:`rlhfkit.models.readout.response_forward`), never a wrong read-out (docs/known-bugs.md, "Scaled output
heads"). tests/models/test_head_chunks.py compares both paths on every architecture of
tests/models/tiny_architectures.py, FalconH1, Granite, Cohere and Gemma 2/3 among them.

Shapes: ``B`` rows, ``L`` sequence length, ``R`` response length, ``H`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from rlhfkit.algos import entropy_from_logits
from rlhfkit.models.precision import autocast_region
from rlhfkit.models.prompt_cache import cache_keyword, shared_prompt_cache
from rlhfkit.models.readout import (
    hf_model,
    position_ids_from_mask,
    response_forward,
    sampled_logprobs,
    unwrap_model,
)
from rlhfkit.models.sampling import Sampling, processed_logits

# Elements of one (chunk_tokens, V) float32 block: 2**22 = 16 MiB. The read-out of a chunk holds a few such
# blocks at once (the logits, their float32 processed copy, the softmax of the backward).
CHUNK_ELEMENTS = 1 << 22

# Config fields of a constant final scale of the logits: each value v gives the candidates logits * v and
# logits / v (transformers' Cohere multiplies by logit_scale, Granite divides by logits_scaling, HyperCLOVA X
# multiplies by it, FalconH1 multiplies by lm_head_multiplier); the probe keeps the one the model computes.
_SCALE_FIELDS = ("logit_scale", "logits_scaling", "lm_head_multiplier")
# The attribute of the Hugging Face model that caches the probe's answer, keyed by the candidates.
_PROBED = "_rlhfkit_head_transform"
# Relative tolerance of the probe: max |logits - transform(head(h))| <= tol * max |logits|. A wrong candidate is
# off by |1 - v| (a scale) or more; float32 agrees to ~1e-6, a bf16 head to ~1e-2.
_PROBE_TOL = {torch.float32: 1e-4, torch.float64: 1e-4}
_PROBE_TOL_LOW = 3e-2


class Readout(NamedTuple):
    """What :func:`response_readout` gives.

    Attributes:
        logprobs: (B, R) float32, log pi(y_t | x, y_<t) under the sampling distribution.
        entropy: (B, R) float32 entropy of that distribution at each position, or None when not asked for.
        aux_loss: a mixture of experts' router load-balancing loss (scalar), or None.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    aux_loss: torch.Tensor | None


class HeadTransform(NamedTuple):
    """The final transform of a causal LM's logits: ``softcap(lm_head(h) * scale)``, where ``softcap(z) =
    cap * tanh(z / cap)`` (None: no capping)."""

    scale: float = 1.0
    softcap: float | None = None


def chunkable(model: torch.nn.Module) -> bool:
    """Whether ``model`` (possibly wrapped: DDP, peft) takes the chunked read-out (module docstring)."""
    return head_transform(model) is not None


def head_transform(model: torch.nn.Module) -> HeadTransform | None:
    """The final transform of ``model``'s logits that the chunked read-out applies, or None when ``model``
    must take the plain path (module docstring).

    A property of the model: the probe runs once per model (cached on it, keyed by the config fields it read),
    depends on nothing but the model's weights and config (no FSDP state, no process group, no random draw), and
    a sharded model is never probed, so every process of a run takes the same path.
    """
    lm = hf_model(model)
    config = getattr(lm, "config", None)
    if config is None or "logits_to_keep" not in inspect.signature(lm.forward).parameters:
        return None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if not (isinstance(head, torch.nn.Module) and isinstance(decoder, torch.nn.Module) and decoder is not lm):
        return None
    # FSDP2 (train.sharding) holds the head's weight as a sharded DTensor outside the model's forward, where the
    # chunks would apply it: a sharded model reads out the plain way. Asked of the modules' classes, which
    # sharding sets once, not of the parameters, which are DTensors or not depending on whether the root is
    # gathered at that moment.
    if _sharded(lm) or any(_is_dtensor(p) for p in head.parameters()):
        return None
    candidates = _candidates(config)
    cached = lm.__dict__.get(_PROBED)
    if cached is None or cached[0] != candidates:
        cached = (candidates, _probe(model, lm, head, decoder, candidates))
        lm.__dict__[_PROBED] = cached
    return cached[1]


def _candidates(config) -> tuple[HeadTransform, ...]:
    """The transforms the config names, the plain head last (a field a model does not apply is harmless)."""
    scales = []
    for name in _SCALE_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
            scales += [float(value), 1.0 / float(value)]
    scales.append(1.0)
    cap = getattr(config, "final_logit_softcapping", None)
    caps = [float(cap), None] if isinstance(cap, (int, float)) and cap > 0 else [None]
    return tuple(dict.fromkeys(HeadTransform(scale, c) for c in caps for scale in scales))


def _apply(logits: torch.Tensor, transform: HeadTransform) -> torch.Tensor:
    """``softcap(logits * scale)`` in the order transformers' models apply them."""
    if transform.scale != 1.0:
        logits = logits * transform.scale
    if transform.softcap:  # transformers' Gemma2ForCausalLM: logits / cap, tanh, * cap
        logits = torch.tanh(logits / transform.softcap) * transform.softcap
    return logits


def head_logits(head: torch.nn.Module, transform: HeadTransform, hidden: torch.Tensor) -> torch.Tensor:
    """The logits ``transform(head(hidden))``: hidden (..., H) -> (..., V), as the model's forward computes them."""
    return _apply(head(hidden), transform)


def head_autocast(model: torch.nn.Module):
    """The autocast region the output projection of ``model`` runs under in its own forward (a null context for
    a model that :func:`rlhfkit.models.precision.autocast_forward` did not wrap)."""
    lm = hf_model(model)
    return autocast_region(lm if hasattr(lm, "rlhfkit_autocast") else unwrap_model(model))


def _probe(model, lm, head, decoder, candidates) -> HeadTransform | None:
    """The first of ``candidates`` under which ``head`` of the last hidden state gives the model's own last-
    position logits, on a fixed batch (2 rows of 6 tokens); None when none does. No grad, the random state
    restored (a dropout draw here would shift a resumed run's stream), the model's own (autocast) forward."""
    embeddings = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    param = getattr(embeddings, "weight", None)
    param = param if isinstance(param, torch.Tensor) else next(lm.parameters())
    vocab = int(getattr(head, "out_features", None) or head.weight.shape[0])
    vocab = min(vocab, param.shape[0]) if param.dim() == 2 else vocab  # ids the embedding has rows for
    ids = (torch.arange(12, device=param.device).view(2, 6) * 7919 + 11) % vocab  # (2, 6)
    mask = torch.ones_like(ids)
    captured = []
    devices = [param.device] if param.device.type == "cuda" else []
    hook = decoder.register_forward_hook(_keep_hidden(captured))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            out = unwrap_model(model)(  # not a DDP wrapper: its forward may broadcast buffers (a collective)
                input_ids=ids,
                attention_mask=mask,
                position_ids=position_ids_from_mask(mask),
                logits_to_keep=1,
                use_cache=False,
            )
            if len(captured) != 1:
                return None
            with head_autocast(model):
                raw = head(captured[0][:, -1:])  # (2, 1, V)
    finally:
        hook.remove()
    want = out.logits[:, -1:].float()  # (2, 1, V)
    size = float(want.abs().max())
    if want.shape != raw.shape or not size > 0 or not torch.isfinite(want).all():
        return None
    tol = _PROBE_TOL.get(raw.dtype, _PROBE_TOL_LOW) * size
    for transform in candidates:
        if float((_apply(raw.float(), transform) - want).abs().max()) <= tol:
            return transform
    return None


def _keep_hidden(captured: list):
    """A forward hook for the decoder that appends its last hidden states (B, L, H) to ``captured``."""

    def hook(_module, _inputs, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    return hook


def _sharded(lm: torch.nn.Module) -> bool:
    """Whether FSDP2 has sharded ``lm`` or one of its modules (a class that ``fully_shard`` sets)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in lm.modules())


def can_share_prompts(model: torch.nn.Module) -> bool:
    """Whether :func:`response_readout` may run a repeated prompt once for ``model``: a model called twice in
    one forward (the prompt pass, then the rest) must not be a DDP wrapper (one forward per backward) nor
    recompute its layers (gradient checkpointing runs without a cache)."""
    if unwrap_model(model) is not model:
        return False
    return not any(getattr(m, "gradient_checkpointing", False) is True for m in hf_model(model).modules())


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def chunk_size(vocab: int, chunk_tokens: int | None = None) -> int:
    """Tokens per chunk: ``chunk_tokens``, or as many as fit :data:`CHUNK_ELEMENTS` float32 values (>= 1)."""
    return chunk_tokens if chunk_tokens else max(1, CHUNK_ELEMENTS // max(1, vocab))


def _chunk_readout(head, transform, sampling, want_entropy, entropy_grad, hidden, labels):
    """Log-probs (and entropies) of ``labels`` (n,) from ``hidden`` (n, H): one chunk of tokens."""
    logits = head_logits(head, transform, hidden[None])  # (1, n, V)
    logprobs = sampled_logprobs(logits, labels[None], sampling)[0]  # (n,)
    if not want_entropy:
        return logprobs, torch.zeros_like(logprobs)
    return logprobs, _entropy(logits, sampling, labels[None], entropy_grad)[0]


def _entropy(logits, sampling, labels, grad: bool) -> torch.Tensor:
    """The entropy of the sampling distribution at each position; with ``grad`` False a value only: no graph,
    and inside a checkpointed chunk nothing of it is recomputed in the backward (non-reentrant checkpointing
    stops once the tensors the backward needs are back)."""
    with contextlib.nullcontext() if grad else torch.no_grad():
        return entropy_from_logits(processed_logits(logits, sampling, labels))


def checkpointed_chunks(fn, tensors: tuple[torch.Tensor, ...], size: int, recorded: bool) -> list:
    """``fn(*chunk)`` for each chunk of ``size`` rows of ``tensors`` (all split along their first dimension),
    each call inside ``torch.utils.checkpoint`` (non-reentrant) when ``recorded``: the backward then recomputes
    what a chunk computed from its inputs instead of keeping it (module docstring)."""
    chunks = zip(*(t.split(size) for t in tensors), strict=True)
    if not recorded:
        return [fn(*chunk) for chunk in chunks]
    return [checkpoint(fn, *chunk, use_reentrant=False) for chunk in chunks]


def chunked_readout(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    sampling: Sampling,
    entropy: bool = False,
    softcap: float | None = None,
    chunk_tokens: int | None = None,
    entropy_grad: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` and entropies under ``sampling`` of the logits ``softcap(head(hidden) * scale)``,
    chunk by chunk.

    Equal to ``sampled_logprobs(head(hidden), labels, sampling)`` (and ``entropy_from_logits(processed_logits(
    ...))``) up to the rounding of a matrix product of another shape, in values and in the gradients with
    respect to ``hidden`` and ``head``'s parameters; never more than one chunk's (chunk_tokens, V) logits exist.

    Args:
        head: the output projection (hidden -> V logits), e.g. ``model.get_output_embeddings()``.
        hidden: (B, T, H) the last hidden states, position t predicting ``labels[:, t]``.
        labels: (B, T) token ids (a negative id gives a meaningless value there: mask it).
        sampling: temperature, suppressed ids, top-k / top-p (:mod:`rlhfkit.models.sampling`).
        entropy: also return the entropies.
        softcap: a final soft-capping ``cap * tanh(logits / cap)`` (Gemma 2/3), or None.
        chunk_tokens: positions per chunk (default :func:`chunk_size` of the vocabulary).
        entropy_grad: False when no loss uses the entropies (a metric): the same values, without a graph.
        scale: a constant final scale of the logits, applied before the soft-capping (:class:`HeadTransform`).
    Returns:
        (logprobs (B, T) float32, entropy (B, T) float32 or None).
    """
    batch, steps, width = hidden.shape
    if labels.shape != (batch, steps):
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match")
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    size = chunk_size(vocab, chunk_tokens)
    flat_labels = labels.reshape(-1).long().clamp(min=0)
    transform = HeadTransform(float(scale), softcap)
    recorded = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    read = functools.partial(_chunk_readout, head, transform, sampling, entropy, entropy_grad)
    parts = checkpointed_chunks(read, (hidden.reshape(-1, width), flat_labels), size, recorded)
    logprobs = torch.cat([p[0] for p in parts]).view(batch, steps)
    return logprobs, (torch.cat([p[1] for p in parts]).view(batch, steps) if entropy else None)


def response_readout(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    sampling: Sampling | None = None,
    entropy: bool = False,
    router_aux: bool = False,
    chunk_tokens: int | None = None,
    labels: torch.Tensor | None = None,
    share_prompts: bool = False,
    entropy_grad: bool = True,
) -> Readout:
    """Log-probs (and entropies) of the response tokens of a causal LM, without (B, R, V) logits when the model
    is :func:`chunkable` (else the plain path of :func:`rlhfkit.models.readout.response_forward`).

    The whole (possibly DDP-wrapped) model is called, so a wrapper sees its forward; position ids come from the
    attention mask; the state before response token t is column ``response_start + t - 1``.

    Args:
        input_ids, attention_mask: (B, L) = left-padded prompts then right-padded responses.
        response_start: p0 (>= 1), the column of the first response token.
        sampling: the sampler's processing (None: the plain softmax).
        entropy: also the entropies; router_aux: also a mixture of experts' router loss.
        chunk_tokens: positions per chunk (default :func:`chunk_size`).
        labels: (B, R) the tokens to score (default: the response tokens ``input_ids[:, response_start:]``;
            an SFT batch's labels differ from them only where they are -100, masked).
        share_prompts: rows whose prompt columns ``[0, response_start)`` are the same (a GRPO group) run them
            once (:mod:`rlhfkit.models.prompt_cache`), where :func:`can_share_prompts` allows; equal to the
            plain forward up to float rounding.
        entropy_grad: False when no loss uses the entropies (the update's entropy metric with no entropy
            bonus): the same values, without a graph or a backward recompute.
    Returns:
        a :class:`Readout`; ``logprobs[:, t]`` and ``entropy[:, t]`` are read at column p0 + t - 1.
    """
    sampling = sampling or Sampling()
    length = input_ids.shape[1]
    if not 1 <= response_start <= length:
        raise ValueError(f"response_start must be in [1, {length}], got {response_start}")
    labels = (input_ids[:, response_start:] if labels is None else labels).long().clamp(min=0)  # (B, R)
    transform = head_transform(model)
    if transform is None:
        logits, aux = response_forward(model, input_ids, attention_mask, response_start, router_aux)
        ent = _entropy(logits, sampling, labels, entropy_grad) if entropy else None
        return Readout(sampled_logprobs(logits, labels, sampling), ent, aux)
    cache = None
    if share_prompts and response_start >= 2 and not router_aux and can_share_prompts(model):
        cache = shared_prompt_cache(model, input_ids[:, :response_start], attention_mask[:, :response_start])
    first = 0 if cache is None else response_start - 1  # the columns this forward runs: [first, L)
    kwargs = {"output_router_logits": True} if router_aux else {}
    kwargs |= {"use_cache": False} if cache is None else {"use_cache": True, cache_keyword(model): cache}
    hidden, out = response_hidden(model, input_ids, attention_mask, response_start, first, **kwargs)
    with head_autocast(model):  # the projection under the model's own autocast, as in its forward
        logprobs, ent = chunked_readout(
            hf_model(model).get_output_embeddings(),
            hidden,
            labels,
            sampling,
            entropy,
            transform.softcap,
            chunk_tokens,
            entropy_grad,
            transform.scale,
        )
    return Readout(logprobs, ent, out.aux_loss if router_aux else None)


def response_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    first: int = 0,
    **kwargs,
):
    """The last hidden states that predict the response tokens, from one forward of the whole (possibly
    wrapped) model with ``logits_to_keep=1`` (a :func:`chunkable` model).

    Args:
        input_ids, attention_mask: (B, L); response_start: p0 (>= 1).
        first: the first column the forward runs (> 0 with a prompt cache in ``kwargs``).
        kwargs: more keyword arguments of the forward (``use_cache``, a cache, ``output_router_logits``).
    Returns:
        (hidden (B, R, H), read at columns p0 - 1 .. L - 2; the model's output).
    """
    lm, length, captured = hf_model(model), input_ids.shape[1], []
    hook = lm.get_decoder().register_forward_hook(_keep_hidden(captured))
    try:
        out = model(
            input_ids=input_ids[:, first:],
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask)[:, first:],
            logits_to_keep=1,
            **kwargs,
        )
    finally:
        hook.remove()
    if len(captured) != 1 or captured[0].shape[:2] != (input_ids.shape[0], length - first):
        raise RuntimeError(f"{type(lm).__name__}'s decoder did not run once over every position")
    return captured[0][:, response_start - 1 - first : length - 1 - first], out  # (B, R, H)


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    sampling: Sampling | None = None,
) -> torch.Tensor:
    """Log-probabilities of the response tokens under the distribution they were sampled from, without (B, R, V)
    logits where the model allows it (:func:`response_readout`).

    Args:
        input_ids, attention_mask: (B, L) = prompts (left padded) then responses (right padded).
        response_start: p0, the column of the first response token.
        sampling: the sampler (temperature, suppressed ids, truncation: :func:`sampled_logprobs`); None =
            the plain softmax of the logits.
    Returns:
        (B, R) float32; ``[:, t]`` is log pi(y_t | x, y_<t) read at column p0 + t - 1.
    """
    return response_readout(model, input_ids, attention_mask, response_start, sampling).logprobs
