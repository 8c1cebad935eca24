"""What every scalar-model run (reward model, PRM) does around its objective: open the processes, the data
and the run folder; build the backbone with a fresh scalar head; train on the shared offline loop with the
best model kept; write the summary, ``final/`` and the report."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit.config import RunConfig
from rlhfkit.data import Examples, TokenLimits, prepare_run_data
from rlhfkit.engine.accel import make_accelerator
from rlhfkit.engine.folder import RunDir, open_run
from rlhfkit.engine.seed import seed_everything
from rlhfkit.models import load_scalar_model, prepare_trained
from rlhfkit.trainers import common
from rlhfkit.trainers.best_model import BestKeeper, keep_best_warnings
from rlhfkit.trainers.common import run_tokenizer
from rlhfkit.trainers.offline import Objective, train_offline


def scoring_batch_size(cfg: RunConfig) -> int:
    """Pairs per forward pass when only scoring (evaluation, normalisation): 4 training micro-batches, as
    no activations are kept for a backward pass."""
    return 4 * (cfg.train.micro_batch_size or cfg.train.batch_size)


@dataclass
class ScalarSession:
    """What every scalar-model run opens: processes, the run folder, the tokenizer, the length limits."""

    accelerator: Any
    run: RunDir | None
    tokenizer: Any
    limits: TokenLimits
    save_dtype: str = "float32"


def open_session(cfg: RunConfig, kind: str) -> tuple[ScalarSession, Examples, Examples | None]:
    """Processes, tokenizer and all data of the run (bad data stops here, before the run folder is written)."""
    seed_everything(cfg.seed)
    accelerator = make_accelerator(sharding=True, collective_timeout=cfg.train.collective_timeout)
    tokenizer = run_tokenizer(cfg)
    limits = TokenLimits(cfg.data.max_prompt_length, cfg.data.max_length, cfg.data.truncation)
    examples, heldout = prepare_run_data(cfg.data, kind, tokenizer, limits, accelerator)
    return ScalarSession(accelerator, None, tokenizer, limits, cfg.model.save_dtype), examples, heldout


def start_run(cfg: RunConfig, session: ScalarSession, resume: bool, overwrite: bool) -> RunDir:
    """Open (or resume) the run folder, after the data has passed its checks."""
    session.run = open_run(cfg, session.accelerator, resume, overwrite)
    return session.run


def scalar_model(cfg: RunConfig, session: ScalarSession) -> torch.nn.Module:
    """The backbone with a fresh scalar head (N+ init, :func:`rlhfkit.models.load_scalar_model`), dropout off."""
    model = load_scalar_model(
        cfg.model.name_or_path,
        trust_remote_code=cfg.model.trust_remote_code,
        dtype=cfg.model.dtype,
        tokenizer=session.tokenizer,
        dropout=not cfg.model.disable_dropout,
    )
    return prepare_trained(model, cfg.model).to(session.accelerator.device)  # LoRA / gradient checkpointing


def fit_keeping_best(
    cfg: RunConfig,
    session: ScalarSession,
    model,
    examples,
    objective: Objective,
    keeper: BestKeeper,
    heldout: bool,
    counters: dict[str, float],
) -> tuple[dict[str, Any], torch.nn.Module]:
    """Step-0 evaluation, the shared offline loop, then the best model back in place (eval mode)."""
    run, accelerator = session.run, session.accelerator
    if heldout and run.resume_checkpoint is None:  # the untrained model's held-out figures, as step 0
        model.eval()
        with torch.no_grad():
            run.metrics.log(0, {f"eval/{k}": v for k, v in objective.evaluate(model, 0).items()})
        counters["eval_seconds"] = 0.0  # before the loop's clock starts
    result = train_offline(cfg, run, model, examples, objective, accelerator)
    model = accelerator.unwrap_model(result["model"])  # whole again after sharded training
    model.eval()
    accelerator.wait_for_everyone()
    if heldout and cfg.reward.keep_best and keeper.best is not None:
        if accelerator.is_main_process:
            for line in keep_best_warnings(keeper, cfg.train.eval_steps, result["step"]):
                print(f"rlhfkit: warning: {line}", file=sys.stderr)
        keeper.restore(model)
    return result, model


def run_summary(
    cfg: RunConfig,
    kind: str,
    unit: str,
    result,
    num_train: int,
    num_eval: int,
    keeper: BestKeeper,
    final_eval: dict,
    counters: dict[str, float],
    accelerator,
) -> dict[str, Any]:
    """summary.json: the final model's held-out figures, and the training throughput (held-out evaluations
    excluded; after a resume, only the steps run since it)."""
    train_seconds = max(result["wall_seconds"] - counters["eval_seconds"], 1e-9)
    tokens = counters["tokens"]
    if accelerator.num_processes > 1:  # every process counted its own slice of each batch
        tokens = float(accelerator.reduce(torch.tensor([tokens], device=accelerator.device), reduction="sum"))
    return {
        "kind": kind,
        "steps": result["step"],
        "early_stopped": result["step"] < cfg.train.max_steps,
        "final_step": keeper.step
        if num_eval and cfg.reward.keep_best and keeper.step is not None
        else result["step"],
        f"train_{unit}": num_train,
        f"eval_{unit}": num_eval,
        "train_loss": result["loss"],
        **{f"heldout_{k}": v for k, v in final_eval.items()},
        "wall_seconds": result["wall_seconds"],
        "eval_seconds": counters["eval_seconds"],
        f"{unit}_per_second": (result["examples_per_second"] or 0.0) * result["wall_seconds"] / train_seconds,
        "tokens_per_second": tokens / train_seconds,  # real (non-padding) tokens through forward + backward
    }


def finish_scalar_run(session: ScalarSession, model, summary: dict[str, Any]) -> None:
    """Save ``final/`` and ``summary.json`` (main process), close the run, write the report
    (:func:`rlhfkit.trainers.common.finish_run`)."""
    run = session.run
    common.finish_run(run, session.accelerator, summary, session.tokenizer, model, session.save_dtype)
