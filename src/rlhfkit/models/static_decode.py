"""Decoding over a key / value cache allocated once for the whole call, with the one-position forward compiled.

The hf backend's ``generate`` (:mod:`rlhfkit.rollout.generation`) decodes in one of three ways
(``online.hf_decode``):

- ``dynamic``: transformers' growing cache (written into reserved storage, :mod:`rlhfkit.models.decode_cache`);
  every step's attention reads exactly the positions filled so far;
- ``static``: transformers' ``StaticCache``, every layer's keys and values allocated for ``capacity`` positions
  at the start and written in place; every step's attention reads all ``capacity`` positions under a mask, so its
  shapes are the same at every step and in every call of the same rows and capacity;
- ``compiled``: ``static`` with the one-position forward compiled by ``torch.compile`` (inductor: C++ kernels on a
  CPU, Triton on a GPU). The compiled forward is kept on the model (transformers' ``get_compiled_call``) and reused
  by every later call, so it compiles once per run and per shape: the capacity is rounded up to a multiple of
  :data:`CAPACITY_STEP` positions, so prompts of other lengths in later rollouts take the same shapes.

The sampling (logits processing, the draw, the stop bookkeeping) is the same in all three: the same processors
and the same draw on the same rows (rlhfkit's exact draw on the rows' streams, or ``generate``'s
``torch.multinomial``: :mod:`rlhfkit.models.sampler`), so with equal logits the tokens and the random generator's
state after the call are equal. The logits differ from ``dynamic``'s only by the rounding of an
attention over more (masked, weight exactly 0) columns and, compiled, of fused kernels: on the tiny test models the
float32 log-probs agree to 5e-7 (bf16 autocast, compiled by inductor: 5e-4) and the sampled tokens are the same
(tests/rollout/test_static_decode.py; docs/performance.md). A token can differ only where two tokens' processed
logits are within that rounding of each other (an argmax tie, or a draw on the boundary between two tokens).

The compiled forward is compiled per (rows, capacity, dtype): torch's limit of graphs per function (8 by default)
covers a run's rollouts and evaluations; past it, torch runs the forward uncompiled and says so.

A model whose cache is not plain attention (sliding-window or recurrent layers) or that transformers cannot give a
static cache decodes ``dynamic``; :func:`static_cache` says why in one line, logged once per model class.

Shapes: ``B`` rows, ``H`` key / value heads, ``P`` prompt columns, ``D`` head size.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from rlhfkit.models.readout import hf_model

logger = logging.getLogger(__name__)

DECODES = ("dynamic", "static", "compiled")
DEFAULT_DECODE = "dynamic"  # online.hf_decode's default: measured fastest on a CPU (docs/performance.md)
_ATTRIBUTE = "rlhfkit_hf_decode"
CAPACITY_STEP = 64  # a static cache's positions are a multiple of this: few shapes, few compilations


def set_decode(model: torch.nn.Module, decode: str) -> torch.nn.Module:
    """Make ``decode`` the way every sampler decodes from ``model`` (rollouts, evaluation, refresh, episodes:
    :func:`rlhfkit.rollout.generate_responses` called without ``decode``). Returns ``model``."""
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {', '.join(DECODES)}, got {decode!r}")
    setattr(hf_model(model), _ATTRIBUTE, decode)
    return model


def decode_of(model: torch.nn.Module) -> str:
    """The decode :func:`set_decode` gave ``model``, else :data:`DEFAULT_DECODE`."""
    return getattr(hf_model(model), _ATTRIBUTE, DEFAULT_DECODE)


def bucketed_capacity(positions: int) -> int:
    """``positions`` rounded up to a multiple of :data:`CAPACITY_STEP`."""
    return CAPACITY_STEP * max(1, math.ceil(positions / CAPACITY_STEP))


def static_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot decode over a static cache, in one line, or None where it can."""
    base = hf_model(model)
    config = getattr(base, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return "not a decoder-only transformers model"
    supports = getattr(base, "_supports_default_dynamic_cache", None)
    if supports is None or not supports():
        return f"{type(base).__name__} keeps a cache of its own kind (recurrent or hybrid layers)"
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    try:
        probe = StaticCache(config=config.get_text_config(decoder=True), max_cache_len=CAPACITY_STEP)
    except (ValueError, TypeError, AttributeError) as err:  # a config transformers cannot size a cache from
        return f"transformers cannot build a static cache for {type(base).__name__} ({err})"
    kinds = {type(layer).__name__ for layer in probe.layers if type(layer) is not StaticLayer}
    if kinds:
        return (
            f"{type(base).__name__} has {', '.join(sorted(kinds))} cache layers (sliding window or recurrent)"
        )
    return None


@functools.cache
def _log_fallback_once(model_class: str, reason: str) -> None:
    logger.warning("hf_decode: %s decodes with the dynamic cache: %s", model_class, reason)


def static_cache(model: torch.nn.Module, prompt_cache, capacity: int):
    """An empty (or prompt-filled) ``StaticCache`` of :func:`bucketed_capacity` (``capacity``) positions for
    ``model``, or None (with the reason logged once) where the model cannot take one.

    Args:
        prompt_cache: None, or a ``DynamicCache`` of B rows holding the first prompt columns
            (:func:`rlhfkit.models.prompt_cache.shared_prompt_cache`): its keys and values are written into the
            static cache, which then continues from there.
        capacity: the positions the call holds (prompt columns + ``max_new_tokens``).
    """
    reason = static_unsupported(model)
    if reason is not None:
        _log_fallback_once(type(hf_model(model)).__name__, reason)
        return None
    from transformers import StaticCache

    config = hf_model(model).config.get_text_config(decoder=True)
    cache = StaticCache(config=config, max_cache_len=bucketed_capacity(capacity))
    if prompt_cache is not None:
        for layer, filled in zip(cache.layers, prompt_cache.layers, strict=True):
            layer.update(filled.keys, filled.values)  # (B, H, P - 1, D) into positions [0, P - 1)
    return cache


@functools.cache
def _compile_config():
    """One object for every call: transformers recompiles when the configuration differs from the last one."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    # transformers compiles on accelerators only unless told (on a CPU: inductor's C++ kernels)
    config._compile_all_devices = True
    return config


def decode_kwargs(decode: str, cache) -> dict:
    """``generate`` keyword arguments for ``decode`` given the cache it will get (None: transformers' own)."""
    if decode == "compiled" and cache is not None and type(cache).__name__ == "StaticCache":
        return {"compile_config": _compile_config()}
    return {"disable_compile": True}  # never transformers' own choice of compiling
