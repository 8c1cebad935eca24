"""Direct Preference Optimization: the policy learns from preference pairs, with no reward model and no sampling.

DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward Model")
solves the KL-regularised objective of classic RLHF in closed form: the optimal policy of reward r with KL
strength beta is pi*(y|x) = pi_ref(y|x) exp(r(x, y) / beta) / Z(x), so r = beta log(pi / pi_ref) + beta log Z,
and the Bradley-Terry likelihood of the labels, written with that *implicit reward*, trains the policy
directly. Per pair, with the sequence log-ratios

    rho_w = log pi(y_w | x) - log pi_ref(y_w | x),   rho_l = the same for y_l,   h = rho_w - rho_l,

:func:`rlhfkit.algos.dpo_loss` (the one formula) gives ``dpo.loss``:

- ``sigmoid``: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h) (eq. 7; eps =
  ``dpo.label_smoothing``, conservative DPO, Mitchell 2023);
- ``ipo``: (h - 1 / (2 beta))^2 (Azar et al. 2023, eq. 17).

averaged over the pairs of the whole batch (the loop's normaliser), so micro-batching and data parallelism
do not change the gradient. Details:

- log pi(y | x) is the sum over the response tokens (EOS included) of the token log-probs, read with
  position ids from the attention mask (:func:`sequence_logprobs`): the same whatever the padding side;
  chosen and rejected go through ONE forward (the collator pads both sides to one length);
- the reference is frozen: ``dpo.reference_model``, by default the starting model (the SFT policy), loaded a
  second time; under LoRA (``model.lora_rank`` > 0) the policy itself with its adapter disabled
  (:class:`rlhfkit.models.AdapterDisabled`, no copy). Its log-probs are computed once per micro-batch under
  ``no_grad``; at step 1 policy == reference, so the sigmoid loss is ln 2 and the implicit reward accuracy
  1/2 (every pair a tie);
- logged per step: ``loss``, ``logratio/chosen`` and ``logratio/rejected`` (means of rho_w, rho_l),
  ``reward/chosen`` and ``reward/rejected`` (beta rho), ``accuracy`` (implicit reward of the chosen one
  higher; a tie counts 1/2) and ``margin`` (mean beta h);
- held-out pairs (``data.eval_file``) are evaluated at step 0 and every ``train.eval_steps``: the same figures
  and, when the records carry ``gold_chosen`` / ``gold_rejected`` (``rlhfkit label-pairs``), ``gold_accuracy``:
  how often the implicit reward orders a pair as the gold score does (gold ties left out).

``final/`` is the last step's policy (a LoRA run: merged, and ``final/adapter/``).

Launch:
    rlhfkit train dpo --config dpo.yaml                          # one process
    torchrun --standalone --nproc_per_node 2 -m rlhfkit.cli train dpo --config dpo.yaml   # data parallel
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from rlhfkit.algos import aggregate_loss, dpo_loss
from rlhfkit.config import RunConfig
from rlhfkit.data import PreferenceCollator, TokenLimits, prepare_run_data
from rlhfkit.engine import sharded
from rlhfkit.engine.accel import make_accelerator
from rlhfkit.engine.folder import open_run
from rlhfkit.engine.seed import seed_everything
from rlhfkit.models import (
    AdapterDisabled,
    is_peft_model,
    load_causal_lm,
    prepare_trained,
    response_readout,
)
from rlhfkit.trainers.common import finish_run, run_tokenizer
from rlhfkit.trainers.offline import Objective, train_offline
from rlhfkit.trainers.preference_data import GOLD_TIE, HeldOut, heldout_pairs

SIDES = ("chosen", "rejected")


class DPOCollator:
    """Tokenised pairs -> a :class:`rlhfkit.data.PreferenceCollator` batch (right padded, one length for both
    sides) plus ``chosen_response_mask`` / ``rejected_response_mask`` (B, L) bool: True on the response tokens
    (EOS included), aligned with the input ids."""

    def __init__(self, pad_token_id: int):
        self.pairs = PreferenceCollator(pad_token_id)

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        batch = self.pairs(examples)
        batch.pop("margin", None)  # a reward-model field; DPO has no margin
        for side in SIDES:
            mask = torch.zeros(batch[f"{side}_input_ids"].shape, dtype=torch.bool)
            for i, ex in enumerate(examples):
                start = len(ex["prompt_ids"])
                mask[i, start : start + len(ex[f"{side}_ids"])] = True
            batch[f"{side}_response_mask"] = mask
        return batch


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """log pi(response | prompt): the sum of the response tokens' log-probs.

    Args:
        input_ids, attention_mask: (B, L), prompt then response, padded on either side (position ids come
            from the attention mask, so the side changes nothing).
        response_mask: (B, L) bool, True on the response tokens; column 0 is never a response token.
    Returns:
        (B,) float32, differentiable; what sits at masked positions is never read.
    """
    # token j+1 from column j, chunked over the vocabulary (rlhfkit.models.head_chunks)
    logprobs = response_readout(model, input_ids, attention_mask, 1).logprobs  # (B, L-1)
    picked = response_mask[:, 1:].bool()
    return torch.where(picked, logprobs, torch.zeros_like(logprobs)).sum(-1)


def pair_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen (B,), rejected (B,)) sequence log-probs from ONE forward over ``cat([chosen, rejected])``."""
    ids, mask, response = (
        torch.cat([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])
        for k in ("input_ids", "attention_mask", "response_mask")
    )
    logps = sequence_logprobs(model, ids, mask, response)  # (2B,)
    n = batch["chosen_input_ids"].shape[0]
    return logps[:n], logps[n:]


