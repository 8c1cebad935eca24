"""Sampling responses with Hugging Face ``generate`` and cutting them at the stop token.

The response mask is computed from the position of the first stop token, never by comparing ids with
the pad id, so EOS stays inside the mask when the tokenizer's pad token equals EOS
(huggingface/trl#1623, pytorch/torchtune#949); everything after the first stop token is outside the
mask and overwritten with the pad id. A response that reaches the length limit without a stop token is
marked ``ended = False`` (the trainer decides its fate: the N+ "EOS trick" or masking).

The log-probabilities that ``generate`` returns come after top-k / top-p processing, so they are not the
policy's (huggingface/trl#2358): the trainer recomputes them at the sampling temperature
(:func:`rlhfkit.models.response_logprobs`). Only the token ids are taken from here.

Shapes: ``B`` prompts, ``P`` padded prompt length, ``R`` response length (``max_new_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_ids: torch.Tensor
    mask: torch.Tensor
    ended: torch.Tensor
    response_start: int


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
    is_stop = torch.isin(response_ids, torch.as_tensor(list(stop_token_ids), device=response_ids.device))  # (B, R)
    ended = is_stop.any(dim=1)  # (B,)
    # Number of stop tokens strictly before column t; a column is kept while none came before it.
    stops_before = torch.cumsum(is_stop.int(), dim=1) - is_stop.int()  # (B, R)
    mask = stops_before == 0
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
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    suppress_token_ids: list[int] | tuple[int, ...] = (),
) -> Responses:
    """Sample one response per prompt row (repeat rows for groups) with ``model.generate``.

    Args:
        model: a causal LM (unwrapped); it is put in eval mode for generation and restored after.
        prompt_ids, prompt_mask: (B, P) LEFT-padded prompts (Huang et al. 2024: left padding for
            generation; ``generate`` builds position ids from the attention mask).
        max_new_tokens: R.
        stop_token_ids: ids that end a response.
        pad_token_id: filler after the stop token.
        temperature, top_p, top_k: sampling settings (top_p = 1 and top_k = 0 are off).
        greedy: argmax decoding instead of sampling.
        suppress_token_ids: further ids never to sample. The pad token is always suppressed unless it is a
            stop token: a pad distinct from EOS is not text (an added ``<|pad|>`` row is untrained).
    Returns:
        :class:`Responses` with exactly R response columns.
    """
    if prompt_mask.shape != prompt_ids.shape:
        raise ValueError("prompt_ids and prompt_mask shapes differ")
    if bool((prompt_mask[:, -1] == 0).any()):
        raise ValueError("prompts must be left padded (the last column of every row is a real token)")
    was_training = model.training
    model.eval()
    try:
        kwargs = dict(
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=not greedy,
            pad_token_id=pad_token_id,
            eos_token_id=list(stop_token_ids),
            use_cache=True,
        )
        if not greedy:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else None)
        suppress = [*suppress_token_ids, *([] if pad_token_id in stop_token_ids else [pad_token_id])]
        if suppress:
            kwargs["suppress_tokens"] = suppress
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)  # (B, P + r), r <= R
    finally:
        model.train(was_training)
    start = prompt_ids.shape[1]
    generated = out[:, start:]
    if generated.shape[1] < max_new_tokens:  # every row stopped early: pad to the fixed length
        fill = generated.new_full((generated.shape[0], max_new_tokens - generated.shape[1]), pad_token_id)
        generated = torch.cat([generated, fill], dim=1)
    response_ids, mask, ended = truncate_at_stop(generated, stop_token_ids, pad_token_id)
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask.to(prompt_mask.dtype)], dim=1)
    return Responses(input_ids, attention_mask, response_ids, mask, ended, start)
