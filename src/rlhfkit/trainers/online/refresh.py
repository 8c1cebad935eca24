"""Online reward-model refresh: new preference pairs from the current policy, and more Bradley-Terry steps.

The third defence against reward hacking, after the KL penalty and diverse data: the reward model is
only accurate near the responses it was trained on, and PPO walks away from them. Every ``K`` rollouts
(``refresh.every``: the ``refresh`` section, :class:`rlhfkit.config.RefreshConfig`) a :class:`RewardRefresh`
(the ``refresh_reward_model`` hook of :class:`rlhfkit.trainers.online.OnlineHooks`):

1. **samples** two responses per prompt from the current policy on ``refresh.pairs`` training
   prompts (:func:`rlhfkit.rollout.pairs.sample_response_pairs`; identical or empty pairs dropped);
2. **labels** them: a built-in task's noisy annotators (:func:`rlhfkit.rollout.pairs.annotate_records`,
   with the gold fields), or a user's function ``(prompt, a, b) -> bool`` (True: ``a`` is preferred);
3. **measures** the reward model as it is on these pairs before it learns from them (accuracy against the
   labels and, with a task, against gold: how far the proxy has drifted where the policy now samples);
4. **accumulates** them with the earlier ones (the hook's ``state_dict()``: the pairs as plain data, so
   the online trainer's checkpoints carry them);
5. **trains** the reward model in place for ``refresh.steps`` AdamW steps of Bradley-Terry loss
   (:func:`rlhfkit.trainers.reward.pair_loss`, the reward trainer's loss) on batches drawn from the
   accumulated pairs: a ``fresh_fraction`` share from the pairs collected by refreshes, the rest from
   the initial pairs the reward model was trained on (replay, so that it does not forget them);
6. **re-fits the normalisation** (gain, bias in the model's config; :func:`rlhfkit.trainers.reward.fit_normalization`)
   on a fixed anchor set of responses (the first ``normalize_max_pairs`` initial pairs, else those of the
   first refresh), so that the scale PPO's KL coefficient is tuned against stays fixed: anchor responses
   keep mean 0 and std 1.

Related work: Christiano et al. 2017 and Ziegler et al. 2019 ("online" labelling) collect comparisons
from the current policy throughout training; Bai et al. 2022 ("iterated online RLHF") retrain the
preference model on the current policy's samples; Gao et al. 2022 measure the over-optimization it
counters. The optimizer is a fresh AdamW at every refresh (moments of an earlier reward landscape carry
little over, and the hook's state stays plain data).

Determinism: every random choice (prompts, sampling, annotators, batches) is a stateless function of
(seed, rollout step), and the global RNG streams are restored afterwards, so a resumed run (the trainer
restores the reward model's weights and this state) refreshes bit-identically. Under data parallelism
each process runs the same refresh on the same data and so holds the same reward model.

Shapes: ``B`` pairs, ``L`` prompt + response length.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence

import torch

from rlhfkit.config import RefreshConfig
from rlhfkit.data import TokenLimits, tokenize_preference
from rlhfkit.data.records import FieldError
from rlhfkit.engine.optim import build_optimizer
from rlhfkit.errors import ConfigError, UserError
from rlhfkit.models import unwrap_model
from rlhfkit.rollout.pairs import SampledPair, annotate_records, drop_uninformative, sample_response_pairs
from rlhfkit.rollout.scoring import BIAS_KEY, GAIN_KEY
from rlhfkit.trainers.online.context import derived_seed
from rlhfkit.trainers.preference_data import PairCollator, heldout_metrics
from rlhfkit.trainers.reward import fit_normalization, pair_loss, pair_scores, score_examples

LabelFunction = Callable[[str, str, str], bool]


class RewardRefresh:
    """The ``refresh_reward_model`` hook: ``(policy, reward_model, step) -> metrics`` (module docstring).

    Args:
        tokenizer: the policy's tokenizer (the reward model reads the same token ids).
        prompts: training prompts to sample from (plain strings, as the task's).
        task: a built-in task whose annotators label the pairs, or None with ``label_fn``.
        label_fn: ``(prompt, a, b) -> bool``, True when ``a`` is preferred, or None with ``task``.
        initial_pairs: the pairs the reward model was trained on (preference records, e.g. the rows of
            ``pairs_train.jsonl``); replayed during refreshes and the anchor of the normalisation.
        config: :class:`RefreshConfig` (default: its defaults).
        seed: with the rollout step, seeds every random choice.
        limits: token limits for the pairs (default: none, prompts are never cut).
        on_refresh: called with the reward model after every refresh (e.g. to hand it to an evaluator
            that keeps its own reference to the proxy).
    """

    def __init__(
        self,
        tokenizer,
        prompts: Sequence[str],
        *,
        task=None,
        label_fn: LabelFunction | None = None,
        initial_pairs: Sequence[dict] = (),
        config: RefreshConfig | None = None,
        seed: int = 0,
        limits: TokenLimits | None = None,
        on_refresh: Callable[[torch.nn.Module], None] | None = None,
    ):
        if (task is None) == (label_fn is None):
            raise ConfigError(
                "a reward-model refresh needs exactly one labeller: a task's annotators or a "
                "labelling function (prompt, a, b) -> bool"
            )
        if not prompts:
            raise ConfigError("a reward-model refresh needs training prompts to sample from")
        self.tokenizer, self.prompts, self.task, self.label_fn = tokenizer, list(prompts), task, label_fn
        self.config, self.seed, self.on_refresh = config or RefreshConfig(), int(seed), on_refresh
        self.limits = limits or TokenLimits()
        self.collate = PairCollator(tokenizer.pad_token_id)
        self.initial = [self._tokenize(r, f"initial pair {i}") for i, r in enumerate(initial_pairs)]
        self.collected: list[dict] = []  # records of the pairs labelled by refreshes, in order
        self._collected_examples: list[dict] = []
        self.calls: list[int] = []
        self.anchor_size: int | None = None  # pairs of the normalisation's anchor set, fixed at first use

    # --- state (checkpointed by the online trainer) --------------------------------------------------
    def state_dict(self) -> dict:
        """The pairs labelled so far (plain records) and the steps of the refreshes."""
        return {
            "pairs": [dict(r) for r in self.collected],
            "calls": list(self.calls),
            "anchor_size": self.anchor_size,
        }

    def load_state_dict(self, state: dict) -> None:
        self.collected = [dict(r) for r in state["pairs"]]
        self._collected_examples = [
            self._tokenize(r, f"collected pair {i}") for i, r in enumerate(self.collected)
        ]
        self.calls = [int(s) for s in state["calls"]]
        self.anchor_size = state["anchor_size"]

    # --- the hook ----------------------------------------------------------------------------------
    def __call__(
        self,
        policy: torch.nn.Module,
        reward_model: torch.nn.Module,
        step: int,
        generate: Callable | None = None,
    ) -> dict[str, float]:
        """One refresh after rollout ``step``; ``generate`` samples the pairs (the trainer passes its vLLM engine's
        under ``online.generation_backend=vllm``, :func:`rlhfkit.rollout.vllm_engine.engine_generate`)."""
        start = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            records = self.label(self.sample(policy, step, generate), step)
            examples = [self._tokenize(r, f"pair of rollout {step}") for r in records]
            metrics = {
                f"refresh/{k}_before": v for k, v in self.measure(reward_model, examples, records).items()
            }
            self.collected += records
            self._collected_examples += examples
            self.calls.append(int(step))
            metrics.update(self.train(reward_model, step))
            metrics.update(self.renormalize(reward_model))
        metrics.update(
            {
                "refresh/new_pairs": len(records),
                "refresh/pairs": len(self.collected),
                "time/refresh": time.perf_counter() - start,
            }
        )
        if self.on_refresh is not None:
            self.on_refresh(reward_model)
        return metrics

    def sample(
        self, policy: torch.nn.Module, step: int, generate: Callable | None = None
    ) -> list[SampledPair]:
        """``config.pairs`` prompts (without repeats when there are enough) and two responses each, sampled by
        ``generate`` (None: Hugging Face ``generate`` on ``policy``)."""
        rng = random.Random(derived_seed("refresh-prompts", self.seed, step))
        count = self.config.pairs
        picked = (
            rng.sample(self.prompts, count)
            if count <= len(self.prompts)
            else [rng.choice(self.prompts) for _ in range(count)]
        )
        pairs = sample_response_pairs(
            policy,
            self.tokenizer,
            picked,
            max_new_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature,
            batch_size=self.config.sample_batch_size,
            seed=derived_seed("refresh-sampling", self.seed, step),
            generate=generate,
        )
        return drop_uninformative(pairs)[0]

    def label(self, pairs: list[SampledPair], step: int) -> list[dict]:
        """Preference records for ``pairs``: the task's annotators (with gold fields) or ``label_fn``."""
        if self.task is not None:
            return annotate_records(
                self.task, pairs, seed=derived_seed("refresh-annotators", self.seed, step)
            )
        records = []
        for p in pairs:
            a_preferred = self.label_fn(p.prompt, p.a, p.b)
            if (
                not isinstance(a_preferred, bool) and type(a_preferred).__name__ != "bool_"
            ):  # numpy's bool too
                name = getattr(self.label_fn, "__name__", repr(self.label_fn))
                raise UserError(
                    f"the labelling function {name} returned {type(a_preferred).__name__} for the prompt "
                    f"{p.prompt!r}; it must return True when the first response is preferred, else False"
                )
            chosen, rejected = (p.a, p.b) if a_preferred else (p.b, p.a)
            records.append({"prompt": p.prompt, "chosen": chosen, "rejected": rejected})
        return records

    @torch.no_grad()
    def measure(
        self, reward_model: torch.nn.Module, examples: list[dict], records: list[dict]
    ) -> dict[str, float]:
        """The reward model's accuracy on ``examples`` against the labels (and gold, when known)."""
        if not examples:
            return {}
        device = next(reward_model.parameters()).device
        chosen, rejected = score_examples(
            reward_model, self.collate, examples, self.config.sample_batch_size, device
        )
        lengths = [torch.tensor([len(e[f"{side}_ids"]) for e in examples]) for side in ("chosen", "rejected")]
        gold = (None, None)
        if all(r.get("gold_chosen") is not None and r.get("gold_rejected") is not None for r in records):
            gold = tuple(
                torch.tensor([r[f] for r in records], dtype=torch.float64)
                for f in ("gold_chosen", "gold_rejected")
            )
        figures, _ = heldout_metrics(chosen, rejected, *lengths, torch.zeros(len(examples)), *gold)
        keep = ("accuracy", "gold_accuracy", "loss")
        return {k: v for k, v in figures.items() if k in keep and math.isfinite(v)}

    def batch(self, step: int, k: int) -> list[dict]:
        """Optimizer step ``k``'s pairs: ``fresh_fraction`` of them from the collected pairs, the rest from
        the initial ones, each drawn uniformly with replacement (a function of (seed, step, k))."""
        settings = self.config
        generator = torch.Generator().manual_seed(derived_seed("refresh-batch", self.seed, step, k))
        fresh, initial = self._collected_examples, self.initial
        n_fresh = (
            settings.batch_size
            if not initial
            else 0
            if not fresh
            else round(settings.batch_size * settings.fresh_fraction)
        )
        picks = (
            [fresh[i] for i in torch.randint(len(fresh), (n_fresh,), generator=generator).tolist()]
            if n_fresh
            else []
        )
        if settings.batch_size - n_fresh:
            picks += [
                initial[i]
                for i in torch.randint(
                    len(initial), (settings.batch_size - n_fresh,), generator=generator
                ).tolist()
            ]
        return picks

    def train(self, reward_model: torch.nn.Module, step: int) -> dict[str, float]:
        """``config.steps`` AdamW steps of the reward trainer's Bradley-Terry loss, in place."""
        settings = self.config
        if not settings.steps or not (self.initial or self._collected_examples):
            return {}
        device = next(reward_model.parameters()).device
        reward_model.requires_grad_(True)
        reward_model.train()
        optimizer = build_optimizer(
            reward_model.named_parameters(), settings.learning_rate, settings.weight_decay
        )
        losses, accuracies = [], []
        for k in range(settings.steps):
            pairs = self.batch(step, k)
            batch = {name: v.to(device) for name, v in self.collate(pairs).items()}
            chosen, rejected = pair_scores(reward_model, batch)  # (B,), (B,)
            loss, stats = pair_loss(
                chosen, rejected, batch["margin"], len(pairs), center_coef=settings.center_coef
            )
            loss.backward()
            if settings.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(reward_model.parameters(), settings.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            accuracies.append(stats["accuracy"])
        reward_model.eval()
        reward_model.requires_grad_(False)
        return {
            "refresh/loss": sum(losses) / len(losses),
            "refresh/train_accuracy": sum(accuracies) / len(accuracies),
        }

    @torch.no_grad()
    def renormalize(self, reward_model: torch.nn.Module) -> dict[str, float]:
        """Re-fit (gain, bias) on the anchor responses so that they keep mean 0 and std 1."""
        if self.anchor_size is None:  # fixed once: the initial pairs, else the first refresh's pairs
            self.anchor_size = min(
                len(self.initial or self._collected_examples), self.config.normalize_max_pairs
            )
        anchor = (self.initial or self._collected_examples)[: self.anchor_size]
        if not anchor:
            self.anchor_size = None  # nothing labelled yet: fix the anchor at the next refresh
            return {}
        device = next(reward_model.parameters()).device
        chosen, rejected = score_examples(
            reward_model, self.collate, anchor, self.config.sample_batch_size, device
        )
        gain, bias = fit_normalization(torch.cat([chosen, rejected]))
        config = unwrap_model(reward_model).config
        setattr(config, GAIN_KEY, gain)
        setattr(config, BIAS_KEY, bias)
        return {"refresh/gain": gain, "refresh/bias": bias}

    def _tokenize(self, record: dict, where: str) -> dict:
        try:
            return tokenize_preference(record, self.tokenizer, self.limits)
        except FieldError as error:  # e.g. a prompt over the limit
            raise UserError(
                f"reward-model refresh: {where}, field '{error.field}': {error.message}"
            ) from None


__all__ = ["LabelFunction", "RefreshConfig", "RewardRefresh"]