def dpo_pair_loss(
    policy: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor],
    normalizer: float,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The DPO loss of one micro-batch of n pairs, divided by the whole batch's pair count N.

    Args:
        policy, reference: (chosen (n,), rejected (n,)) sequence log-probs.
        normalizer: N.
    Returns:
        (scalar loss, stats already multiplied by n / N so that the loop's sum over micro-batches is the
        step's mean).
    """
    per_pair, stats = dpo_loss(*policy, *reference, beta, label_smoothing, loss_type)  # (n,)
    ones = torch.ones_like(per_pair[:, None])
    loss = aggregate_loss(per_pair[:, None], ones, "token-mean", normalizer)
    share = per_pair.shape[0] / normalizer
    return loss, {
        "loss/dpo": float(loss.detach()),
        "accuracy": float(stats["accuracy"]) * share,
        "margin": float(stats["margin"]) * share,
        "reward/chosen": float(stats["reward_chosen"]) * share,
        "reward/rejected": float(stats["reward_rejected"]) * share,
        "logratio/chosen": float((policy[0] - reference[0]).detach().float().mean()) * share,
        "logratio/rejected": float((policy[1] - reference[1]).detach().float().mean()) * share,
    }


@torch.no_grad()
def all_pair_logprobs(model, collate, examples: list[dict], batch_size: int, device) -> torch.Tensor:
    """(n, 2) float64 on the CPU: the chosen and rejected sequence log-probs of every pair, in order."""
    out = torch.empty(len(examples), 2, dtype=torch.float64)
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = {k: v.to(device) for k, v in collate(chunk).items()}
        chosen, rejected = pair_logprobs(model, batch)
        out[start : start + len(chunk)] = torch.stack([chosen, rejected], 1).double().cpu()
    return out


def heldout_figures(
    policy: torch.Tensor,
    reference: torch.Tensor,
    beta: float,
    loss_type: str,
    label_smoothing: float,
    gold: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, float]:
    """The held-out figures from (n, 2) policy and reference log-probs (columns chosen, rejected).

    Returns:
        loss, accuracy (a tie 1/2), margin, reward/chosen, reward/rejected, logratio/chosen,
        logratio/rejected and, with ``gold`` ((n,), (n,)), gold_accuracy over the pairs whose gold scores
        differ (a tie of the implicit rewards 1/2) and gold_pairs (their count).
    """
    per_pair, stats = dpo_loss(
        policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1], beta, label_smoothing, loss_type
    )
    ratios = policy - reference  # (n, 2)
    out = {
        "loss": float(per_pair.mean()),
        "accuracy": float(stats["accuracy"]),
        "margin": float(stats["margin"]),
        "reward/chosen": float(stats["reward_chosen"]),
        "reward/rejected": float(stats["reward_rejected"]),
        "logratio/chosen": float(ratios[:, 0].mean()),
        "logratio/rejected": float(ratios[:, 1].mean()),
    }
    if gold is not None:
        diff = beta * (ratios[:, 0] - ratios[:, 1])  # (n,) implicit reward margin
        gold_diff = (gold[0] - gold[1]).double()  # (n,)
        untied = gold_diff.abs() > GOLD_TIE
        agree = (torch.sign(diff) == torch.sign(gold_diff)).double() + 0.5 * (diff == 0).double()
        out["gold_accuracy"] = float(agree[untied].mean()) if bool(untied.any()) else float("nan")
        out["gold_pairs"] = int(untied.sum())
    return out


def dpo_objective(
    cfg: RunConfig, collate: DPOCollator, reference, heldout: HeldOut | None, device
) -> Objective:
    """The DPO loss against ``reference`` and the held-out evaluation (reference log-probs of the held-out
    pairs computed once, at the first evaluation)."""
    dpo = cfg.dpo
    eval_batch = 4 * (cfg.train.micro_batch_size or cfg.train.batch_size)  # no activations kept
    cache: dict[str, torch.Tensor] = {}

    def loss(model, batch, normalizer):
        with torch.no_grad():
            ref = pair_logprobs(reference, batch)
        policy = pair_logprobs(model, batch)
        return dpo_pair_loss(
            policy, ref, normalizer, beta=dpo.beta, loss_type=dpo.loss, label_smoothing=dpo.label_smoothing
        )

    def evaluate(model, step):
        if heldout is None or not heldout.examples:
            return {}
        if "reference" not in cache:
            cache["reference"] = all_pair_logprobs(reference, collate, heldout.examples, eval_batch, device)
        policy = all_pair_logprobs(model, collate, heldout.examples, eval_batch, device)
        return heldout_figures(
            policy, cache["reference"], dpo.beta, dpo.loss, dpo.label_smoothing, heldout.gold
        )

    return Objective(collate=collate, loss=loss, normalizer=len, evaluate=evaluate)


def build_reference(cfg: RunConfig, model: torch.nn.Module, tokenizer, device) -> torch.nn.Module:
    """The frozen reference: ``dpo.reference_model`` when set, else under LoRA the policy with its adapter
    disabled, else a second load of ``model.name_or_path``."""
    model_cfg, source = cfg.model, cfg.dpo.reference_model
    if source is None and is_peft_model(model):
        return AdapterDisabled(model)
    if source is not None and source != model_cfg.name_or_path:
        from rlhfkit.models import check_same_vocabulary

        check_same_vocabulary(tokenizer, source, "dpo.reference_model", model_cfg.trust_remote_code)
    reference = load_causal_lm(
        source or model_cfg.name_or_path,
        trust_remote_code=model_cfg.trust_remote_code,
        dtype=model_cfg.dtype,
        tokenizer=tokenizer,
        frozen=True,
    )
    reference = reference.to(device).eval().requires_grad_(False)
    mode = sharded.sharding_mode(cfg)
    if mode != "none" and cfg.train.frozen_models == "shard":  # forward-only shards (train.frozen_models)
        sharded.shard_model(reference, mode)
    return reference


def train(cfg: RunConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run DPO as configured; write ``final/`` and ``summary.json``; return the summary."""
    seed_everything(cfg.seed)
    accelerator = make_accelerator(
        sharding=True, collective_timeout=cfg.train.collective_timeout
    )  # an accelerate FSDP config: sharded by train_offline
    # All data is read, validated and tokenised before any model is built or the run folder written.
    tokenizer = run_tokenizer(cfg)
    limits = TokenLimits(cfg.data.max_prompt_length, cfg.data.max_length, cfg.data.truncation)
    examples, heldout_examples = prepare_run_data(cfg.data, "preferences", tokenizer, limits, accelerator)
    heldout = heldout_pairs(heldout_examples) if heldout_examples is not None else None
    run = open_run(cfg, accelerator, resume, overwrite)

    model_cfg = cfg.model
    model = load_causal_lm(
        model_cfg.name_or_path,
        trust_remote_code=model_cfg.trust_remote_code,
        dtype=model_cfg.dtype,
        tokenizer=tokenizer,
        dropout=not model_cfg.disable_dropout,
    )
    model = prepare_trained(model, model_cfg).to(accelerator.device)  # LoRA / gradient checkpointing
    reference = build_reference(cfg, model, tokenizer, accelerator.device)
    collate = DPOCollator(tokenizer.pad_token_id)
    objective = dpo_objective(cfg, collate, reference, heldout, accelerator.device)
    if heldout is not None and run.resume_checkpoint is None:  # step 0: policy == reference
        model.eval()
        with torch.no_grad():
            run.metrics.log(0, {f"eval/{k}": v for k, v in objective.evaluate(model, 0).items()})
        model.train()
    start = time.perf_counter()
    result = train_offline(cfg, run, model, examples, objective, accelerator)

    summary = {
        "kind": "dpo",
        "steps": result["step"],
        "loss_type": cfg.dpo.loss,
        "beta": cfg.dpo.beta,
        "train_loss": result["loss"],
        "train_pairs": len(examples),
        "eval_pairs": len(heldout.examples) if heldout is not None else 0,
        **{f"heldout_{k.replace('/', '_')}": v for k, v in result["eval"].items()},
        "wall_seconds": time.perf_counter() - start,
        "pairs_per_second": result["examples_per_second"],
    }
    # result["model"]: a sharded policy gathered whole (train_offline)
    finish_run(
        run, accelerator, summary, tokenizer, accelerator.unwrap_model(result["model"]), model_cfg.save_dtype
    )
    return summary
