"""Read-outs from Hugging Face models: token log-probs, per-token values, sequence scores.

Every read-out here is padding independent: position ids come from the attention mask
(``cumsum - 1``, clamped at 0), so left padding does not shift absolute or rotary positions
(NVIDIA/NeMo-Aligner#68), and the score of a sequence is read at its last token whose attention
mask is 1, never at "the last token that is not the pad id", which breaks when pad == EOS
(huggingface/transformers#30004, huggingface/trl#2778).

Alignment (docs/design.md, "Models"): for ``input_ids = [prompt | response]`` with the response
starting at column ``p0``, ``logprobs[:, t]`` and ``values[:, t]`` come from the model's output at
column ``p0 + t - 1``, the state before response token ``y_t``; the score comes from the last
valid column.

Scalar (reward / value) models are ``AutoModelForSequenceClassification`` models with a linear
``score`` head. The read-outs call the *whole* model (so a DistributedDataParallel or FSDP wrapper
sees its forward and synchronises gradients) and capture the head's per-position output with a
forward hook; the pooled output that transformers computes from the pad id is ignored.

Shapes: ``B`` batch, ``L`` full sequence length (prompt + response), ``R`` response length
(``L - p0``), ``V`` vocabulary.
"""

from __future__ import annotations

import inspect

import torch

from rlhfkit.models.sampling import Sampling, truncation_mask

