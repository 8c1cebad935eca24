"""``rlhfkit generate``: sample from any trained policy folder and write JSON Lines, to read what it writes.

    rlhfkit generate --model runs/quickstart/ppo/final --prompts prompts.jsonl --temperature 0.7 --out samples.jsonl

Prompts are read and validated like any prompts dataset (``{"prompt": str}`` or conversational), left
padded, and sampled in batches; each output line is ``{"prompt", "response", "ended"}`` where ``ended``
says whether the response stopped at EOS (False: it hit ``--max-new-tokens``).
"""

from __future__ import annotations

import json
import sys

import torch

from rlhfkit.data import PromptCollator, TokenLimits, prepare_examples
from rlhfkit.engine.seed import seed_everything
from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.rollout.generation import generate_responses


def sample_texts(model, tokenizer, examples: list[dict], *, temperature: float, max_new_tokens: int,
                 batch_size: int = 64, device: str | torch.device = "cpu") -> list[dict]:
    """Sample one response per tokenised prompt example; temperature 0 means greedy decoding.

    Returns ``[{"prompt_ids", "response", "ended"}]`` in the order of ``examples``.
    """
    collate = PromptCollator(tokenizer.pad_token_id)
    suppress = [tokenizer.pad_token_id] if tokenizer.pad_token_id != tokenizer.eos_token_id else []
    out = []
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start : start + batch_size])
        responses = generate_responses(
            model, batch["input_ids"].to(device), batch["attention_mask"].to(device),
            max_new_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id, temperature=max(temperature, 1e-6),
            greedy=temperature == 0, suppress_token_ids=suppress)
        for ids, mask, ended in zip(responses.response_ids, responses.mask, responses.ended, strict=True):
            out.append({"response": tokenizer.decode(ids[mask], skip_special_tokens=True), "ended": bool(ended)})
    return out


def generate(model_dir: str, prompts_file: str, *, out: str | None = None, temperature: float = 0.7,
             max_new_tokens: int = 64, seed: int = 0, trust_remote_code: bool = False) -> list[dict]:
    """Load the policy in ``model_dir``, sample for every prompt of ``prompts_file``, write JSON Lines."""
    seed_everything(seed)
    tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    examples = prepare_examples(prompts_file, "prompts", tokenizer, TokenLimits())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_causal_lm(model_dir, trust_remote_code=trust_remote_code, tokenizer=tokenizer).to(device)
    samples = sample_texts(model, tokenizer, examples, temperature=temperature, max_new_tokens=max_new_tokens,
                           device=device)
    rows = [{"prompt": ex["record"]["prompt"], **s} for ex, s in zip(examples, samples, strict=True)]
    stream = open(out, "w", encoding="utf-8") if out else sys.stdout  # noqa: SIM115
    try:
        for row in rows:
            stream.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        if out:
            stream.close()
    return rows
