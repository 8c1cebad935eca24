"""Evaluation of a policy on held-out prompts: proxy score, gold score, KL to the reference, win rate.

This is the reward-hacking meter: the proxy (the reward model, what PPO optimises) beside the gold
score of a task's annotators (what we actually want), and the KL to the reference, on the same samples.
Sampling uses the training temperature (the policy that was optimised) or greedy decoding, with the pad
token suppressed and nothing of the checkpoint's generation settings (:mod:`rlhfkit.models.sampling`); the KL
is scored under that same distribution.

Shapes: ``B`` prompts, ``R`` response length.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlhfkit.algos import kl_k1, masked_sum
from rlhfkit.data import PromptCollator
from rlhfkit.models import response_logprobs, sampling_for, sequence_scores, teacher_divergence
from rlhfkit.models.sampler import RowStreams, sampler_of
from rlhfkit.rollout.generation import Responses, generate_responses
from rlhfkit.rollout.scoring import reward_normalization


@dataclass
class PolicySamples:
    """Responses of one policy to a list of prompts, with their figures (one entry per prompt)."""

    prompts: list[str]
    responses: list[str]
    ended: list[bool]
    lengths: list[int]
    gold: list[float] = field(default_factory=list)
    proxy: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    kl_exact: list[float] = field(default_factory=list)  # the exact KL summed per response (``exact_kl``)
    valid: list[bool] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)  # up to and including the stop token

    def summary(self) -> dict[str, float]:
        """Means of every figure that was measured (``gold_mean``, ``proxy_mean``, ``kl_mean``, ``kl_exact_mean``,
        ...)."""
        out = {"response_length_mean": _mean(self.lengths), "ended_rate": _mean(self.ended)}
        for name in ("gold", "proxy", "kl", "kl_exact"):
            values = getattr(self, name)
            if values:
                out[f"{name}_mean"] = _mean(values)
        if self.gold:
            out["gold_std"] = float(torch.tensor(self.gold).std()) if len(self.gold) > 1 else 0.0
        if self.valid:
            out["valid_rate"] = _mean(self.valid)
        return out


def _mean(xs) -> float:
    return float(sum(float(x) for x in xs) / max(len(xs), 1))


def response_batches(
    policy: torch.nn.Module,
    tokenizer,
    examples: list[dict],
    sampling,
    max_new_tokens: int,
    greedy: bool,
    batch_size: int,
    generate: Callable[..., Responses] = generate_responses,
):
    """Each chunk of ``batch_size`` prompt examples with one response per prompt from ``policy`` (stopped at
    the tokenizer's EOS, processed by ``sampling``): yields ``(chunk, Responses)``. ``generate`` samples
    (:func:`generate_responses`, or :func:`rlhfkit.rollout.vllm_engine.engine_generate` of an engine that holds
    ``policy``'s weights). Under ``online.sampler=exact`` (:mod:`rlhfkit.models.sampler`) prompt ``i`` of
    ``examples`` draws from its own stream, so its response does not depend on ``batch_size``."""
    device = next(policy.parameters()).device
    collate = PromptCollator(tokenizer.pad_token_id)
    # The streams' seed, from the caller's seeded generator; drawn only where the exact sampler draws, so that
    # under `multinomial` (and for an engine, which seeds its own requests) the generator is left as before.
    own = generate is generate_responses and not greedy and sampler_of(policy) == "exact"
    seed = int(torch.randint(2**62, (1,))) if own else None
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = collate(chunk)
        index = torch.arange(start, start + len(chunk), device=device)  # each prompt's own stream
        streams = {} if seed is None else {"streams": RowStreams(seed, index, torch.zeros_like(index))}
        yield (
            chunk,
            generate(
                policy,
                batch["input_ids"].to(device),
                batch["attention_mask"].to(device),
                max_new_tokens=max_new_tokens,
                stop_token_ids=[tokenizer.eos_token_id],
                pad_token_id=tokenizer.pad_token_id,
                sampling=sampling,
                greedy=greedy,
                **streams,
            ),
        )


@torch.no_grad()
def sample_and_score(
    policy: torch.nn.Module,
    tokenizer,
    examples: list[dict],
    *,
    temperature: float,
    max_new_tokens: int,
    greedy: bool = False,
    reward_model: torch.nn.Module | None = None,
    reference: torch.nn.Module | None = None,
    gold_score: Callable[[str, str], float] | None = None,
    is_valid: Callable[[str], bool] | None = None,
    batch_size: int = 64,
    generate: Callable[..., Responses] = generate_responses,
    exact_kl: bool = False,
) -> PolicySamples:
    """Sample one response per prompt example and measure it.

    Args:
        policy: the causal LM to evaluate.
        tokenizer: its tokenizer (pad and EOS set).
        examples: tokenised prompts (``rlhfkit.data.prepare_examples(..., "prompts", ...)``).
        temperature, max_new_tokens, greedy: sampling settings.
        reward_model: when given, ``proxy`` = its normalised score (gain * raw + bias, as online training
            uses it) at the last response token.
        reference: when given, ``kl`` = sum over the response of k1 = log pi - log pi_ref (nats per
            response, at ``temperature``; greedy samples are not from the policy, so no KL then).
        exact_kl: with ``reference``, also ``kl_exact`` = sum over the response of the exact per-token
            KL(pi(.|prefix) || pi_ref(.|prefix)) over the whole vocabulary, both distributions as sampled
            (:func:`rlhfkit.models.teacher_divergence`, ``full_reverse_kl``); it draws no random numbers, so
            every other figure is the same with or without it.
        gold_score: ``(prompt, response) -> float``, the task's gold scorer.
        is_valid: ``response -> bool``, the task's validity check.
        generate: what samples (:func:`response_batches`); every figure is read from ``policy`` itself.
    """
    out = PolicySamples([], [], [], [])
    sampling = sampling_for(tokenizer.pad_token_id, [tokenizer.eos_token_id], temperature)
    for chunk, r in response_batches(
        policy, tokenizer, examples, sampling, max_new_tokens, greedy, batch_size, generate
    ):
        prompts = [_prompt_text(ex, tokenizer) for ex in chunk]
        kept = [ids[m].tolist() for ids, m in zip(r.response_ids, r.mask, strict=True)]
        texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
        out.prompts += prompts
        out.response_ids += kept
        out.responses += texts
        out.ended += r.ended.tolist()
        out.lengths += r.mask.sum(1).tolist()
        if reward_model is not None:
            gain, bias = reward_normalization(reward_model)  # the reward trainer's normalisation
            raw = sequence_scores(reward_model, r.input_ids, r.attention_mask).float()  # (B,)
            out.proxy += (raw * gain + bias).tolist()
        if reference is not None and not greedy:
            logprobs = response_logprobs(
                policy, r.input_ids, r.attention_mask, r.response_start, sampling
            )  # (B, R)
            ref = response_logprobs(
                reference, r.input_ids, r.attention_mask, r.response_start, sampling
            )  # (B, R)
            out.kl += (kl_k1(logprobs, ref) * r.mask).sum(1).tolist()
            if exact_kl:
                per_token = teacher_divergence(
                    policy,
                    reference,
                    r.input_ids,
                    r.attention_mask,
                    r.response_start,
                    sampling,
                    "full_reverse_kl",
                )  # (B, R)
                out.kl_exact += masked_sum(per_token, r.mask, dim=1).tolist()
        if gold_score is not None:
            out.gold += [float(gold_score(p, t)) for p, t in zip(prompts, texts, strict=True)]
        if is_valid is not None:
            out.valid += [bool(is_valid(t)) for t in texts]
    return out


def _prompt_text(example: dict, tokenizer) -> str:
    record = example.get("record") or {}
    prompt = record.get("prompt")
    return (
        prompt
        if isinstance(prompt, str)
        else tokenizer.decode(example["prompt_ids"], skip_special_tokens=True)
    )


def prompt_standard_error(values, repeats: int) -> float:
    """The standard error of the mean of ``values`` (``repeats`` consecutive values per prompt): the sample sd of
    the per-prompt means over sqrt(prompts). The samples of one prompt are not independent of each other (they
    share the prompt), so the prompt is the unit; 0.0 for a single prompt."""
    if repeats < 1 or len(values) % repeats:
        raise ValueError(f"{len(values)} values are not {repeats} per prompt")
    means = [statistics.fmean(values[i : i + repeats]) for i in range(0, len(values), repeats)]
    return statistics.stdev(means) / len(means) ** 0.5 if len(means) > 1 else 0.0


def win_rate(gold_a: list[float], gold_b: list[float]) -> float:
    """Fraction of prompts where A's gold score beats B's, ties counting half."""
    if len(gold_a) != len(gold_b) or not gold_a:
        raise ValueError("win_rate needs two equally long, non-empty lists")
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(gold_a, gold_b, strict=True))
    return wins / len(gold_a)


__all__ = ["PolicySamples", "prompt_standard_error", "sample_and_score", "win_rate"]
