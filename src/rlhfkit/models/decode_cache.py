"""A key / value cache that does not copy itself at every decoding step.

transformers' ``DynamicLayer`` grows by ``torch.cat([keys, new], dim=-2)``: each of ``generate``'s steps copies
every layer's whole cache to add one column, so decoding R tokens copies O(R * L) cache entries per layer. On a
135M Llama generating 32 x 48 tokens on a CPU those copies were a fifth of the generation time. Here a layer
writes its new columns into storage reserved for the whole call (prompt + ``max_new_tokens``) and hands the
attention a view of the filled part: the same values, the same shapes, no copy. The tokens are the plain
cache's bit for bit (the tests compare them).

A model whose half-precision attention runs in float32 on a CPU
(:func:`rlhfkit.models.precision.float32_attention_on_cpu`) upcasts the whole cache at every step of every layer
(``key.float()``: at 32 rows x 512 positions, ~220M values a step on SmolLM2). With ``upcast`` the reserved
storage is float32: each new column is upcast once as it is written (an exact conversion), and the attention's
upcast of the cache is a no-op. The attention reads the same values, so the tokens are the same; the cache takes
twice the memory of a bf16 one.
:mod:`rlhfkit.rollout.generation` asks for it only where :mod:`rlhfkit.models.decode_attention`'s kernel is
not built: that kernel reads bf16 values itself.

Only plain ``DynamicLayer`` layers are reserved; sliding-window, static, quantised or recurrent layers keep their
own update. A layer whose tensors were replaced from outside (``crop``, ``batch_select_indices``,
``reorder_cache``) or that receives another dtype falls back to a fresh reservation or to the plain update.

Shapes: ``B`` rows, ``H`` key / value heads, ``L`` cached positions, ``D`` head size.
"""

from __future__ import annotations

import functools

import torch

from rlhfkit.models.readout import hf_model


@functools.cache
def _reserved_class():
    """``ReservedLayer``, built on first use (transformers is imported only when a model is)."""
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """A ``DynamicLayer`` whose update writes into reserved storage (module docstring)."""

        capacity: int = 0
        upcast: bool = False  # half-precision columns stored in float32 (module docstring)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            length = self.get_seq_length()
            store = getattr(self, "_store", None)
            views = getattr(self, "_views", (None, None))
            outside = length and (self.keys is not views[0] or self.values is not views[1])
            # the dtype the columns so far came in: this layer's own updates', or the tensors set from outside
            came = (self.keys.dtype, self.values.dtype) if outside or store is None else self._came
            if length and (key_states.dtype, value_states.dtype) != came:
                self._store = None  # another dtype: the plain concatenation (and its type promotion)
                return super().update(key_states, value_states, *args, **kwargs)
            self._came = (key_states.dtype, value_states.dtype)
            end = length + key_states.shape[-2]
            if store is None or store[0].shape[-2] < end or outside:
                capacity = max(end, self.capacity)
                keys = key_states.new_empty(
                    (*key_states.shape[:-2], capacity, key_states.shape[-1]), dtype=self._stored(key_states)
                )
                values = value_states.new_empty(
                    (*value_states.shape[:-2], capacity, value_states.shape[-1]),
                    dtype=self._stored(value_states),
                )
                if length:
                    keys[..., :length, :] = self.keys
                    values[..., :length, :] = self.values
                store = self._store = (keys, values)
            keys, values = store
            keys[..., length:end, :] = key_states
            values[..., length:end, :] = value_states
            self.keys, self.values = keys[..., :end, :], values[..., :end, :]
            self._views = (
                self.keys,
                self.values,
            )  # what this update handed out: anything else came from outside
            return self.keys, self.values

        def _stored(self, states):
            half = states.dtype in (torch.bfloat16, torch.float16)
            return torch.float32 if self.upcast and half else states.dtype

    return ReservedLayer


def reserve_positions(cache, capacity: int, upcast: bool = False) -> int:
    """Make every plain dynamic layer of ``cache`` write into storage of ``capacity`` positions.

    Args:
        cache: a transformers ``Cache`` with ``layers`` (a ``DynamicCache``); anything else is left alone.
        capacity: the positions the call will hold (prompt columns + ``max_new_tokens``); a layer that needs
            more grows once more.
        upcast: store half-precision keys and values in float32, for an attention that computes in float32
            (module docstring).
    Returns:
        the number of layers reserved.
    """
    reserved = _reserved_class()
    count = 0
    for layer in getattr(cache, "layers", None) or []:
        if type(layer) in (reserved, reserved.__base__):
            layer.__class__ = reserved
            layer.capacity, layer.upcast = int(capacity), bool(upcast)
            count += 1
    return count


def fresh_cache(model: torch.nn.Module):
    """The empty ``DynamicCache`` that ``generate`` would make for ``model``, or None where it would make none
    (models that need another cache: ``generate`` then builds its own)."""
    from transformers import DynamicCache

    base = hf_model(model)
    supports = getattr(base, "_supports_default_dynamic_cache", None)
    config = getattr(base, "config", None)
    if supports is None or config is None or not supports() or getattr(config, "is_encoder_decoder", False):
        return None
    return DynamicCache(config=config.get_text_config(decoder=True))
