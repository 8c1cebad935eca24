"""The first optimizer step of every trainer, in float64, on however many processes this runs on.

Run in-process for one process (:func:`run_cases`), or under ``torchrun --nproc_per_node 2 -m
tests.distributed.worker ROOT OUT`` for two (with the ``sharded-*`` cases: FSDP2, two processes only). Each case trains through the trainers' own code (the offline
loop with the SFT, reward and PRM objectives; stages 3-5 of the online loop on a fixed rollout) and the main
process writes, per case, ``OUT/<case>.safetensors`` (``grad.<param>``: the gradient each optimizer sees at
its first step, after the all-reduce, unclipped: clipping would hide a gradient's scale; ``weight.<param>``:
the weights after that step) and
``OUT/<case>.json`` (metrics); an online case adds ``final.<param>``, the weights after the whole update. A ``control-*`` case plants a known data-parallel bug, so that the
comparison can be shown to fail.

The online cases build one global rollout of ``train.batch_size x group_size`` responses from seeded
tensors (the same on every process) and give each process its rows, as :func:`prompt_batch` does: sampling
noise, the one thing that depends on the process count, is left out.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from rlhfkit.algos import ADVANTAGE_ESTIMATORS, gae_advantages, shape_rewards
from rlhfkit.config import load_config
from rlhfkit.data import PRMCollator, SFTCollator, TokenLimits, prepare_examples
from rlhfkit.engine import sharded
from rlhfkit.engine.accel import make_accelerator
from rlhfkit.engine.folder import RunDir
from rlhfkit.engine.seed import seed_everything
from rlhfkit.models import (
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    logprobs_from_logits,
    response_logits,
)
from rlhfkit.trainers.best_model import BestKeeper
from rlhfkit.trainers.dpo import DPOCollator, dpo_objective
from rlhfkit.trainers.offline import train_offline
from rlhfkit.trainers.online import collect, ppo_update, shaping
from rlhfkit.trainers.online import context as online_context
from rlhfkit.trainers.online import metrics as online_metrics
from rlhfkit.trainers.online import sharding as online_sharding
from rlhfkit.trainers.online.collect import Scores
from rlhfkit.trainers.preference_data import PairCollator
from rlhfkit.trainers.prm import prm_objective
from rlhfkit.trainers.reward import reward_objective
from rlhfkit.trainers.sft import sft_objective
from rlhfkit.types import Rollout

OFFLINE = ("sft", "reward", "prm", "dpo", "control-sft-local-normalizer")
ONLINE = (
    "ppo-token-mean",
    "ppo-seq-mean-token-mean",
    "ppo-seq-mean-token-sum-norm",
    "grpo",
    "reinforce_pp",
    "control-ppo-local-whitening",
    "control-ppo-local-normalizer",
)
SHARDED = {  # a sharded case (two processes only): (train.sharding, train.frozen_models)
    "sharded-ppo-token-mean": ("full_shard", "shard"),
    "sharded-ppo-seq-mean-token-mean": ("shard_grad_op", "shard"),
    "sharded-ppo-seq-mean-token-sum-norm": ("full_shard", "replicate"),
    "sharded-grpo": ("full_shard", "shard"),
    "control-sharded-ppo-local-normalizer": ("full_shard", "shard"),
    "sharded-dpo": ("full_shard", "shard"),
    "control-sharded-dpo-local-normalizer": ("full_shard", "shard"),
}
CASES = OFFLINE + ONLINE + tuple(SHARDED)
TWO_ONLY = tuple(c for c in CASES if c.startswith("control-") or c in SHARDED)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a sharded one (a collective: every process calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class FirstStep:
    """Records, through torch's global optimizer hooks, each optimizer's gradients before its first step and
    its parameters after it."""

    def __init__(self, models: dict[str, torch.nn.Module]):
        self.names = {id(p): f"{role}.{n}" for role, m in models.items() for n, p in m.named_parameters()}
        self.grads: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.seen: set[int] = set()
        self.handles = [
            register_optimizer_step_pre_hook(self._before),
            register_optimizer_step_post_hook(self._after),
        ]

    def _params(self, optimizer):
        return [p for g in optimizer.param_groups for p in g["params"]]

    def _before(self, optimizer, args, kwargs):
        if id(optimizer) not in self.seen:
            for p in self._params(optimizer):
                if p.grad is not None:
                    self.grads[self.names[id(p)]] = _full(p.grad.detach()).clone()

    def _after(self, optimizer, args, kwargs):
        if id(optimizer) not in self.seen:
            self.seen.add(id(optimizer))
            for p in self._params(optimizer):
                self.weights[self.names[id(p)]] = _full(p.detach()).clone()

    def close(self) -> dict[str, torch.Tensor]:
        for h in self.handles:
            h.remove()
        return {
            **{f"grad.{k}": v for k, v in self.grads.items()},
            **{f"weight.{k}": v for k, v in self.weights.items()},
        }


def _offline(case: str, root: Path, out: Path, accelerator) -> tuple[dict, dict]:
    sharding = SHARDED.get(case, ("none",))[0]
    kind = case.removeprefix("control-").removeprefix("sharded-").split("-")[0]
    data = root / kind
    if kind == "dpo":  # the SFT problem's causal LM on the reward problem's preference pairs
        data = root / "reward"
    cfg = load_config(
        None,
        [
            f"output_dir={out / 'runs' / case}",
            f"model.name_or_path={(root / 'sft' if kind == 'dpo' else data) / 'model'}",
            f"data.train_file={data / 'train.jsonl'}",
            f"train.sharding={sharding}",
            "train.max_steps=1",
            "train.batch_size=8",
            "train.micro_batch_size=2",
            "train.learning_rate=1e-2",
            "train.max_grad_norm=null",
            "data.max_prompt_length=16",
            "data.max_length=40",
        ],
        kind,
    )
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    pad, device = tokenizer.pad_token_id, accelerator.device
    limits = TokenLimits(cfg.data.max_prompt_length, cfg.data.max_length, cfg.data.truncation)
    run = RunDir(cfg.output_dir, overwrite=True, main_process=accelerator.is_main_process)
    if kind == "sft":
        examples = prepare_examples(cfg.data.train_file, "sft", tokenizer, limits)
        model = load_causal_lm(data / "model", dtype=torch.float64, tokenizer=tokenizer)
        objective = sft_objective(SFTCollator(pad), None, 8, device)
    elif kind == "dpo":  # the policy and its frozen reference, sharded like the trainer shards them
        examples = prepare_examples(cfg.data.train_file, "preferences", tokenizer, limits)
        model = load_causal_lm(cfg.model.name_or_path, dtype=torch.float64, tokenizer=tokenizer)
        reference = load_causal_lm(cfg.model.name_or_path, dtype=torch.float64, tokenizer=tokenizer)
        reference.eval().requires_grad_(False)
        if sharding != "none":
            sharded.shard_model(reference, sharding)
            sharded.shard_model(model, sharding)  # before the recorder names its parameters
        objective = dpo_objective(cfg, DPOCollator(pad), reference, None, device)
    else:
        examples = prepare_examples(
            cfg.data.train_file, "preferences" if kind == "reward" else "prm", tokenizer, limits
        )
        model = load_scalar_model(data / "model", dtype=torch.float64, tokenizer=tokenizer)
        keeper = BestKeeper(run.path / "best", keep_existing=False, main_process=accelerator.is_main_process)
        counters = {"tokens": 0.0, "eval_seconds": 0.0}
        objective = (
            reward_objective(cfg, PairCollator(pad, cfg.reward.margin), None, keeper, device, counters, {})
            if kind == "reward"
            else prm_objective(cfg, PRMCollator(pad), None, keeper, device, counters)
        )
    if case.startswith("control-"):  # the bug: each process normalises by its own share of the batch
        whole, rank, world = objective.normalizer, accelerator.process_index, accelerator.num_processes
        objective.normalizer = lambda batch: whole(batch[rank::world])
    recorder = FirstStep({"model": model.to(device)})
    train_offline(cfg, run, model, examples, objective, accelerator)
    run.close()
    metrics = (
        {
            k: v
            for k, v in json.loads((run.path / "metrics.jsonl").read_text().splitlines()[-1]).items()
            if not k.startswith("time/")
        }
        if accelerator.is_main_process
        else {}
    )
    return recorder.close(), metrics


def _global_rollout(ctx, examples) -> Rollout:
    """This process's rows of one seeded global rollout, with log-probs and values near the models' own."""
    first, local, total = ctx.rows()
    batch = collect.prompt_batch(ctx, examples, step=1)
    g = torch.Generator().manual_seed(7)
    width = 6
    response_ids = torch.randint(4, len(ctx.tokenizer), (total, width), generator=g)
    lengths = torch.randint(1, width + 1, (total,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]  # (total, T)
    mask[3] = False  # a response left out of every loss (missing_eos=mask): alone in its group
    noise = torch.randn(3, total, width, generator=g, dtype=torch.float64)
    scores = torch.randn(total, generator=g, dtype=torch.float64)
    rows = slice(first, first + local)
    mask, response_ids = mask[rows], response_ids[rows]
    ids, attn, start, w = online_context.model_inputs(
        batch["query_ids"], batch["query_mask"], response_ids, mask
    )
    with torch.no_grad():
        logprobs = torch.zeros(local, width, dtype=torch.float64)
        logprobs[:, :w] = logprobs_from_logits(
            response_logits(ctx.roles.actor, ids, attn, start),
            response_ids[:, :w],
            ctx.cfg.online.temperature,
        )
        values = None
        if ctx.roles.critic is not None:
            values = torch.zeros(local, width, dtype=torch.float64)
            values[:, :w] = online_context.critic_values(ctx.roles.critic, ids, attn, start).double()
            values = torch.where(mask, values + 0.3 * noise[2, rows], 0.0)
    old = torch.where(mask, logprobs + 0.1 * noise[0, rows], 0.0)  # ratios away from 1: some clipping
    ref = torch.where(mask, logprobs + 0.2 * noise[1, rows], 0.0)
    return Rollout(
        query_ids=batch["query_ids"],
        query_mask=batch["query_mask"],
        response_ids=response_ids,
        mask=mask,
        logprobs=old,
        ref_logprobs=ref,
        values=values,
        group_ids=batch["group_ids"],
        ended=torch.ones(local, dtype=torch.bool),
        scores=scores[rows],
    )


def _online(case: str, root: Path, out: Path, accelerator) -> tuple[dict, dict]:
    data, label = root / "online", case
    sharding, frozen = SHARDED.get(case, ("none", "shard"))
    control, case = case.startswith("control-sharded-"), case.removeprefix("control-sharded-")
    case = ("control-" if control else "") + case.removeprefix("sharded-")
    estimator = {"grpo": "grpo", "reinforce_pp": "reinforce_pp"}.get(case, "gae")
    mode = case.removeprefix("ppo-") if case.startswith("ppo-") else "token-mean"
    # 8 responses, rows 0-3 on the first process. GAE's layout moves rows: with 2 minibatches the first is rows
    # {2, 5, 6, 7} (1 + 3 rows). The group estimators' moves whole groups (rlhfkit.trainers.online.layout): the
    # first is groups {1, 0} = rows 0-3, the second rows 4-7, so each process joins one step's all-reduce with
    # no row of its own
    minibatches = 2
    cfg = load_config(
        None,
        [
            f"output_dir={out / 'runs' / label}",
            f"model.name_or_path={data / 'policy'}",
            f"data.train_file={data / 'prompts.jsonl'}",
            f"online.reward_model={data / 'reward'}",
            "train.batch_size=4",
            "train.micro_batch_size=1",
            "online.group_size=2",
            "online.ppo_epochs=1",
            f"online.num_minibatches={minibatches}",
            "train.learning_rate=1e-2",
            "train.max_grad_norm=null",
            f"online.advantage_estimator={estimator}",
            f"online.loss_agg_mode={mode}",
            "online.response_length=6",
            "data.max_prompt_length=16",
            f"train.sharding={sharding}",
            f"train.frozen_models={frozen}",
        ],
        "grpo" if estimator == "grpo" else "ppo",
    )
    cfg.model.dtype = torch.float64
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    ctx = online_context.build_context(cfg, accelerator, tokenizer)
    examples = prepare_examples(cfg.data.train_file, "prompts", tokenizer, TokenLimits(16))
    rollout = _global_rollout(ctx, examples)
    rollout.rewards, rollout.kl = shape_rewards(
        rollout.scores,
        rollout.logprobs,
        rollout.ref_logprobs,
        rollout.mask,
        ctx.kl_ctl.value,
        cfg.online.kl_estimator,
    )
    if case == "control-ppo-local-whitening":  # the bug: each process whitens its own share of the rollout
        shaping.ADVANTAGE_ESTIMATORS = {
            **ADVANTAGE_ESTIMATORS,
            "gae": lambda *a, all_sum=None, **k: gae_advantages(*a, **k),
        }
    try:
        rollout.advantages, rollout.returns = shaping.estimate_advantages(ctx, rollout)
    finally:
        shaping.ADVANTAGE_ESTIMATORS = ADVANTAGE_ESTIMATORS
    if case == "control-ppo-local-normalizer":  # the bug: each process normalises by its own tokens
        ctx = dataclasses.replace(ctx, all_sum=lambda values: values.detach().double())
    online_sharding.reshard(ctx.roles)  # the sharded parameters registered again, for their names
    recorder = FirstStep({name: getattr(ctx.roles, name) for name in ctx.trained})  # unwrapped: plain names
    update = ppo_update.ppo_update(ctx, rollout, step=1)
    first, local, total = ctx.rows()
    scored = torch.ones(total, dtype=torch.bool)
    scored[3] = False  # the masked response, as if nothing had scored it: score/unscored counts it once
    scored = scored[first : first + local]
    rollout.response_mask, rollout.entropy = rollout.mask, torch.zeros_like(rollout.logprobs)
    stats = online_metrics.rollout_stats(
        ctx, rollout, Scores(rollout.scores, rollout.scores, {}, scored, None)
    )
    metrics = stats.merge(update.stats).means(ctx)
    if sharding != "none":  # which roles are sharded (train.frozen_models)
        for name in ("actor", "critic", "reference", "reward_model"):
            model = getattr(ctx.roles, name)
            if model is not None:
                metrics[f"sharded/{name}"] = float(sharded.is_sharded(model))
    last = {
        f"final.{name}.{k}": _full(p.detach()).clone()
        for name in ctx.trained
        for k, p in getattr(ctx.roles, name).named_parameters()
    }  # after every minibatch's step
    return {**recorder.close(), **last}, metrics


def run_cases(root: Path, out: Path, cases: tuple[str, ...] = CASES) -> None:
    """Run ``cases`` on this launch's processes; the main process writes the results into ``out``."""
    accelerator = make_accelerator(cpu=True)
    out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        offline = case in OFFLINE or case.endswith("dpo") or case.endswith("dpo-local-normalizer")
        tensors, metrics = (_offline if offline else _online)(case, root, out, accelerator)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"{case}.safetensors"))
            (out / f"{case}.json").write_text(
                json.dumps({"world_size": accelerator.num_processes, **metrics})
            )


if __name__ == "__main__":
    from rlhfkit.engine.accel import end_processes

    torch.set_num_threads(1)
    run_cases(Path(sys.argv[1]), Path(sys.argv[2]))
    end_processes()