# Upper bound on the elements of one temporary (rows, T, V) block in logprobs_from_logits: 2**24
# float32 values are 64 MiB, so a large vocabulary never needs a second full-size copy.
_CHUNK_ELEMENTS = 1 << 24


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DistributedDataParallel / accelerate / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model itself: :func:`unwrap_model`'s, and for a peft (LoRA) model its base model, whose
    ``forward`` signature, config and modules are the model's own."""
    inner = unwrap_model(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore padding on either side.

    Args:
        attention_mask: (B, L), 1 on real tokens, 0 on padding.
    Returns:
        (B, L) long: 0, 1, 2, ... over the real tokens of each row; padding gets a clamped value
        that is never read.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Column of the last real token of each row (0 for a row with no real token).

    Args:
        attention_mask: (B, L).
    Returns:
        (B,) long.
    """
    columns = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (columns * attention_mask.bool()).max(dim=-1).values


class _LabelLogprob(torch.autograd.Function):
    """log softmax(processed logits)[label], computed as the label's logit minus a logsumexp.

    The processing is ``logits / temperature`` with the ``suppress`` ids and the tokens outside ``keep``
    at -inf, the label itself always kept (:mod:`rlhfkit.models.sampling`). Forward keeps only the (B, T)
    logsumexp and a reference to the logits; backward rebuilds the softmax block by block. Besides the
    gradient itself, neither pass holds more than one (rows, T, V) float32 block, where a plain
    ``log_softmax(logits / temperature).gather(...)`` keeps a scaled copy and the full log-softmax.
    """

    @staticmethod
    def _scaled_block(logits, labels, start, stop, scale, suppress, keep):
        """float32 processed logits[start:stop], safe to modify in place: (rows, T, V)."""
        block = logits[start:stop]
        block = block.float().mul_(scale) if block.dtype != torch.float32 else block * scale
        if suppress is not None or keep is not None:
            index = labels[start:stop, :, None]  # (rows, T, 1)
            picked = block.gather(-1, index)
            if suppress is not None:
                block.masked_fill_(suppress, float("-inf"))
            if keep is not None:
                block.masked_fill_(~keep[start:stop], float("-inf"))
            block.scatter_(-1, index, picked)
        return block

    @staticmethod
    def forward(ctx, logits, labels, temperature, suppress, keep):
        batch, steps, vocab = logits.shape
        rows = max(1, _CHUNK_ELEMENTS // max(1, steps * vocab))
        scale = 1.0 / temperature
        lse = torch.empty(batch, steps, dtype=torch.float32, device=logits.device)
        for start in range(0, batch, rows):
            block = _LabelLogprob._scaled_block(logits, labels, start, start + rows, scale, suppress, keep)
            top = block.amax(dim=-1, keepdim=True)  # (rows, T, 1)
            lse[start : start + rows] = block.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(-1))
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float() * scale  # (B, T)
        ctx.save_for_backward(logits, labels, lse)
        ctx.scale, ctx.rows, ctx.suppress, ctx.keep = scale, rows, suppress, keep
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out):
        # d/dz_v [z_y / tau - lse(z / tau)] = ([v == y] - softmax(z / tau)_v) / tau; 0 for a removed token
        logits, labels, lse = ctx.saved_tensors
        grad_logits = None
        for start in range(0, logits.shape[0], ctx.rows):
            stop = start + ctx.rows
            block = _LabelLogprob._scaled_block(
                logits, labels, start, stop, ctx.scale, ctx.suppress, ctx.keep
            )
            block.sub_(lse[start:stop, :, None]).exp_()  # softmax, (rows, T, V)
            grad = grad_out[start:stop, :, None].float() * ctx.scale  # (rows, T, 1)
            block.mul_(-grad).scatter_add_(-1, labels[start:stop, :, None], grad)
            if stop >= logits.shape[0] and start == 0:
                return block.to(logits.dtype), None, None, None, None  # one block: it is the gradient
            if grad_logits is None:
                grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            grad_logits[start:stop] = block
        return grad_logits, None, None, None, None


def _check_shapes(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits / temperature)``.

    Equal to ``log_softmax(logits / temperature, -1).gather(-1, labels)`` but without storing a
    (B, T, V) log-softmax (the sampling temperature must be applied here too: OpenRLHF PR #853).
    To score sampled responses use :func:`sampled_logprobs`, which also applies the sampler's
    suppressed ids and truncation.

    Args:
        logits: (B, T, V), any float dtype; a non-contiguous slice is fine (it is not copied).
        labels: (B, T) token ids. A negative label (e.g. -100) gives a finite, meaningless value:
            mask those positions.
        temperature: > 0.
    Returns:
        (B, T) float32, differentiable with respect to ``logits``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_shapes(logits, labels)
    return _LabelLogprob.apply(logits, labels.long().clamp(min=0), float(temperature), None, None)


def sampled_logprobs(logits: torch.Tensor, labels: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Log-probability of each label under the distribution ``sampling`` samples from: suppressed ids
    removed, ``logits / temperature``, top-k / top-p truncation, renormalised (:mod:`rlhfkit.models.sampling`).

    Args:
        logits: (B, T, V), any float dtype.
        labels: (B, T) the sampled tokens (a label is always kept in the distribution, so the result is
            finite; mask padding positions).
        sampling: the sampler's :class:`rlhfkit.models.sampling.Sampling`.
    Returns:
        (B, T) float32, differentiable with respect to ``logits``.
    """
    _check_shapes(logits, labels)
    labels = labels.long().clamp(min=0)
    suppress = None
    if sampling.suppress_ids:
        suppress = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        suppress[list(sampling.suppress_ids)] = True
    keep = truncation_mask(logits.detach(), labels, sampling)
    return _LabelLogprob.apply(logits, labels, float(sampling.temperature), suppress, keep)


def causal_lm_output(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep_last: int = 0,
    router_aux: bool = False,
):
    """A causal LM's forward with position ids from the attention mask.

    Args:
        model: a causal LM (possibly wrapped by DDP / accelerate).
        input_ids, attention_mask: (B, L).
        keep_last: when > 0, only the logits of the last ``keep_last`` columns are needed; models
            that accept ``logits_to_keep`` then skip the output projection of the others.
        router_aux: a mixture of experts also returns its router load-balancing loss (``aux_loss``,
            over the tokens the attention mask keeps).
    Returns:
        the model's output; ``.logits`` is (B, L, V), or (B, keep_last, V) when ``keep_last`` > 0.
    """
    kwargs = {}
    inner = hf_model(model)  # a LoRA model's own forward
    if keep_last > 0 and "logits_to_keep" in inspect.signature(inner.forward).parameters:
        kwargs["logits_to_keep"] = keep_last
    if router_aux:
        kwargs["output_router_logits"] = True
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **kwargs,
    )
    if keep_last > 0 and out.logits.shape[1] != keep_last:
        out.logits = out.logits[:, -keep_last:]
    return out


def causal_lm_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep_last: int = 0
) -> torch.Tensor:
    """The logits of :func:`causal_lm_output`: (B, L, V), or (B, keep_last, V)."""
    return causal_lm_output(model, input_ids, attention_mask, keep_last).logits


