"""How sharp a policy's next-token distributions are along its responses, and where they differ from the reference.

The claim that RLHF makes a policy "mode-seeking" (sharper, less diverse, best decoded greedily) is a claim
about these distributions. On each response token t (state x, y_<t) of responses sampled at some temperature
(or decoded greedily), with p = the policy's own next-token distribution (temperature 1, the pad token
suppressed as when sampling) and q = the reference's:

- ``entropy``: H(p) = -sum_v p_v log p_v (nats per token);
- ``top_mass``: max_v p_v, the probability greedy decoding commits to;
- ``ref_entropy``, ``ref_top_mass``: the same for q on the same states;
- ``top_agree``: 1 where argmax p = argmax q (greedy decoding of both would pick the same token here).

Each is a mean over all response tokens of all responses (token-weighted). :func:`measure_policy` samples
one response per prompt at a temperature (0 = greedy) and returns these beside the task's figures: gold,
proxy (the reward model, normalised as training uses it), validity, length, KL to the reference (k1, nats per
response, at the sampling temperature; none for greedy decoding, which is not a sample of the policy) and
the share of distinct responses.

Shapes: ``B`` responses, ``R`` response positions, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlhfkit.algos import entropy_from_logits, kl_k1
from rlhfkit.models import processed_logits, response_logits, sampled_logprobs, sampling_for, sequence_scores
from rlhfkit.rollout.scoring import reward_normalization

SHARPNESS_KEYS = ("entropy", "top_mass", "ref_entropy", "ref_top_mass", "top_agree")


def sharpness_sums(
    logits: torch.Tensor, mask: torch.Tensor, ref_logits: torch.Tensor | None = None
) -> dict[str, float]:
    """Sums over the response tokens inside ``mask`` of the per-token figures of the module docstring.

    Args:
        logits: (B, R, V) the policy's processed logits (-inf = probability 0) predicting each response token.
        mask: (B, R) bool, the real response tokens.
        ref_logits: (B, R, V) the reference's, on the same states; adds ``ref_entropy``, ``ref_top_mass``,
            ``top_agree``.
    Returns:
        ``tokens`` (the count) and the sum of each figure; divide by ``tokens`` for the means.
    """
    if logits.shape[:2] != mask.shape or (ref_logits is not None and ref_logits.shape != logits.shape):
        raise ValueError(f"shapes differ: logits {tuple(logits.shape)}, mask {tuple(mask.shape)}")
    m = mask.bool()

    def total(x: torch.Tensor) -> float:
        return float(torch.where(m, x.float(), 0.0).sum())  # where, not *: junk (inf, nan) outside stays out

    out = {
        "tokens": float(m.sum()),
        "entropy": total(entropy_from_logits(logits)),
        "top_mass": total(torch.softmax(logits.float(), -1).amax(-1)),
    }
    if ref_logits is not None:
        out["ref_entropy"] = total(entropy_from_logits(ref_logits))
        out["ref_top_mass"] = total(torch.softmax(ref_logits.float(), -1).amax(-1))
        out["top_agree"] = total((logits.argmax(-1) == ref_logits.argmax(-1)).float())
    return out


@torch.no_grad()
def measure_policy(
    policy: torch.nn.Module,
    tokenizer,
    examples: list[dict],
    *,
    temperature: float,
    max_new_tokens: int,
    reference: torch.nn.Module,
    reward_model: torch.nn.Module | None = None,
    gold_score: Callable[[str, str], float] | None = None,
    is_valid: Callable[[str], bool] | None = None,
    batch_size: int = 64,
    samples_per_prompt: int = 1,
) -> dict[str, float]:
    """``samples_per_prompt`` responses per prompt example at ``temperature`` (0 = greedy); the means of the module
    docstring over all responses.

    Returns:
        ``gold``, ``gold_std``, ``proxy``, ``valid_rate``, ``length`` (tokens, the stop token included),
        ``ended_rate``, ``distinct_rate`` (distinct response texts / responses), ``kl`` (None when greedy), and
        :data:`SHARPNESS_KEYS`; ``gold_se`` and ``proxy_se``, the standard errors of ``gold`` and ``proxy`` with
        the prompt as the unit (:func:`rlhfkit.rollout.evaluate.prompt_standard_error`); a figure whose scorer
        was not given is absent.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    from rlhfkit.rollout.evaluate import _prompt_text, prompt_standard_error, response_batches

    # each prompt's samples side by side
    examples = [ex for ex in examples for _ in range(samples_per_prompt)]

    greedy = temperature == 0
    stops = [tokenizer.eos_token_id]
    sampling = sampling_for(tokenizer.pad_token_id, stops, 1.0 if greedy else temperature)
    own = sampling_for(tokenizer.pad_token_id, stops, 1.0)  # the model's own distribution
    sums: dict[str, float] = {}
    texts, lengths, ended, gold, proxy, valid, kl = [], [], [], [], [], [], []
    for chunk, r in response_batches(
        policy, tokenizer, examples, sampling, max_new_tokens, greedy, batch_size
    ):
        logits = response_logits(policy, r.input_ids, r.attention_mask, r.response_start)  # (B, R, V)
        ref = response_logits(reference, r.input_ids, r.attention_mask, r.response_start)  # (B, R, V)
        part = sharpness_sums(processed_logits(logits, own), r.mask, processed_logits(ref, own))
        sums = {k: sums.get(k, 0.0) + v for k, v in part.items()}
        if not greedy:
            labels = r.input_ids[:, r.response_start :]
            k1 = kl_k1(sampled_logprobs(logits, labels, sampling), sampled_logprobs(ref, labels, sampling))
            kl += torch.where(r.mask, k1, 0.0).sum(1).tolist()  # (B,) nats per response
        prompts = [_prompt_text(ex, tokenizer) for ex in chunk]
        chunk_texts = [
            tokenizer.decode(ids[m], skip_special_tokens=True)
            for ids, m in zip(r.response_ids, r.mask, strict=True)
        ]
        texts += chunk_texts
        lengths += r.mask.sum(1).tolist()
        ended += r.ended.tolist()
        if reward_model is not None:
            gain, bias = reward_normalization(reward_model)
            proxy += (
                sequence_scores(reward_model, r.input_ids, r.attention_mask).float() * gain + bias
            ).tolist()
        if gold_score is not None:
            gold += [float(gold_score(p, t)) for p, t in zip(prompts, chunk_texts, strict=True)]
        if is_valid is not None:
            valid += [float(is_valid(t)) for t in chunk_texts]

    def mean(xs) -> float:
        return float(sum(xs) / max(len(xs), 1))

    tokens = max(sums.get("tokens", 0.0), 1.0)
    out = {
        "length": mean(lengths),
        "ended_rate": mean(ended),
        "distinct_rate": len(set(texts)) / max(len(texts), 1),
        "kl": None if greedy else mean(kl),
        **{k: sums[k] / tokens for k in SHARPNESS_KEYS},
    }
    if gold:
        out["gold"] = mean(gold)
        out["gold_std"] = float(torch.tensor(gold).std()) if len(gold) > 1 else 0.0
        out["gold_se"] = prompt_standard_error(gold, samples_per_prompt)
    if proxy:
        out["proxy"] = mean(proxy)
        out["proxy_se"] = prompt_standard_error(proxy, samples_per_prompt)
    if valid:
        out["valid_rate"] = mean(valid)
    return out


__all__ = ["SHARPNESS_KEYS", "measure_policy", "sharpness_sums"]
