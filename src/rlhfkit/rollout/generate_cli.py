"""``rlhfkit generate``: sample from any trained policy folder and write JSON Lines, to read what it writes.

    rlhfkit generate --model runs/quickstart/ppo/final --prompts prompts.jsonl --temperature 0.7 --out samples.jsonl
    rlhfkit generate --model runs/quickstart/ppo/final --prompts prompts.jsonl --reward-model runs/quickstart/reward/final
    rlhfkit generate --model runs/grpo/final --prompts prompts.jsonl --reward-function rewards.py:accuracy

Prompts are read and validated like any prompts dataset (every shape of :mod:`rlhfkit.data.records` that
has a prompt), left padded, and sampled in batches; each output line is ``{"prompt", "response", "ended"}``
where ``ended`` says whether the response stopped at EOS (False: it hit ``--max-new-tokens``), and, with
``--reward-model`` and/or ``--reward-function``, ``"score"``: the response's score as online training's
scorer gives it before the missing-EOS rule (:class:`rlhfkit.rollout.scoring.Scorer`: the reward model's
normalised score ``gain * raw + bias`` plus each reward function's value; null when nothing had an opinion).
With reward functions, ``"parts"`` holds each part's own score by name (``reward_model`` and each function's
name, null for no opinion). A reward function is named as in ``online.reward_functions``
(``path/to/file.py:fn`` or ``pkg.module:fn``, TRL's convention: ``fn(prompts, completions, **columns)``) and is
called with the prompts file's other columns; one that needs a column the file lacks is refused before any
model loads.

``--backend vllm`` samples with a vLLM engine in this process (:mod:`rlhfkit.rollout.vllm_engine`, sized as
online training's defaults: ``online.vllm_kv_cache_gib``, the longest prompt + ``--max-new-tokens``); the
scores are read by rlhfkit's models as with ``hf``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import torch

from rlhfkit.config import OnlineConfig
from rlhfkit.data import TokenLimits, prepare_examples
from rlhfkit.engine.seed import seed_everything
from rlhfkit.models import load_causal_lm, load_scalar_model, load_tokenizer
from rlhfkit.models.sampler import set_sampler
from rlhfkit.models.static_decode import set_decode
from rlhfkit.rollout.evaluate import sample_and_score
from rlhfkit.rollout.scoring import Scorer, combine_parts, data_columns
from rlhfkit.rollout.vllm_engine import EngineSettings, VLLMEngine, engine_generate

FUNCTIONS_FLAG = "--reward-function"  # names the setting in the errors of a reward function


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
    reward_functions: Sequence[str] = (),
    hf_decode: str = "dynamic",
    sampler: str = "exact",
) -> list[dict]:
    """Load the policy in ``model_dir``, sample for every prompt of ``prompts_file``, write JSON Lines (with each
    response's score when ``reward_model``, a reward-model folder, or ``reward_functions``, names as in
    ``online.reward_functions``, are given). ``backend``: ``"hf"`` (Hugging Face ``generate``) or ``"vllm"``
    (a vLLM engine on the policy's weights); ``hf_decode``: the hf backend's cache, as ``online.hf_decode``;
    ``sampler``: its draw, as ``online.sampler`` (exact: prompt i's response depends on the seed and the prompt,
    not on the batch it is sampled in)."""
    seed_everything(seed)
    functions = Scorer.load_functions(reward_functions, where=FUNCTIONS_FLAG)
    tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    examples = prepare_examples(prompts_file, "prompts", tokenizer, TokenLimits())
    records = [ex["record"] for ex in examples]
    function_scorer = Scorer(None, functions) if functions else None
    if function_scorer is not None:  # before any model loads
        function_scorer.check_columns(data_columns(records), where=FUNCTIONS_FLAG)
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
    set_decode(model, hf_decode)
    set_sampler(model, sampler)
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
        {"prompt": record["prompt"], "response": response, "ended": bool(ended)}
        for record, response, ended in zip(records, samples.responses, samples.ended, strict=True)
    ]
    parts = {"reward_model": torch.tensor(samples.proxy)} if scorer is not None else {}
    if function_scorer is not None:
        prompts = [record["prompt"] for record in records]
        parts.update(
            function_scorer.function_parts(prompts, samples.responses, records, samples.response_ids)
        )
    if parts:
        scores, scored = combine_parts(parts)
        for i, row in enumerate(rows):
            row["score"] = float(scores[i]) if scored[i] else None
            if function_scorer is not None:
                row["parts"] = {name: _number(values[i]) for name, values in parts.items()}
    stream = open(out, "w", encoding="utf-8") if out else sys.stdout  # noqa: SIM115
    try:
        for row in rows:
            stream.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        if out:
            stream.close()
    return rows


def _number(value: torch.Tensor) -> float | None:
    return None if value.isnan() else float(value)


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
