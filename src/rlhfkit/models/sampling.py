"""The distribution responses are sampled from, which is also the one their log-probs are scored under.

PPO's ratio and KL are only right if the log-probs recomputed for the update are those of the distribution
``generate`` sampled from (OpenRLHF PR #853, huggingface/trl#3169). A :class:`Sampling` names every change
made to the model's logits, and both sides apply it the same way:

- ``generate`` gets a blank generation configuration plus exactly these settings
  (:func:`generation_kwargs`): whatever a checkpoint's ``generation_config.json`` carries
  (``repetition_penalty``, ``no_repeat_ngram_size``, ``min_p``, ``typical_p``, ``bad_words_ids``, a default
  ``top_k=50``, ...) is neutralised, since rlhfkit does not score under those processors;
- scoring (:func:`rlhfkit.models.sampled_logprobs`, :func:`processed_logits`) applies, in the order
  ``generate`` does: suppressed ids (the pad token unless it is a stop token) set to -inf, division by the
  temperature, top-k, then top-p, with the rules of transformers' ``TopKLogitsWarper`` and
  ``TopPLogitsWarper``.

Top-k / top-p: the log-probs are those of the *truncated, renormalised* distribution, the one actually
sampled, so the ratio is exactly 1 before an update and the KL is between the two samplers. The truncation
set is recomputed from each model's own logits (the actor's old and new, the reference's); the scored token
is always kept in it, so a log-prob is never -inf (a token the new policy would no longer sample gets its
probability within the new set plus itself).

Shapes: ``B`` rows, ``T`` positions, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Rows of (rows, T, V) processed at a time when building a truncation mask (bounds the sort's memory).
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Sampling:
    """The logits processing of sampling, applied again when scoring (module docstring).

    Attributes:
        temperature: > 0.
        top_k: keep the k most likely tokens; 0 = off.
        top_p: keep the smallest set of most likely tokens with probability >= top_p; 1 = off.
        suppress_ids: ids never sampled (probability 0).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    suppress_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got {self.top_k}, {self.top_p}")

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p removes tokens."""
        return self.top_k > 0 or self.top_p < 1.0


def untruncated(sampling: Sampling) -> Sampling:
    """``sampling`` without top-k / top-p: the temperature and the suppressed ids only. How a distillation
    teacher reads the student's tokens: truncated by its own top-k, a token the student may sample could have
    probability 0 under the teacher, an infinite KL term."""
    return dataclasses.replace(sampling, top_k=0, top_p=1.0)


def sampling_for(
    pad_token_id: int | None,
    stop_token_ids: Sequence[int],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    suppress_ids: Sequence[int] = (),
) -> Sampling:
    """The :class:`Sampling` of a tokenizer's responses: the pad token is suppressed unless it is a stop token
    (a pad distinct from EOS is not text; an added ``<|pad|>`` row is untrained)."""
    pad = [] if pad_token_id is None or pad_token_id in stop_token_ids else [pad_token_id]
    ids = tuple(dict.fromkeys(int(i) for i in [*suppress_ids, *pad]))
    return Sampling(float(temperature), int(top_k), float(top_p), ids)


def generation_kwargs(sampling: Sampling, greedy: bool = False) -> dict:
    """``generate`` keyword arguments for exactly this processing (call ``generate`` inside
    :func:`without_checkpoint_defaults`, so that nothing of the checkpoint's is added). ``top_k`` is always
    given: unset, transformers' own default of 50 would apply."""
    kwargs: dict = {"do_sample": not greedy, "top_k": 0, "top_p": 1.0, "temperature": 1.0}
    if not greedy:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    if sampling.suppress_ids:
        from transformers import LogitsProcessorList

        kwargs["logits_processor"] = LogitsProcessorList([_suppress_in_place(sampling.suppress_ids)])
    return kwargs


def _suppress_in_place(ids: Sequence[int]):
    """A logits processor that sets ``ids`` to -inf in the scores it is given: the values of transformers'
    ``SuppressTokensLogitsProcessor`` (``torch.where`` over a vocabulary mask) without a new (B, V) tensor per
    step. ``generate`` hands the processors its own float32 copy of the step's logits and runs the ones it is
    given before its temperature / top-k / top-p warpers, the order :func:`processed_logits` scores in."""
    from transformers import LogitsProcessor

    class SuppressInPlace(LogitsProcessor):
        def __init__(self, ids: Sequence[int]):
            self.ids = list(ids)
            self._index: torch.Tensor | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self._index is None or self._index.device != scores.device:
                self._index = torch.as_tensor(self.ids, dtype=torch.long, device=scores.device)
            return scores.index_fill_(-1, self._index, float("-inf"))

    return SuppressInPlace(ids)


_FORWARDED = object()  # a model that holds no generation_config of its own (it reads its inner model's)


@contextlib.contextmanager
def without_checkpoint_defaults(model: torch.nn.Module):
    """Within this block the model's ``generation_config`` (its checkpoint's ``generation_config.json``) is
    blank: ``generate`` fills every field it is not given from that object, so each processor the checkpoint
    sets (repetition penalty, n-gram blocking, min-p, bad words, forced tokens, ...) would otherwise apply.

    Blanked and put back on every level that holds one: the model given and the models inside it (a wrapper's
    ``module``, a peft model's base model), because peft's ``generate`` copies the wrapper's config onto the
    base model, where the saved ``final/`` would then find a blank one (no EOS: plain ``generate`` on it
    ran past the end of turn)."""
    from transformers import GenerationConfig

    levels = [m for m in _model_levels(model) if getattr(m, "generation_config", None) is not None]
    own = [(m, m.__dict__.get("generation_config", _FORWARDED)) for m in levels]  # a peft wrapper forwards it
    blank = GenerationConfig()
    try:
        for m in levels:
            m.generation_config = blank
        yield model
    finally:
        for m, config in own:
            if config is _FORWARDED:
                m.__dict__.pop("generation_config", None)
            else:
                m.generation_config = config


def _model_levels(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model`` and the models it wraps (``module``, ``_orig_mod``, peft's ``base_model`` and its ``model``),
    outermost first, each once."""
    levels, todo = [], [model]
    while todo:
        current = todo.pop()
        if any(current is m for m in levels):
            continue
        levels.append(current)
        for name in ("module", "_orig_mod", "base_model", "model"):
            inner = current.__dict__.get("_modules", {}).get(name) or current.__dict__.get(name)
            if isinstance(inner, torch.nn.Module) and inner is not current:
                todo.append(inner)
    return levels


def _keep_mask_block(scaled: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Top-k then top-p on processed logits ``(rows, T, V)``: True where a token may be sampled."""
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if sampling.top_k > 0:
        k = min(sampling.top_k, scaled.shape[-1])
        kth = torch.topk(scaled, k, dim=-1).values[..., -1:]  # (rows, T, 1)
        keep &= scaled >= kth
        scaled = scaled.masked_fill(~keep, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scaled, dim=-1, descending=False)
        remove = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p  # (rows, T, V), ascending order
        remove[..., -1:] = False  # the most likely token always stays
        keep &= ~remove.scatter(-1, order, remove)
    return keep


def _scaled(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """float32 ``logits / temperature`` with the suppressed ids at -inf (a new tensor, differentiable)."""
    scaled = logits.float() / sampling.temperature
    if sampling.suppress_ids:
        suppress = torch.zeros(scaled.shape[-1], dtype=torch.bool, device=scaled.device)
        suppress[list(sampling.suppress_ids)] = True
        scaled = scaled.masked_fill(suppress, float("-inf"))
    return scaled


@torch.no_grad()
def truncation_mask(logits: torch.Tensor, labels: torch.Tensor, sampling: Sampling) -> torch.Tensor | None:
    """Which tokens top-k / top-p leave in the distribution, with each position's label always kept.

    Args:
        logits: (B, T, V) raw logits.
        labels: (B, T) the scored tokens.
    Returns:
        (B, T, V) bool, or None when ``sampling`` does not truncate.
    """
    if not sampling.truncates:
        return None
    batch, steps, vocab = logits.shape
    rows = max(1, _CHUNK_ELEMENTS // max(1, steps * vocab))
    keep = torch.empty(logits.shape, dtype=torch.bool, device=logits.device)
    for start in range(0, batch, rows):
        keep[start : start + rows] = _keep_mask_block(
            _scaled(logits[start : start + rows], sampling), sampling
        )
    keep.scatter_(-1, labels.long().clamp(min=0).unsqueeze(-1), True)
    return keep


def processed_logits(
    logits: torch.Tensor, sampling: Sampling, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """The logits of the sampling distribution: suppressed ids and truncated tokens at -inf, divided by the
    temperature (a float32 copy; for the entropy, whose ``entropy_from_logits`` treats -inf as probability 0).

    Args:
        logits: (B, T, V).
        labels: (B, T), kept in the truncation set when given.
    Returns:
        (B, T, V) float32, differentiable with respect to ``logits``.
    """
    scaled = _scaled(logits, sampling)
    if sampling.truncates:
        labels = labels if labels is not None else scaled.argmax(-1)
        scaled = scaled.masked_fill(~truncation_mask(logits, labels, sampling), float("-inf"))
    return scaled
