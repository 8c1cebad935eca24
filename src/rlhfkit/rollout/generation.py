"""Sampling responses with Hugging Face ``generate`` and cutting them at the stop token.

The response mask is computed from the position of the first stop token, never by comparing ids with
the pad id, so EOS stays inside the mask when the tokenizer's pad token equals EOS
(huggingface/trl#1623, pytorch/torchtune#949); everything after the first stop token is outside the
mask and overwritten with the pad id. A response that reaches the length limit without a stop token is
marked ``ended = False`` (the trainer decides its fate: the N+ "EOS trick" or masking).

Sampling = scoring: ``generate`` runs with exactly the processing of a :class:`rlhfkit.models.Sampling`
(temperature, top-k, top-p, suppressed ids) and nothing from the checkpoint's ``generation_config.json``
(:mod:`rlhfkit.models.sampling`); the draw is rlhfkit's own on per-row random streams (``online.sampler:
exact``) or ``generate``'s ``torch.multinomial`` (``multinomial``): :mod:`rlhfkit.models.sampler`. The trainer recomputes the log-probs under the same processing
(:func:`rlhfkit.models.sampled_logprobs`). Only the token ids are taken from here; ``return_logprobs``
also gives the log-probs ``generate`` sampled with, to check that they are the recomputed ones.

Per step, nothing of size cache or (B, vocabulary) is copied that the result does not need: the key / value
cache writes into storage reserved for prompt + ``max_new_tokens`` (:mod:`rlhfkit.models.decode_cache`), the
suppressed ids are set to -inf in place, and no ``min_new_tokens`` processor is added (it clones the scores at
every step even when its minimum is 0). Under ``multinomial`` the tokens are those of ``generate``'s defaults bit
for bit.

Shapes: ``B`` prompts, ``P`` padded prompt length, ``R`` response length (``max_new_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfkit.models import decode_attention
from rlhfkit.models.decode_cache import fresh_cache, reserve_positions
from rlhfkit.models.lora import merged_for_generation
from rlhfkit.models.packed_linear import packed_linears
from rlhfkit.models.precision import attention_in_float32, autocast_region, frozen_linears_cast
from rlhfkit.models.prompt_cache import cache_keyword, shared_prompt_cache
from rlhfkit.models.sampler import SAMPLERS, ExactDraw, RowStreams, sampler_of
from rlhfkit.models.sampling import Sampling, generation_kwargs, without_checkpoint_defaults
from rlhfkit.models.static_decode import DECODES, decode_kwargs, decode_of, static_cache


@dataclass
class Responses:
    """Sampled responses, right padded to a fixed length.

    Attributes:
        input_ids: (B, P + R) left-padded prompt followed by the response; the response starts at column P.
        attention_mask: (B, P + R) 1 on real prompt tokens and on response tokens inside ``mask``.
        response_ids: (B, R) the response tokens, pad id after the first stop token.
        mask: (B, R) bool, True up to and including the first stop token.
        ended: (B,) bool, True where the response contains a stop token.
        response_start: P, the column of the first response token.
        sampled_logprobs: (B, R) float32 log-probs of the sampled tokens under ``generate``'s processed scores
            (0 after the stop token), only with ``return_logprobs=True``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_ids: torch.Tensor
    mask: torch.Tensor
    ended: torch.Tensor
    response_start: int
    sampled_logprobs: torch.Tensor | None = None


