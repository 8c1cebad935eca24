"""A group's prompt read once: the key / value cache of each distinct prompt, copied to the rows that share it.

GRPO and RLOO sample G responses per prompt, so a rollout holds every prompt G times. Every forward over
"prompt + response" (sampling, the old and reference log-probs, the update's forward and backward) would
compute the prompt's hidden states G times, identical each time: on a chat model whose template adds a system
prompt, the prompt is about half of a sequence's tokens. Here the prompt columns run once per distinct prompt
with the model's own key / value cache, the cache is copied to every row of the group
(``batch_select_indices``: an index, so under autograd its backward sums the G rows' gradients into the one
prompt pass), and the rest of each row runs on top of it. The result is the plain forward's up to float
rounding (the products have other shapes); the tests compare both on log-probs, entropies and gradients.

Used by ``generate`` (:mod:`rlhfkit.rollout.generation`) and by the read-out of a response's log-probs
(:func:`rlhfkit.models.head_chunks.response_readout` with ``share_prompts``). Rows share a prompt when their
real prompt tokens and padding are the same; nothing about groups is assumed.

Shapes: ``B`` rows, ``U`` distinct prompts, ``P`` padded prompt columns, ``L`` = P + response columns.
"""

from __future__ import annotations

import inspect

import torch

from rlhfkit.models.readout import hf_model, position_ids_from_mask


def _distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """(first row of each distinct prompt (U,), the distinct prompt of each row (B,)), or None when none repeats."""
    rows = prompt_ids.shape[0]
    key = torch.where(prompt_mask.bool(), prompt_ids, -1)  # (B, P): equal rows, equal prompts
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    if distinct.shape[0] == rows:
        return None
    first = torch.full((distinct.shape[0],), rows, dtype=torch.long, device=prompt_ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(rows, device=prompt_ids.device), reduce="amin")
    return first, inverse


def shared_prompt_cache(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """The key / value cache of columns ``[0, P - 1)`` of every row, computed once per distinct prompt.

    ``generate`` given this cache runs the last prompt column and the response only. Rows are the same prompt
    when their real tokens and padding are the same. Returns None (plain ``generate``) when no prompt repeats,
    the prompt is one column, or the model's cache cannot be copied by rows.

    Args:
        prompt_ids, prompt_mask: (B, P) left-padded prompts.
    Returns:
        a cache of B rows and P - 1 positions, or None.
    """
    if prompt_ids.shape[1] < 2:
        return None
    shared = _distinct_prompts(prompt_ids, prompt_mask)
    if shared is None:
        return None
    first, inverse = shared
    ids, mask = prompt_ids[first, :-1], prompt_mask[first, :-1]  # (U, P - 1)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=True,
        logits_to_keep=1,
    )
    cache = getattr(out, cache_keyword(model), None)
    if cache is None or not hasattr(cache, "batch_select_indices") or not _keys_and_values_only(cache):
        return None
    cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...): row b takes its prompt's entries
    return cache


def _keys_and_values_only(cache) -> bool:
    """Whether every layer of ``cache`` holds attention keys and values only (transformers' ``DynamicLayer`` and
    its sliding-window form), which a continuation of several columns extends. A hybrid model's recurrent
    layers (FalconH1's Mamba convolution and SSM states, ``LinearAttentionLayer``) hold a state that a
    multi-column continuation cannot start from: such a model runs each row's prompt itself."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)


def cache_keyword(model: torch.nn.Module) -> str:
    """The name of the key / value cache in the model's forward and outputs: ``cache`` from transformers 5.20
    on, ``past_key_values`` before (and for models that keep the old name)."""
    forward = hf_model(model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
