"""``rlhfkit generate``: sample from any trained policy folder and write JSON Lines, to read what it writes.

    rlhfkit generate --model runs/quickstart/ppo/final --prompts prompts.jsonl --temperature 0.7 --out samples.jsonl
    rlhfkit generate --model runs/quickstart/ppo/final --prompts prompts.jsonl --reward-model runs/quickstart/reward/final

Prompts are read and validated like any prompts dataset (every shape of :mod:`rlhfkit.data.records` that
has a prompt), left padded, and sampled in batches; each output line is ``{"prompt", "response", "ended"}``
where ``ended`` says whether the response stopped at EOS (False: it hit ``--max-new-tokens``), and, with
``--reward-model``, ``"score"``: the reward model's normalised score of the response (``gain * raw + bias``,
as online training uses it).

``--backend vllm`` samples with a vLLM engine in this process (:mod:`rlhfkit.rollout.vllm_engine`, sized as
online training's defaults: ``online.vllm_kv_cache_gib``, the longest prompt + ``--max-new-tokens``); the
scores are read by rlhfkit's models as with ``hf``.
"""

from __future__ import annotations

import json
import sys

import torch

from rlhfkit.config import OnlineConfig
from rlhfkit.data import TokenLimits, prepare_examples
from rlhfkit.engine.seed import seed_everything
from rlhfkit.models import load_causal_lm, load_scalar_model, load_tokenizer
from rlhfkit.rollout.evaluate import sample_and_score
from rlhfkit.rollout.vllm_engine import EngineSettings, VLLMEngine, engine_generate


def generate(
    model_dir: str,
    prompts_file: str,
    *,
    out: str | None = None,
    temperature: float = 0.7,
    max_new_tokens: int = 64,
    seed: int = 0,
    trust_remote_code: bool = False,
    reward_model: str | None = None,
    backend: str = "hf",
) -> list[dict]:
    """Load the policy in ``model_dir``, sample for every prompt of ``prompts_file``, write JSON Lines (with each
    response's score when ``reward_model``, a reward-model folder, is given). ``backend``: ``"hf"`` (Hugging
    Face ``generate``) or ``"vllm"`` (a vLLM engine on the policy's weights)."""
    seed_everything(seed)
    tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    examples = prepare_examples(prompts_file, "prompts", tokenizer, TokenLimits())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scorer = None
    if reward_model is not None:
        # The same check as online training's (it lives with the roles; this command is a front end, like the CLI).
        from rlhfkit.models import check_same_vocabulary

        check_same_vocabulary(tokenizer, reward_model, "--reward-model", trust_remote_code)
        scorer = load_scalar_model(
            reward_model, trust_remote_code=trust_remote_code, tokenizer=tokenizer, frozen=True
        ).to(device)
        scorer.eval()
    model = load_causal_lm(
        model_dir, trust_remote_code=trust_remote_code, tokenizer=tokenizer, frozen=True
    ).to(device)
    engine = _engine(model, examples, max_new_tokens, seed, model_dir) if backend == "vllm" else None
    try:
        samples = sample_and_score(
            model,
            tokenizer,
            examples,
            temperature=max(temperature, 1e-6),
            max_new_tokens=max_new_tokens,
            greedy=temperature == 0,
            reward_model=scorer,
            **({} if engine is None else {"generate": engine_generate(engine)}),
        )
    finally:
        if engine is not None:
            engine.close()
    rows = [
        {"prompt": ex["record"]["prompt"], "response": response, "ended": bool(ended)}
        for ex, response, ended in zip(examples, samples.responses, samples.ended, strict=True)
    ]
    for row, score in zip(rows, samples.proxy, strict=False):  # proxy is empty without a reward model
        row["score"] = score
    stream = open(out, "w", encoding="utf-8") if out else sys.stdout  # noqa: SIM115
    try:
        for row in rows:
            stream.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        if out:
            stream.close()
    return rows


def _engine(
    model: torch.nn.Module, examples: list[dict], max_new_tokens: int, seed: int, where: str
) -> VLLMEngine:
    """A vLLM engine on ``model``'s weights, in its precision, for the longest prompt + ``max_new_tokens``."""
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    longest = max(len(ex["prompt_ids"]) for ex in examples) + max_new_tokens
    limit = getattr(model.config, "max_position_embeddings", None)
    settings = EngineSettings(
        dtype=names[next(model.parameters()).dtype],
        kv_cache_gib=OnlineConfig().vllm_kv_cache_gib,
        kv_cache_dtype=OnlineConfig().vllm_kv_cache_dtype,
        max_model_len=min(longest, int(limit)) if limit else longest,
        seed=seed,
    )
    return VLLMEngine(model, settings, where=f"--model {where}")