def decode_responses(tokenizer, response_ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """The text of each row's response: ``response_ids`` (B, R) up to ``mask`` (B, R) bool, special tokens
    (the stop token, pads) left out."""
    rows = [row[m].tolist() for row, m in zip(response_ids, mask, strict=True)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def truncate_at_stop(
    response_ids: torch.Tensor,
    stop_token_ids: list[int] | tuple[int, ...],
    pad_token_id: int,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each response after its first stop token.

    Args:
        response_ids: (B, R) generated ids (whatever follows a stop token is ignored).
        stop_token_ids: the ids that end a response (EOS, or a configured stop token).
        pad_token_id: written after the first stop token.
        lengths: (B,) how many tokens of each row were generated (None: all R). The columns from a row's
            length on are filler, not tokens: never a stop token, never inside the mask. An engine that stops
            a request at its own length cap returns fewer than R tokens and no stop token; the filler must
            neither be trained nor, when pad == EOS, end the row (docs/known-bugs.md).
    Returns:
        (response_ids (B, R) with pads after the stop, mask (B, R) bool including the stop token,
        ended (B,) bool: a stop token was generated).
    """
    if len(stop_token_ids) == 0:
        raise ValueError("stop_token_ids is empty")
    is_stop = torch.isin(
        response_ids, torch.as_tensor(list(stop_token_ids), device=response_ids.device)
    )  # (B, R)
    produced = torch.ones_like(is_stop)  # (B, R)
    if lengths is not None:
        columns = torch.arange(response_ids.shape[1], device=response_ids.device)
        produced = columns[None, :] < lengths.to(response_ids.device)[:, None]
        is_stop = is_stop & produced
    ended = is_stop.any(dim=1)  # (B,)
    # Number of stop tokens strictly before column t; a column is kept while none came before it.
    stops_before = torch.cumsum(is_stop.int(), dim=1) - is_stop.int()  # (B, R)
    mask = (stops_before == 0) & produced
    return response_ids.masked_fill(~mask, pad_token_id), mask, ended


@torch.no_grad()
def generate_responses(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_token_ids: list[int] | tuple[int, ...],
    pad_token_id: int,
    sampling: Sampling,
    greedy: bool = False,
    return_logprobs: bool = False,
    share_prompts: bool = True,
    decode: str | None = None,
    sampler: str | None = None,
    streams: RowStreams | None = None,
) -> Responses:
    """Sample one response per prompt row (repeat rows for groups) with ``model.generate``.

    Args:
        model: a causal LM (unwrapped); it is put in eval mode for generation and restored after.
        prompt_ids, prompt_mask: (B, P) LEFT-padded prompts (Huang et al. 2024: left padding for
            generation; ``generate`` builds position ids from the attention mask).
        max_new_tokens: R.
        stop_token_ids: ids that end a response.
        pad_token_id: filler after the stop token.
        sampling: the processing of the logits (build it with :func:`rlhfkit.models.sampling_for`, which
            suppresses the pad token unless it is a stop token); the checkpoint's own generation settings
            are not used.
        greedy: argmax decoding (of the suppressed logits) instead of sampling.
        return_logprobs: also return ``generate``'s log-probs of the sampled tokens.
        share_prompts: rows with the same prompt (a group's G responses) share one forward over it: the key /
            value cache of every prompt token but the last is computed once per distinct prompt and copied to
            its rows (:func:`shared_prompt_cache`), so a group's prompt is read once, not G times; the rest is
            ``generate``'s own. The same tokens up to the rounding of matrix products of other shapes.
        decode: ``dynamic`` (a cache that grows), ``static`` (one allocated for the whole call) or ``compiled``
            (static, the one-position forward compiled once per run): :mod:`rlhfkit.models.static_decode`. A
            model that cannot take a static cache decodes ``dynamic`` (the reason logged once). None: the
            model's own (:func:`rlhfkit.models.static_decode.set_decode`, ``online.hf_decode``), else dynamic.
        sampler: ``exact`` (rlhfkit's draw on per-row streams) or ``multinomial`` (``generate``'s
            ``torch.multinomial``): :mod:`rlhfkit.models.sampler`. None: the model's own
            (:func:`rlhfkit.models.sampler.set_sampler`, ``online.sampler``), else exact.
        streams: ``exact``: each row's random stream (its prompt index and sample index; the position is the
            token's in the row), so that a row's tokens depend on neither this call's other rows nor how a batch
            is split into calls. None:
            :meth:`RowStreams.of_rows` (one seed from torch's global generator, the row as prompt index).
    Returns:
        :class:`Responses` with exactly R response columns.
    """
    if prompt_mask.shape != prompt_ids.shape:
        raise ValueError("prompt_ids and prompt_mask shapes differ")
    if bool((prompt_mask[:, -1] == 0).any()):
        raise ValueError("prompts must be left padded (the last column of every row is a real token)")
    decode = decode or decode_of(model)
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {', '.join(DECODES)}, got {decode!r}")
    sampler = sampler or sampler_of(model)
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    draw = None
    if sampler == "exact" and not greedy:
        streams = (
            streams if streams is not None else RowStreams.of_rows(prompt_ids.shape[0], prompt_ids.device)
        )
        if streams.prompt_index.shape[0] != prompt_ids.shape[0]:
            raise ValueError(f"{prompt_ids.shape[0]} prompt rows but {streams.prompt_index.shape[0]} streams")
        draw = ExactDraw(sampling, streams, prompt_mask, keep_logprobs=return_logprobs)
    was_training = model.training
    model.eval()
    try:
        kwargs = dict(
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id,
            eos_token_id=list(stop_token_ids),
            use_cache=True,
            output_scores=return_logprobs and draw is None,
            return_dict_in_generate=True,
            **(generation_kwargs(sampling, greedy) if draw is None else {}),
        )
        if draw is not None:  # generate runs greedy over the drawn token (the processing is the draw's own)
            from transformers import LogitsProcessorList

            # no warper settings: the blank configuration's defaults, which greedy decoding does not warn about
            kwargs.update(do_sample=False, logits_processor=LogitsProcessorList([draw]))
        with (
            without_checkpoint_defaults(model),
            autocast_region(model),
            frozen_linears_cast(model),
            merged_for_generation(model),
            packed_linears(model, prompt_ids.shape[0]),  # after the merge: the weights the call samples with
        ):
            capacity = prompt_ids.shape[1] + max_new_tokens
            cache = shared_prompt_cache(model, prompt_ids, prompt_mask) if share_prompts else None
            held = static_cache(model, cache, capacity) if decode != "dynamic" else None
            if held is None and cache is None:
                cache = fresh_cache(model)
            if held is None and cache is not None:  # float32 storage for sdpa's float32 attention
                # (decode_cache), unless the decoding kernel reads the columns as written (decode_attention)
                upcast = attention_in_float32(model, prompt_ids.device) and not decode_attention.available()
                reserve_positions(cache, capacity, upcast=upcast)
            cache = held if held is not None else cache
            if cache is not None:
                kwargs[cache_keyword(model)] = cache
            kwargs.update(decode_kwargs(decode, cache))
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)
    finally:
        model.train(was_training)
    start = prompt_ids.shape[1]
    generated = out.sequences[:, start:]  # (B, r), r <= R
    if generated.shape[1] < max_new_tokens:  # every row stopped early: pad to the fixed length
        fill = generated.new_full((generated.shape[0], max_new_tokens - generated.shape[1]), pad_token_id)
        generated = torch.cat([generated, fill], dim=1)
    response_ids, mask, ended = truncate_at_stop(generated, stop_token_ids, pad_token_id)
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask.to(prompt_mask.dtype)], dim=1)
    sampled = None
    if return_logprobs:
        if draw is not None:
            picked = torch.stack(draw.logprobs, dim=1)  # (B, r): each drawn token's processed log-prob
        else:
            scores = torch.stack(out.scores, dim=1).float()  # (B, r, V), processed as sampled
            picked = (
                torch.log_softmax(scores, -1).gather(-1, generated[:, : scores.shape[1], None]).squeeze(-1)
            )
        sampled = torch.zeros(response_ids.shape, device=picked.device)
        sampled[:, : picked.shape[1]] = torch.where(mask[:, : picked.shape[1]], picked, 0.0)
    return Responses(input_ids, attention_mask, response_ids, mask, ended, start, sampled)
