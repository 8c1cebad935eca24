"""Preference pairs sampled from a policy and labelled by a built-in task's simulated annotators.

This is step 2's data in classic RLHF (Ouyang et al. 2022; Ziegler et al. 2019 sample pairs from the
initial policy and have humans compare them): for every prompt, two responses are sampled from the
policy (temperature 1 by default, so that the pairs cover what the policy actually writes; the pad
token is never sampled), and an annotator of the task prefers one with Bradley-Terry noise on the gold
scores, P(a > b) = sigmoid((gold(a) - gold(b)) / T) (:mod:`rlhfkit.tasks.annotators`).

    rlhfkit label-pairs --model runs/sft/final --out data/pairs [--pairs 2000] [--eval-pairs 500] [--seed 0]

writes, under ``--out``:

    pairs_train.jsonl  pairs on the task's train prompts
    pairs_eval.jsonl   pairs on its held-out prompts (disjoint from train)
    labels.json        counts, the annotators' Bayes ceiling of each file, settings, timing

Each line is a preference record ``{"prompt", "chosen", "rejected"}`` (docs/design.md, "Data formats") with
three extra fields that only evaluation reads: ``gold_chosen`` and ``gold_rejected`` (the noiseless gold
scores) and ``gold_agreement`` (the probability that an annotator's label agrees with the gold order,
sigmoid(|gold_chosen - gold_rejected| / T), null for a gold tie; its mean over a file's non-tied pairs is
that file's Bayes ceiling). ``rlhfkit train reward`` reads them to report accuracy against gold beside the ceiling,
so the trainer needs to know nothing about the task.

A pair whose two responses are the same text teaches nothing and is dropped, and so is a pair with an
empty response (the preference format refuses empty responses); both are counted in ``labels.json``.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlhfkit.errors import UserError

if TYPE_CHECKING:
    from rlhfkit.rollout.generation import Responses

FILES = {"train": "pairs_train.jsonl", "eval": "pairs_eval.jsonl", "meta": "labels.json"}


@dataclass
class SampledPair:
    """Two responses of a policy to one prompt; ``ended_*`` is False when a response hit the length limit."""

    prompt: str
    a: str
    b: str
    ended_a: bool = True
    ended_b: bool = True


@torch.no_grad()
def sample_response_pairs(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    batch_size: int = 512,
    seed: int = 0,
    generate: Callable[..., Responses] | None = None,
) -> list[SampledPair]:
    """Sample two responses per prompt (plain-text prompts, encoded as the trainers encode them).

    Args:
        model: a causal LM (on its device).
        tokenizer: its tokenizer (with a pad token).
        prompts: the prompts, one pair each.
        max_new_tokens: the longest response, in tokens.
        temperature: sampling temperature.
        batch_size: responses per ``generate`` call (two rows per prompt).
        seed: the sampling seed (the global torch RNG is restored afterwards).
        generate: what samples: :func:`rlhfkit.rollout.generate_responses` (None), or
            :func:`rlhfkit.rollout.vllm_engine.engine_generate` of an engine that holds ``model``'s weights.
    Returns:
        one :class:`SampledPair` per prompt, in order; texts without EOS and special tokens.
    """
    from rlhfkit.data import encode_prompt, pad_sequences
    from rlhfkit.models import sampling_for
    from rlhfkit.models.sampler import RowStreams
    from rlhfkit.rollout.generation import generate_responses

    generate = generate or generate_responses
    device = next(model.parameters()).device
    per_call = max(1, batch_size // 2)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    out: list[SampledPair] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start : start + per_call]
            rows = [
                ids for p in chunk for ids in [encode_prompt(tokenizer, p)] * 2
            ]  # prompt i -> rows 2i, 2i+1
            ids, mask = pad_sequences(rows, pad, "left")
            index = torch.arange(start, start + len(chunk), device=device).repeat_interleave(2)
            streams = RowStreams(seed, index, torch.arange(2, device=device).repeat(len(chunk)))
            responses = generate(
                model,
                ids.to(device),
                mask.to(device),
                max_new_tokens=max_new_tokens,
                stop_token_ids=[eos],
                pad_token_id=pad,
                sampling=sampling_for(pad, [eos], temperature),
                streams=streams,  # online.sampler=exact: prompt i's pair, whatever batch_size
            )
            texts = [
                tokenizer.decode(r[m].tolist(), skip_special_tokens=True)
                for r, m in zip(responses.response_ids.cpu(), responses.mask.cpu(), strict=True)
            ]
            ended = responses.ended.cpu().tolist()
            for i, prompt in enumerate(chunk):
                out.append(
                    SampledPair(prompt, texts[2 * i], texts[2 * i + 1], ended[2 * i], ended[2 * i + 1])
                )
    return out


def annotate_records(
    task, pairs: list[SampledPair], seed: int = 0, temperature: float | None = None
) -> list[dict]:
    """Label pairs with the task's noisy annotators; records carry the gold fields of the module docstring.

    Args:
        task: a :class:`rlhfkit.tasks.Task`.
        pairs: sampled pairs (identical or empty responses should be dropped first).
        seed: the annotators' seed.
        temperature: the annotators' Bradley-Terry temperature (default: the task's).
    """
    from rlhfkit.tasks.annotators import gold_order, sigmoid

    t = task.annotator_temperature if temperature is None else float(temperature)
    labelled = task.annotate_pairs([(p.prompt, p.a, p.b) for p in pairs], seed=seed, temperature=t)
    records = []
    for record in labelled:
        g_c = task.gold_score(record["prompt"], record["chosen"])
        g_r = task.gold_score(record["prompt"], record["rejected"])
        agreement = None if gold_order(g_c, g_r) == 0 else sigmoid(abs(g_c - g_r) / t)
        records.append({**record, "gold_chosen": g_c, "gold_rejected": g_r, "gold_agreement": agreement})
    return records


def _pick_prompts(prompts: list[str], n: int, rng: random.Random) -> list[str]:
    """``n`` prompts: shuffled passes over ``prompts`` (each used once before any is used twice)."""
    picked: list[str] = []
    while len(picked) < n:
        order = list(prompts)
        rng.shuffle(order)
        picked += order[: n - len(picked)]
    return picked


def drop_uninformative(pairs: list[SampledPair]) -> tuple[list[SampledPair], dict[str, int]]:
    kept = [p for p in pairs if p.a.strip() and p.b.strip() and p.a != p.b]
    counts = {
        "dropped_identical": sum(p.a == p.b and bool(p.a.strip()) for p in pairs),
        "dropped_empty": sum(not (p.a.strip() and p.b.strip()) for p in pairs),
        "truncated_responses": sum((not p.ended_a) + (not p.ended_b) for p in kept),
    }
    return kept, counts


def _stats(task, records: list[dict], counts: dict[str, int]) -> dict[str, Any]:
    untied = [r for r in records if r["gold_agreement"] is not None]
    agree = [r["gold_chosen"] > r["gold_rejected"] for r in untied]
    responses = [(r["prompt"], r[side]) for r in records for side in ("chosen", "rejected")]
    gold = [r[f"gold_{side}"] for r in records for side in ("chosen", "rejected")]
    return {
        "pairs": len(records),
        **counts,
        "gold_ties": len(records) - len(untied),
        "bayes_ceiling": sum(r["gold_agreement"] for r in untied) / len(untied) if untied else None,
        "labels_agreeing_with_gold": sum(agree) / len(agree) if agree else None,
        "valid_fraction": sum(task.is_valid(text) for _, text in responses) / max(len(responses), 1),
        "gold_mean": sum(gold) / max(len(gold), 1),
    }


def label_pairs(
    policy: str,
    out_dir: str | Path,
    *,
    task: str = "reviews",
    task_seed: int = 0,
    num_pairs: int = 2000,
    num_eval_pairs: int = 500,
    seed: int = 0,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    batch_size: int = 512,
    annotator_temperature: float | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Sample pairs from ``policy`` on a built-in task's train and held-out prompts, label them, write them.

    Args:
        policy: a causal-LM folder (e.g. an SFT run's ``final/``) that uses the task's tokenizer.
        out_dir: where the files of the module docstring go.
        task: the built-in task's name.
        task_seed: the task's seed, which fixes its train / held-out prompt split: use the one the SFT data
            was written with, so that held-out prompts stay unseen.
        num_pairs, num_eval_pairs: pairs sampled on train / held-out prompts (before dropping identical
            or empty ones).
        seed: sampling and annotator seed.
        temperature: sampling temperature.
        max_new_tokens: the longest response.
        batch_size: responses per generate call.
        annotator_temperature: the annotators' Bradley-Terry temperature (default: the task's).
        overwrite: replace existing files in ``out_dir``.
    Returns:
        what ``labels.json`` holds, plus ``"paths"``.
    """
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.annotators import check_temperature
    from rlhfkit.tasks.files import write_jsonl

    if num_pairs < 1 or num_eval_pairs < 0:
        raise UserError(
            f"need at least one training pair and no negative count, got {num_pairs} / {num_eval_pairs}"
        )
    if not (temperature > 0 and math.isfinite(temperature)):
        raise UserError(f"the sampling temperature must be a positive number, got {temperature}")
    out = Path(out_dir)
    paths = {name: out / file for name, file in FILES.items()}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not overwrite:
        raise UserError(f"{existing[0]} exists; pass --overwrite to replace it, or choose another --out")
    the_task = get_task(task, seed=task_seed)
    t = (
        the_task.annotator_temperature
        if annotator_temperature is None
        else check_temperature(annotator_temperature)
    )

    start = time.perf_counter()
    tokenizer = load_tokenizer(policy)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_causal_lm(policy, tokenizer=tokenizer, frozen=True).to(device)
    rng = random.Random(f"label-pairs-{task}-{seed}")
    prompts = {
        "train": _pick_prompts(the_task.prompts("train"), num_pairs, rng),
        "eval": _pick_prompts(the_task.prompts("eval"), num_eval_pairs, rng) if num_eval_pairs else [],
    }
    sampled = sample_response_pairs(
        model,
        tokenizer,
        prompts["train"] + prompts["eval"],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        batch_size=batch_size,
        seed=seed,
    )
    generation_seconds = time.perf_counter() - start

    meta: dict[str, Any] = {
        "task": task,
        "task_seed": task_seed,
        "policy": str(policy),
        "seed": seed,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "annotator_temperature": t,
    }
    out.mkdir(parents=True, exist_ok=True)
    split_at = len(prompts["train"])
    for offset, split in enumerate(("train", "eval")):
        pairs = sampled[:split_at] if split == "train" else sampled[split_at:]
        kept, counts = drop_uninformative(pairs)
        if split == "train" and not kept:
            raise UserError(
                f"every pair sampled from {policy} had identical or empty responses; nothing to label"
            )
        records = annotate_records(the_task, kept, seed=2 * seed + offset, temperature=t)
        write_jsonl(paths[split], records)
        meta[split] = {"file": str(paths[split]), **_stats(the_task, records, counts)}
    meta["seconds"] = {"generation": generation_seconds, "total": time.perf_counter() - start}
    meta["responses_per_second"] = 2 * len(sampled) / max(generation_seconds, 1e-9)
    paths["meta"].write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return {**meta, "paths": {k: str(v) for k, v in paths.items()}}