def response_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    router_aux: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits that predict each response token (column ``response_start + t - 1`` for token t) and,
    with ``router_aux``, the router load-balancing loss of the forward.

    Args:
        input_ids, attention_mask: (B, L) = left-padded prompts followed by right-padded responses.
        response_start: p0, the column of the first response token (>= 1, same for all rows).
    Returns:
        (logits (B, R, V) with R = L - p0, a view (process it with the sampling before use); the
        scalar aux loss, or None without ``router_aux``).
    """
    length = input_ids.shape[1]
    if not 1 <= response_start <= length:
        raise ValueError(f"response_start must be in [1, {length}], got {response_start}")
    responses = length - response_start
    out = causal_lm_output(model, input_ids, attention_mask, responses + 1, router_aux)  # (B, R+1, V)
    return out.logits[:, :-1], (out.aux_loss if router_aux else None)


def response_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_start: int
) -> torch.Tensor:
    """The logits of :func:`response_forward`: (B, R, V)."""
    return response_forward(model, input_ids, attention_mask, response_start)[0]


def token_scores(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The scalar head's output at every column (values of a critic, dense rewards of a PRM).

    The whole model is called (wrappers see the forward) with position ids from the attention
    mask; a forward hook on ``score`` captures the per-column output before transformers pools it.

    Args:
        model: a sequence-classification model with ``num_labels == 1`` and a ``score`` head.
        input_ids, attention_mask: (B, L).
    Returns:
        (B, L); columns where ``attention_mask`` is 0 hold meaningless values.
    """
    inner = unwrap_model(model)
    head = getattr(inner, "score", None)
    if not isinstance(head, torch.nn.Module):
        raise TypeError(f"{type(inner).__name__} has no `score` head; load it with load_scalar_model")
    if getattr(inner.config, "pad_token_id", None) is None:
        # transformers' own pooling (whose result is ignored) refuses batches without a pad id.
        raise ValueError(
            "model.config.pad_token_id is None: load the model with load_scalar_model(tokenizer=...)"
        )
    captured = []
    hook = head.register_forward_hook(lambda _module, _inputs, output: captured.append(output))
    try:
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
    finally:
        hook.remove()
    if len(captured) != 1 or captured[0].shape[:2] != input_ids.shape:
        raise RuntimeError(f"{type(inner).__name__}.score was not applied once to every position")
    out = captured[0]  # (B, L, num_labels)
    if out.shape[-1] != 1:
        raise ValueError(f"a scalar model needs num_labels == 1, this one has {out.shape[-1]}")
    return out.squeeze(-1)


def sequence_scores(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, buckets: bool = True
) -> torch.Tensor:
    """One score per sequence, read at its last real token, whatever the padding side or pad id.

    With ``buckets`` (the default), the rows are sorted by length and scored in up to four forwards, each
    cut to its own longest row (:func:`length_buckets`): a batch of preference pairs is ~35% padding when
    every row is padded to the longest one, and padding costs as much as a real token. Each score is the
    same as from one forward over the whole batch (positions come from the mask; padding is never
    attended to), up to float rounding. Under several processes the batch stays whole: a
    DistributedDataParallel model must see one forward per backward.

    Args:
        model: a scalar (reward) model, see :func:`token_scores`.
        input_ids, attention_mask: (B, L), left or right padded.
        buckets: allow the length buckets.
    Returns:
        (B,) in the head's dtype.
    """

    def last_scores(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ids, mask = trim_padding(ids, mask)
        scores = token_scores(model, ids, mask)  # (b, L')
        return scores.gather(1, last_token_index(mask).unsqueeze(1)).squeeze(1)

    groups = length_buckets(attention_mask) if buckets and not _several_processes() else None
    if groups is None or len(groups) == 1:
        return last_scores(input_ids, attention_mask)
    parts = [last_scores(input_ids[rows], attention_mask[rows]) for rows in groups]
    order = torch.cat(groups)  # the bucketed order of the rows
    return torch.cat(parts)[torch.argsort(order)]


def trim_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the columns that are padding in every row (the real tokens of each row keep their positions,
    which come from the mask)."""
    keep = attention_mask.bool().any(0)  # (L,)
    if bool(keep.all()):
        return input_ids, attention_mask
    return input_ids[:, keep], attention_mask[:, keep]


def length_buckets(attention_mask: torch.Tensor, min_rows: int = 8) -> list[torch.Tensor]:
    """Row indices in 1, 2 or 4 groups of similar length (sorted by length, split evenly, at least
    ``min_rows`` rows a group): the fewest groups whose padded area (rows x longest row, summed) is within
    10% of the smallest. Deterministic in the mask alone.

    Args:
        attention_mask: (B, L).
    Returns:
        a list of (b_i,) long tensors that together hold every row once.
    """
    lengths = attention_mask.sum(1)
    order = torch.argsort(lengths, stable=True)
    options = [k for k in (1, 2, 4) if k == 1 or lengths.shape[0] >= k * min_rows]
    splits = {k: [rows for rows in order.tensor_split(k) if rows.numel()] for k in options}
    area = {k: sum(int(rows.numel()) * int(lengths[rows].max()) for rows in splits[k]) for k in options}
    best = min(area.values())
    return splits[next(k for k in options if area[k] <= 1.1 * best)]


def _several_processes() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def response_values(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_start: int
) -> torch.Tensor:
    """Critic values of the states before each response token.

    Args:
        input_ids, attention_mask: (B, L) = prompts (left padded) then responses (right padded).
        response_start: p0, the column of the first response token (>= 1).
    Returns:
        (B, R); ``[:, t]`` is V(x, y_<t), read at column p0 + t - 1.
    """
    length = input_ids.shape[1]
    if not 1 <= response_start <= length:
        raise ValueError(f"response_start must be in [1, {length}], got {response_start}")
    return token_scores(model, input_ids, attention_mask)[:, response_start - 1 : length - 1]
