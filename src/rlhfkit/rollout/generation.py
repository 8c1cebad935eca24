"""Sampling responses with Hugging Face ``generate`` and cutting them at the stop token.

The response mask is computed from the position of the first stop token, never by comparing ids with
the pad id, so EOS stays inside the mask when the tokenizer's pad token equals EOS
(huggingface/trl#1623, pytorch/torchtune#949); everything after the first stop token is outside the
mask and overwritten with the pad id. A response that reaches the length limit without a stop token is
marked ``ended = False`` (the trainer decides its fate: the N+ "EOS trick" or masking).

Sampling = scoring: ``generate`` runs with nothing from the checkpoint's ``generation_config.json``
(:mod:`rlhfkit.models.sampling`), and each token is drawn by :class:`InverseCdfSampler` from the distribution
of :func:`rlhfkit.models.processed_logits` (temperature, top-k, top-p, suppressed ids): the function the
trainer recomputes the log-probs with (:func:`rlhfkit.models.sampled_logprobs`). Only the token ids are taken
from here; ``return_logprobs`` also gives the log-probs the tokens were sampled with, to check that they are
the recomputed ones.

Why not ``generate``'s own sampler: ``torch.multinomial`` draws one exponential number per vocabulary entry
and row at every step (the "exponential race"), 1.6M numbers for 32 rows of a 49k vocabulary, which took 29 ms
a step on this 2-core CPU (a fifth of a SmolLM2-135M decoding step, measured with torch.profiler). Inverse-CDF
sampling draws one uniform number per row and finds it in the cumulative sum: the same distribution, a
different stream of tokens for a seed.

Shapes: ``B`` prompts, ``P`` padded prompt length, ``R`` response length (``max_new_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfkit.models.lora import merged_for_generation
from rlhfkit.models.precision import autocast_region, frozen_linears_cast
from rlhfkit.models.prompt_cache import cache_keyword, shared_prompt_cache
from rlhfkit.models.sampling import Sampling, generation_kwargs, processed_logits, without_checkpoint_defaults


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


def truncate_at_stop(
    response_ids: torch.Tensor, stop_token_ids: list[int] | tuple[int, ...], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each response after its first stop token.

    Args:
        response_ids: (B, R) generated ids (whatever follows a stop token is ignored).
        stop_token_ids: the ids that end a response (EOS, or a configured stop token).
        pad_token_id: written after the first stop token.
    Returns:
        (response_ids (B, R) with pads after the stop, mask (B, R) bool including the stop token,
        ended (B,) bool).
    """
    if len(stop_token_ids) == 0:
        raise ValueError("stop_token_ids is empty")
    is_stop = torch.isin(
        response_ids, torch.as_tensor(list(stop_token_ids), device=response_ids.device)
    )  # (B, R)
    ended = is_stop.any(dim=1)  # (B,)
    # Number of stop tokens strictly before column t; a column is kept while none came before it.
    stops_before = torch.cumsum(is_stop.int(), dim=1) - is_stop.int()  # (B, R)
    mask = stops_before == 0
    return response_ids.masked_fill(~mask, pad_token_id), mask, ended


SAMPLE_BLOCK = 1024  # entries per block of the two-level draw (inverse_cdf_sample)


