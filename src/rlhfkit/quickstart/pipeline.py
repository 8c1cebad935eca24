"""The quickstart: the whole classic-RLHF pipeline on the built-in offline task, by calling the trainers.

    rlhfkit quickstart [--out DIR] [--preset tiny|small]

Stages (Ouyang et al. 2022, figure 2), each in its own run folder under ``DIR``:

1. ``task/``    the task written to disk: tokenizer, a fresh model of the preset, SFT data, prompt splits;
2. ``sft/``     supervised fine-tuning on the task's corpus (``rlhfkit train sft``);
3. ``pairs/``   pairs of samples from the SFT policy on training prompts, labelled by the task's noisy
                annotators (Bradley-Terry noise on the gold score);
4. ``reward/``  the reward model on those pairs (``rlhfkit train reward``), normalised on SFT samples;
5. ``ppo/``     PPO against the reward model (``rlhfkit train ppo``), logging the gold score on
                held-out prompts beside the proxy as it goes (the reward-hacking meter);
6. ``dpo/``     DPO on the same pairs from the same SFT policy (``rlhfkit train dpo``,
                :mod:`rlhfkit.quickstart.dpo_stage`): the next chapter's baseline, no reward model;
7. evaluation   SFT, DPO and PPO policies on held-out prompts: gold and proxy scores, KL, the gold win rate
                over SFT (at the training temperature, and greedy);
8. report       ``summary.json``, ``report.html`` (every stage on one page), ``report.md`` with plots, and a
                table in the terminal.

This module holds no training code: only configurations, the order of the stages, and the evaluation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfkit.config import RefreshConfig, config_from
from rlhfkit.engine.metrics_writer import write_summary_json
from rlhfkit.quickstart.dpo_stage import comparison_rows, format_comparison
from rlhfkit.quickstart.stages import sft_stage
from rlhfkit.quickstart.summary import format_table, write_quickstart_report

STAGES = ("task", "SFT", "preference pairs", "reward model", "PPO", "DPO", "evaluation", "report")


@dataclass(frozen=True)
class Preset:
    """Sizes of one quickstart preset (model size and how long each stage trains)."""

    model: str
    sft_steps: int
    sft_batch: int
    sft_lr: float
    num_pairs: int
    num_eval_pairs: int
    rm_steps: int
    rm_batch: int
    rm_lr: float
    ppo_rollouts: int
    ppo_batch: int
    ppo_lr: float
    response_length: int
    num_eval_prompts: int


# The tiny preset's reward model and PPO, and why (docs/experiments.md, seeds 0-4): with 2,048 pairs
# the reward model memorises the labels' noise (train accuracy 0.91 against a Bayes ceiling of 0.90, held-out
# loss rising after step 150) and reaches 0.73-0.83 against gold; with 6,144 pairs, whether it learns the
# sentiment term (the prompt's requested side against the review's) was a lottery at a 10-step warm-up (per
# seed 0.73-0.94, sentiment-only pairs at chance when it fails); a warm-up of a fifth of the steps kept the SFT
# backbone's features through the first updates and fixed every failing case tried. PPO's learning rate 2e-4
# lifted the two seeds whose win rate over SFT stayed under 0.80 at 1e-4.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        model="tiny",
        sft_steps=300,
        sft_batch=32,
        sft_lr=3e-3,
        num_pairs=6144,
        num_eval_pairs=512,
        rm_steps=300,
        rm_batch=64,
        rm_lr=5e-4,
        ppo_rollouts=40,
        ppo_batch=32,
        ppo_lr=2e-4,
        response_length=48,
        num_eval_prompts=256,
    ),
    "small": Preset(
        model="small",
        sft_steps=1500,
        sft_batch=64,
        sft_lr=5e-4,
        num_pairs=8192,
        num_eval_pairs=2048,
        rm_steps=600,
        rm_batch=64,
        rm_lr=1e-4,
        ppo_rollouts=200,
        ppo_batch=64,
        ppo_lr=1e-5,
        response_length=64,
        num_eval_prompts=384,
    ),
    # For the test suite: every stage runs, none long enough to learn much.
    "smoke": Preset(
        model="tiny",
        sft_steps=8,
        sft_batch=16,
        sft_lr=2e-3,
        num_pairs=64,
        num_eval_pairs=64,
        rm_steps=4,
        rm_batch=16,
        rm_lr=5e-4,
        ppo_rollouts=2,
        ppo_batch=8,
        ppo_lr=3e-5,
        response_length=24,
        num_eval_prompts=16,
    ),
}


def _stage(index: int, name: str, detail: str = "") -> float:
    print(f"[{index}/{len(STAGES)}] {name}{': ' + detail if detail else ''}", flush=True)
    return time.perf_counter()


def quickstart(
    out_dir: str | Path, preset: str = "tiny", overwrite: bool = False, seed: int = 0, refresh_steps: int = 0
) -> dict[str, Any]:
    """Run every stage into ``out_dir``; write ``summary.json`` and ``report.md``; return the summary.

    ``refresh_steps`` = K > 0: during PPO, every K rollouts the reward model is refreshed on new pairs
    from the current policy, labelled by the task's annotators (:func:`task_refresh`).
    """
    from rlhfkit.quickstart.dpo_stage import DPO_PRESETS, dpo_stage
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files
    from rlhfkit.trainers import online, reward, sft

    p = PRESETS[preset]
    out = Path(out_dir)
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    task = get_task("reviews", seed=seed)

    t = _stage(1, "task", f"'{task.name}', preset {preset} ({p.model} model)")
    files = prepare_task_files(task, out / "task", p.model, num_sft_eval=min(256, p.num_eval_prompts))
    seconds["task"] = time.perf_counter() - t

    t = _stage(2, "SFT", f"{p.sft_steps} steps of {p.sft_batch} examples")
    sft.train(config_from("sft", out / "sft", sft_settings(files, p, seed)))
    sft_dir = out / "sft" / "final"
    seconds["sft"] = time.perf_counter() - t

    t = _stage(
        3, "preference pairs", f"{p.num_pairs} pairs from the SFT policy, labelled by noisy annotators"
    )
    labels = sample_pairs(out / "pairs", task, sft_dir, p, seed)
    seconds["pairs"] = time.perf_counter() - t

    t = _stage(4, "reward model", f"{p.rm_steps} steps of {p.rm_batch} pairs")
    rm_cfg = config_from("reward", out / "reward", reward_settings(sft_dir, labels["paths"], p, seed))
    rm_summary = reward.train(rm_cfg)
    rm_dir = out / "reward" / "final"
    seconds["reward_model"] = time.perf_counter() - t

    t = _stage(5, "PPO", f"{p.ppo_rollouts} rollouts of {p.ppo_batch} prompts x {p.response_length} tokens")
    meter = HackingMeter(
        task, sft_dir, rm_dir, files["prompts_eval"], p, seed, meter_prompts=min(64, p.num_eval_prompts)
    )
    ppo_cfg = config_from(
        "ppo", out / "ppo", ppo_settings(sft_dir, rm_dir, files["prompts_train"], p, seed, refresh_steps)
    )
    hooks = online.OnlineHooks(evaluate=meter.during_training)
    if refresh_steps:
        pairs = labels["paths"]["train"]
        hooks.refresh_reward_model = task_refresh(task, meter, pairs, p, seed, config=ppo_cfg.refresh)
    online.train(ppo_cfg, hooks=hooks)
    seconds["ppo"] = time.perf_counter() - t

    d = DPO_PRESETS[preset]
    t = _stage(6, "DPO", f"{d.steps} steps of {d.batch} pairs (the reward model's pairs), beta {d.beta}")
    dpo_summary = dpo_stage(out / "dpo", preset, seed, sft_dir, labels["paths"], p.response_length)
    seconds["dpo"] = time.perf_counter() - t

    t = _stage(7, "evaluation", f"SFT, DPO and PPO on {p.num_eval_prompts} held-out prompts")
    evaluation = meter.compare(out / "ppo" / "final", out / "dpo" / "final")
    seconds["evaluation"] = time.perf_counter() - t

    t = _stage(8, "report")
    summary = {
        "preset": preset,
        "seed": seed,
        "refresh_steps": refresh_steps,
        "sft": evaluation["sft"],
        "reward_model": {
            "heldout_accuracy": rm_summary.get("heldout_gold_accuracy"),
            "heldout_accuracy_vs_labels": rm_summary.get("heldout_accuracy"),
            "bayes_ceiling": rm_summary.get("bayes_ceiling"),
            "train_pairs": labels.get("train", {}).get("pairs"),
        },
        "ppo": evaluation["ppo"],
        "dpo": evaluation["dpo"],
        "dpo_training": {k: v for k, v in dpo_summary.items() if k.startswith("heldout_")},
        "examples": evaluation["examples"],
        "win_rate_vs_sft": evaluation["win_rate_vs_sft"],
        "win_rate_vs_sft_greedy": evaluation["win_rate_vs_sft_greedy"],
        "dpo_win_rate_vs_sft": evaluation["dpo_win_rate_vs_sft"],
        "dpo_win_rate_vs_sft_greedy": evaluation["dpo_win_rate_vs_sft_greedy"],
        "stage_seconds": seconds,
    }
    summary["wall_seconds"] = time.perf_counter() - start
    write_summary_json(out / "summary.json", summary)
    write_quickstart_report(out, summary)
    print(format_table(summary), flush=True)
    print("\n" + format_comparison(comparison_rows(summary)), flush=True)
    return summary


def sft_settings(files: dict[str, Path], p: Preset, seed: int) -> dict[str, Any]:
    """The SFT stage's keys: ``p``'s steps, batch and learning rate from the task's initial model."""
    return {
        "seed": seed,
        **sft_stage(files, p.sft_steps, p.sft_batch, p.sft_lr),
        "data.max_prompt_length": 32,
        "data.max_length": 32 + p.response_length,
        "train.eval_steps": max(1, p.sft_steps // 3),
        "train.log_steps": 10,
    }


def sample_pairs(out: Path, task, sft_dir: Path, p: Preset, seed: int) -> dict[str, Any]:
    """``p.num_pairs`` (and ``p.num_eval_pairs`` held-out) pairs of samples from the SFT policy in ``out``,
    labelled by the task's noisy annotators (:func:`rlhfkit.rollout.pairs.label_pairs`'s summary)."""
    from rlhfkit.rollout.pairs import label_pairs

    return label_pairs(
        str(sft_dir),
        out,
        task=task.name,
        task_seed=seed,
        num_pairs=p.num_pairs,
        num_eval_pairs=p.num_eval_pairs,
        seed=seed,
        max_new_tokens=p.response_length,
    )


def reward_settings(sft_dir: Path, pairs: dict[str, Any], p: Preset, seed: int) -> dict[str, Any]:
    """The reward model's keys: from the SFT policy on the labelled pairs (``pairs``: their ``train`` and
    ``eval`` files)."""
    return {
        "seed": seed,
        "model.name_or_path": sft_dir,
        "data.train_file": pairs["train"],
        "data.eval_file": pairs["eval"],
        "data.max_prompt_length": 32,
        "data.max_length": 32 + p.response_length,
        "train.max_steps": p.rm_steps,
        "train.batch_size": p.rm_batch,
        "train.learning_rate": p.rm_lr,
        "train.weight_decay": 0.1,
        # a gentle start keeps the SFT backbone's features (the note above PRESETS)
        "train.warmup_steps": max(10, p.rm_steps // 5),
        "train.lr_schedule": "linear",
        "train.save_steps": p.rm_steps,
        "train.eval_steps": max(1, p.rm_steps // 4),
        "train.log_steps": 10,
    }


def ppo_settings(
    sft_dir: Path, rm_dir: Path | None, prompts: Path, p: Preset, seed: int, refresh_steps: int = 0
) -> dict[str, Any]:
    """PPO's keys: from the SFT policy against the reward model (the critic from it too; ``rm_dir`` None: the
    caller gives the reward and the critic) on the training prompts, ``p.ppo_rollouts`` rollouts of
    ``p.ppo_batch`` prompts, KL coefficient 0.1."""
    return {
        "seed": seed,
        "model.name_or_path": sft_dir,
        "data.train_file": prompts,
        "data.max_prompt_length": 32,
        **({"online.reward_model": rm_dir} if rm_dir is not None else {}),  # a None would read as a path
        "online.response_length": p.response_length,
        "train.max_steps": p.ppo_rollouts,
        "train.batch_size": p.ppo_batch,
        "train.learning_rate": p.ppo_lr,
        "online.kl_coef": 0.1,
        "train.lr_schedule": "linear",
        "train.save_steps": p.ppo_rollouts,
        "train.eval_steps": max(1, p.ppo_rollouts // 6),
        "train.log_steps": 1,
        "refresh.every": refresh_steps,
        "refresh.max_new_tokens": p.response_length,
    }


class HackingMeter:
    """Gold and proxy scores of a policy on held-out prompts: during PPO (a hook) and at the end (SFT vs PPO).

    The reward model is the proxy PPO optimises; the task's gold scorer is what the annotators actually
    want. Both are measured on the same samples, with the KL to the SFT policy (k1, nats per response).
    Without a reward model (``rm_dir`` None) there is no proxy figure.
    """

    def __init__(
        self,
        task,
        sft_dir: Path,
        rm_dir: Path | None,
        prompts_file: Path,
        preset: Preset,
        seed: int,
        temperature: float = 0.7,
        meter_prompts: int = 64,
    ):
        from rlhfkit.data import TokenLimits, prepare_examples
        from rlhfkit.models import load_causal_lm, load_scalar_model, load_tokenizer

        self.task, self.preset, self.seed, self.temperature = task, preset, seed, temperature
        self.tokenizer = load_tokenizer(str(sft_dir))
        self.reference = (
            load_causal_lm(str(sft_dir), tokenizer=self.tokenizer, frozen=True).eval().requires_grad_(False)
        )
        self.reward_model = (
            None
            if rm_dir is None
            else load_scalar_model(str(rm_dir), tokenizer=self.tokenizer, frozen=True)
            .eval()
            .requires_grad_(False)
        )
        examples = prepare_examples(
            str(prompts_file), "prompts", self.tokenizer, TokenLimits(32, None, "left")
        )
        self.examples = examples[: preset.num_eval_prompts]
        self.meter_examples = examples[:meter_prompts]

    def _measure(self, policy, examples, greedy: bool = False):
        from rlhfkit.rollout.evaluate import sample_and_score

        return sample_and_score(
            policy,
            self.tokenizer,
            examples,
            temperature=self.temperature,
            max_new_tokens=self.preset.response_length,
            greedy=greedy,
            reward_model=self.reward_model,
            reference=self.reference,
            gold_score=self.task.gold_score,
            is_valid=self.task.is_valid,
        )

    def during_training(self, policy, step: int) -> dict[str, float]:
        """The PPO ``evaluate`` hook: ``eval/gold/mean`` beside ``eval/score/mean`` (proxy) and ``eval/kl/mean``."""
        s = self._measure(policy, self.meter_examples).summary()
        figures = {
            "eval/gold/mean": s["gold_mean"],
            "eval/kl/mean": s["kl_mean"],
            "eval/valid_rate": s["valid_rate"],
            "eval/response_length/mean": s["response_length_mean"],
        }
        if "proxy_mean" in s:
            figures["eval/score/mean"] = s["proxy_mean"]
        return figures

    def sampled(self, policy):
        """``policy``'s samples on the held-out prompts at the meter's temperature, the global RNG seeded with
        the meter's seed first: every policy read by :meth:`compare` or :meth:`read` is sampled alike."""
        import torch

        torch.manual_seed(self.seed)
        return self._measure(policy, self.examples)

    def read(self, policy_dir: str | Path) -> dict[str, float]:
        """The held-out figures (``gold_mean``, ``gold_std``, ``valid_rate``, ``kl_mean``, and ``proxy_mean``
        with a reward model) of the policy saved in ``policy_dir``, sampled as :meth:`compare` samples."""
        from rlhfkit.models import load_causal_lm

        policy = load_causal_lm(str(policy_dir), tokenizer=self.tokenizer, frozen=True).eval()
        return self.sampled(policy).summary()

    def compare(self, ppo_dir: Path, dpo_dir: Path | None = None) -> dict[str, Any]:
        """SFT, PPO (and DPO) on the held-out prompts, sampled at the training temperature and greedy."""

        from rlhfkit.models import load_causal_lm
        from rlhfkit.rollout.evaluate import win_rate

        policies = {"sft": self.reference}
        for name, folder in (("ppo", ppo_dir), ("dpo", dpo_dir)):
            if folder is not None:
                policies[name] = load_causal_lm(str(folder), tokenizer=self.tokenizer, frozen=True).eval()
        out: dict[str, Any] = {}
        samples = {}
        for name, policy in policies.items():
            sampled = self.sampled(policy)
            greedy = self._measure(policy, self.examples, greedy=True)
            samples[name] = (sampled, greedy)
            figures = sampled.summary()
            figures.update({f"{k}_greedy": v for k, v in greedy.summary().items() if k != "kl_mean"})
            out[name] = figures
        out["sft"].pop("kl_mean", None)  # the reference against itself
        sft_std = out["sft"]["gold_std"]
        for name in policies.keys() - {"sft"}:
            gain = (out[name]["gold_mean"] - out["sft"]["gold_mean"]) / max(sft_std, 1e-8)
            out[name]["gold_gain_in_sft_std"] = gain
            prefix = "" if name == "ppo" else f"{name}_"
            out[f"{prefix}win_rate_vs_sft"] = win_rate(samples[name][0].gold, samples["sft"][0].gold)
            out[f"{prefix}win_rate_vs_sft_greedy"] = win_rate(samples[name][1].gold, samples["sft"][1].gold)
        out["examples"] = [
            {"prompt": p, **{name: samples[name][0].responses[i] for name in policies}}
            for i, p in enumerate(samples["sft"][0].prompts[:5])
        ]
        return out


def task_refresh(
    task,
    meter: HackingMeter,
    pairs_file: str | Path,
    preset: Preset,
    seed: int,
    config: RefreshConfig | None = None,
    **settings,
):
    """The online reward-model refresh (:mod:`rlhfkit.trainers.online.refresh`) on the task's annotators,
    replaying the reward model's training pairs; the meter's proxy follows the refreshed model (the trainer's
    own object). ``config``: the PPO run's ``refresh`` section; without it, one with the preset's response
    length and ``settings`` (:class:`rlhfkit.config.RefreshConfig` fields)."""
    from rlhfkit.data import load_dataset_records
    from rlhfkit.trainers.online.refresh import RewardRefresh

    if config is None:
        config = RefreshConfig(**{"max_new_tokens": preset.response_length, **settings})
    return RewardRefresh(
        meter.tokenizer,
        task.prompts("train"),
        task=task,
        initial_pairs=load_dataset_records(str(pairs_file), "preferences"),
        config=config,
        seed=seed,
        on_refresh=lambda reward_model: setattr(meter, "reward_model", reward_model),
    )
