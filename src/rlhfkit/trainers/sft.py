"""Supervised fine-tuning: next-token cross-entropy on completion tokens only.

The SFT policy is the start of classic RLHF (Ouyang et al. 2022, step 1): the PPO actor, the frozen
reference, and the reward model's backbone all begin from it. The loss is the mean negative
log-likelihood over the completion tokens of the whole batch (prompt and padding tokens carry label
-100); the completion ends with EOS, which is inside the loss also when the tokenizer pads with EOS
(huggingface/trl#1623). A mixture-of-experts model adds ``model.router_aux_loss_coef`` times its router
load-balancing loss (each micro-batch's weighted by its share of the batch's completion tokens).

With ``model.lora_rank`` > 0 only LoRA adapters train; ``final/`` is then the merged model and
``final/adapter/`` the adapter alone (:mod:`rlhfkit.models.lora`).

Launch:
    rlhfkit train sft --config sft.yaml                       # one process
    torchrun --standalone --nproc_per_node 2 -m rlhfkit.cli train sft --config sft.yaml   # 2 processes (data parallel)
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from rlhfkit.algos import aggregate_loss
from rlhfkit.config import RunConfig
from rlhfkit.data import SFTCollator, TokenLimits, prepare_run_data
from rlhfkit.engine.accel import make_accelerator
from rlhfkit.engine.folder import open_run
from rlhfkit.engine.seed import seed_everything
from rlhfkit.models import (
    load_causal_lm,
    prepare_trained,
    response_readout,
)
from rlhfkit.rollout.chat_turns import ChatTurns
from rlhfkit.rollout.tools import load_tools, tool_schema
from rlhfkit.trainers.common import finish_run, micro_batches, router_aux_coef, run_tokenizer
from rlhfkit.trainers.offline import Objective, train_offline


def completion_nll(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], router_aux: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token negative log-likelihood of the labels, its mask, and the router load-balancing loss.

    Args:
        batch: ``input_ids``, ``attention_mask``, ``labels`` (B, L); labels are -100 where no loss is taken.
        router_aux: also return a mixture of experts' router load-balancing loss.
    Returns:
        (nll (B, L-1), mask (B, L-1) bool: the token at column j+1 predicted from column j; the aux loss,
        a scalar, or None without ``router_aux``).
    """
    targets = batch["labels"][:, 1:]  # (B, L-1)
    mask = targets != -100
    out = (
        response_readout(  # token j+1 from column j, chunked over the vocabulary (rlhfkit.models.head_chunks)
            model, batch["input_ids"], batch["attention_mask"], 1, router_aux=router_aux, labels=targets
        )
    )
    return -out.logprobs, mask, out.aux_loss


def sft_objective(
    collate: SFTCollator,
    eval_examples: list[dict] | None,
    eval_batch_size: int,
    device,
    aux_coef: float = 0.0,
) -> Objective:
    """The SFT loss (token-mean over the whole batch, plus ``aux_coef`` times a mixture of experts' router
    load-balancing loss) and an evaluation loss on held-out examples."""

    def loss(model, batch, normalizer):
        nll, mask, aux = completion_nll(model, batch, router_aux=aux_coef > 0)
        value = aggregate_loss(nll, mask, "token-mean", normalizer=normalizer)
        if aux is None:
            return value, {}
        share = float(mask.sum()) / normalizer  # this micro-batch's part of the batch's completion tokens
        return value + aux_coef * aux * share, {"loss/router_aux": float(aux.detach()) * share}

    def evaluate(model, step):
        if not eval_examples:
            return {}
        total, count = 0.0, 0
        for chunk in micro_batches(eval_examples, eval_batch_size):
            batch = {k: v.to(device) for k, v in collate(list(chunk)).items()}
            nll, mask, _ = completion_nll(model, batch)
            total += float((nll * mask).sum())
            count += int(mask.sum())
        mean = total / max(count, 1)
        return {"loss": mean, "perplexity": math.exp(min(mean, 50.0))}

    return Objective(collate=collate, loss=loss, normalizer=count_completion_tokens, evaluate=evaluate)


def count_completion_tokens(examples: list[dict]) -> float:
    """The number of tokens the loss averages over: every trained completion token (EOS included)."""
    return float(sum(len(e["completion_ids"]) - len(e.get("completion_skip", ())) for e in examples))


def data_tool_schemas(cfg: RunConfig) -> tuple[str, ...]:
    """The JSON schemas of ``data.tools``, one JSON string each (``TokenLimits.tools``); a ConfigError names a
    tool that cannot be loaded or has no schema."""
    tools = load_tools(cfg.data.tools, "data.tools")
    return tuple(json.dumps(tool_schema(fn, "data.tools", name)) for name, fn in tools.items())


def train(cfg: RunConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run SFT as configured; write ``final/`` and ``summary.json``; return the summary."""
    seed_everything(cfg.seed)
    accelerator = make_accelerator(sharding=True, collective_timeout=cfg.train.collective_timeout)

    # Load and validate all data before any model is built or the run folder written: bad input stops here,
    # with file/line/field, and leaves nothing to --overwrite.
    tokenizer = run_tokenizer(cfg)
    tools = data_tool_schemas(cfg)
    if tools:  # the template checks that an RL run with these tools makes at start-up
        ChatTurns.for_tokenizer(tokenizer, [json.loads(t) for t in tools])
    limits = TokenLimits(cfg.data.max_prompt_length, cfg.data.max_length, cfg.data.truncation, tools=tools)
    examples, eval_examples = prepare_run_data(cfg.data, "sft", tokenizer, limits, accelerator)
    run = open_run(cfg, accelerator, resume, overwrite)

    model = load_causal_lm(
        cfg.model.name_or_path,
        trust_remote_code=cfg.model.trust_remote_code,
        dtype=cfg.model.dtype,
        tokenizer=tokenizer,
        dropout=not cfg.model.disable_dropout,
    )
    model = prepare_trained(model, cfg.model).to(accelerator.device)  # LoRA / gradient checkpointing
    collate = SFTCollator(tokenizer.pad_token_id)
    eval_batch = cfg.train.micro_batch_size or cfg.train.batch_size
    objective = sft_objective(
        collate,
        eval_examples,
        eval_batch,
        accelerator.device,
        router_aux_coef(model, cfg.model.router_aux_loss_coef),
    )
    result = train_offline(cfg, run, model, examples, objective, accelerator)
    model = result["model"]  # whole again after sharded training

    summary = {
        "kind": "sft",
        "steps": result["step"],
        "train_loss": result["loss"],
        "eval_loss": result["eval"].get("loss"),
        "eval_perplexity": result["eval"].get("perplexity"),
        "train_examples": len(examples),
        "wall_seconds": result["wall_seconds"],
        "examples_per_second": result["examples_per_second"],
    }
    finish_run(run, accelerator, summary, tokenizer, accelerator.unwrap_model(model), cfg.model.save_dtype)
    return summary