def _draw_flat(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(B, 1) index per row of ``weights`` (B, n), drawn in proportion: a uniform number per row located in the
    row's float64 cumulative sum; the search finds the first boundary strictly above the number, so an entry of
    weight 0 (an empty interval) is never drawn."""
    cdf = weights.to(torch.float64).cumsum(-1)  # (B, n)
    u = torch.rand((weights.shape[0], 1), dtype=torch.float64, device=weights.device, generator=generator)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # u < 1, so below n
    return index.clamp_(max=weights.shape[-1] - 1)


def inverse_cdf_sample(
    probs: torch.Tensor, generator: torch.Generator | None = None, block: int = SAMPLE_BLOCK
) -> torch.Tensor:
    """One index per row of ``probs`` (B, V), row ``b`` drawn with probability ``probs[b] / probs[b].sum()``.

    Two levels of inverse-CDF sampling: a block of ``block`` consecutive entries in proportion to its sum, then
    an entry of that block in proportion to its probability, so P(entry) = P(block) P(entry | block), exactly
    the asked-for probability; the cumulative sums in float64. Two uniform numbers per row, and the only
    full pass over the vocabulary is the block sums (a cumulative sum of 49k values per row, a sequential scan,
    cost 12 ms a decoding step of 32 rows on this CPU). An entry of probability 0, and a block of sum 0, is
    never drawn (:func:`_draw_flat`). Returns (B,) long."""
    rows, vocab = probs.shape
    full = vocab // block
    if full < 2:
        return _draw_flat(probs, generator).squeeze(-1)
    # block sums in the probabilities' dtype (a float64 sum of float32 values converts them all first: 15 ms
    # a step here), then float64 for the cumulative sums
    sums = probs[:, : full * block].unflatten(1, (full, block)).sum(-1)  # (B, full)
    if vocab > full * block:  # the shorter last block
        sums = torch.cat([sums, probs[:, full * block :].sum(-1, keepdim=True)], dim=1)
    start = _draw_flat(sums, generator) * block  # (B, 1) first column of the drawn block
    columns = start + torch.arange(block, device=probs.device)  # (B, block)
    inside = columns < vocab
    within = probs.gather(1, columns.clamp(max=vocab - 1)) * inside  # (B, block), 0 past the vocabulary
    return (start + _draw_flat(within, generator)).squeeze(-1)


class InverseCdfSampler:
    """A logits processor that samples the next token itself (module docstring). ``generate`` runs greedy with
    this processor last: it returns 0 at the drawn token and -inf elsewhere, so the argmax is the draw.

    The draw comes from the distribution of ``processed_logits(scores, sampling)``, the one the trainer scores
    under, and the global torch generator (seeded by the run). ``logprobs`` collects each step's (B,) log-prob
    of the drawn token under that distribution. Without top-k / top-p, the temperature and the suppressed ids
    are applied in place to ``generate``'s own float32 copy of the step's logits (the same values as
    :func:`processed_logits`, without its copies); the softmax is computed in place too, and only the drawn
    token's log-prob is taken from it (log of its probability, which is not 0: it was drawn)."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sampling = self.sampling
        with torch.autocast(scores.device.type, enabled=False):
            if sampling.truncates or scores.dtype != torch.float32:
                logits = processed_logits(scores[:, None, :], sampling)[:, 0]  # (B, V) float32, a new tensor
            else:  # generate's float32 copy of the step's logits, ours to change
                logits = scores if sampling.temperature == 1.0 else scores.div_(sampling.temperature)
                if sampling.suppress_ids:
                    logits[:, list(sampling.suppress_ids)] = float("-inf")
            probs = logits.sub_(logits.amax(-1, keepdim=True)).exp_()  # (B, V) unnormalised, in place
            token = inverse_cdf_sample(probs)[:, None]  # (B, 1)
            log_total = probs.sum(-1, keepdim=True).log_()
            self.logprobs.append((probs.gather(-1, token).log() - log_total).squeeze(-1))
        return probs.fill_(float("-inf")).scatter_(-1, token, 0.0)  # no new (B, V) tensor in this call


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
    Returns:
        :class:`Responses` with exactly R response columns.
    """
    if prompt_mask.shape != prompt_ids.shape:
        raise ValueError("prompt_ids and prompt_mask shapes differ")
    if bool((prompt_mask[:, -1] == 0).any()):
        raise ValueError("prompts must be left padded (the last column of every row is a real token)")
    was_training = model.training
    model.eval()
    sampler = None if greedy else InverseCdfSampler(sampling)
    try:
        kwargs = dict(
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            pad_token_id=pad_token_id,
            eos_token_id=list(stop_token_ids),
            use_cache=True,
            output_scores=return_logprobs and greedy,
            return_dict_in_generate=True,
            **generation_kwargs(sampling, greedy=True),  # the argmax of the sampler's draw when sampling
        )
        if sampler is not None:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([sampler])
            kwargs.pop("suppress_tokens", None)  # the sampler's distribution suppresses them
        with (
            without_checkpoint_defaults(model),
            autocast_region(model),
            frozen_linears_cast(model),
            merged_for_generation(model),
        ):
            cache = shared_prompt_cache(model, prompt_ids, prompt_mask) if share_prompts else None
            if cache is not None:
                kwargs[cache_keyword(model)] = cache
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
        if sampler is not None:
            picked = torch.stack(sampler.logprobs, dim=1)  # (B, r)
        else:
            scores = torch.stack(out.scores, dim=1).float()  # (B, r, V), processed as sampled
            picked = (
                torch.log_softmax(scores, -1).gather(-1, generated[:, : scores.shape[1], None]).squeeze(-1)
            )
        sampled = torch.zeros(response_ids.shape, device=picked.device)
        sampled[:, : picked.shape[1]] = torch.where(mask[:, : picked.shape[1]], picked, 0.0)
    return Responses(input_ids, attention_mask, response_ids, mask, ended, start, sampled)
