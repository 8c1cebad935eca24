"""The ``online`` section (generation, reward, KL, advantages and the PPO update of ppo / grpo / rloo) and the
``refresh`` section (the online reward-model refresh)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rlhfkit.config.fields import check_bounds, option
from rlhfkit.errors import ConfigError

if TYPE_CHECKING:  # the choices rlhfkit.algos declares; read by field_types (algos imports torch)
    from rlhfkit.algos import (
        AdvantageEstimator,
        DistillLoss,
        ImportanceSamplingLevel,
        KLEstimator,
        KLLossEstimator,
        LossAggregation,
    )


@dataclass
class OnlineConfig:
    """Online RL (ppo / grpo / rloo): generation, reward, KL, advantages and the PPO update."""

    reward_model: str | None = option(None, "Frozen reward model folder (from `rlhfkit train reward`).")
    reward_functions: list[str] = option(
        [], "Reward functions 'pkg.module:fn' or 'path/to/file.py:fn', added to the reward model's score."
    )
    reward_weights: list[float] | None = option(
        None,
        "One weight per reward function, in the order of reward_functions: the score is the reward model's "
        "score + the sum of weight * value (TRL's reward_weights); none = all 1. The reward model and an "
        "environment's get_reward() are added with weight 1.",
    )
    tools: list[str] = option(
        [],
        "Tools the policy may call, 'path/to/file.py:fn' or 'pkg.module:fn': functions with a type hint on every "
        "argument and an 'Args:' docstring (TRL's tools=); episodes then have several turns (docs/tools.md).",
    )
    environment: str | None = option(
        None,
        "'path/to/env.py:MakeEnv': a zero-argument callable returning one environment per episode, with "
        "reset(**row) -> str | None, its public methods as tools and an optional get_reward() -> float that "
        "is added to the score (TRL's environment_factory; docs/tools.md).",
    )
    max_turns: int = option(
        4, "Model turns per episode with tools or an environment (a turn that calls no tool ends it).", gt=0
    )
    tool_timeout: float = option(
        10.0,
        "Seconds a tool call may take (also an environment's reset and get_reward); a slower call's process is "
        "killed and the model reads a timeout error; with an environment the episode ends there (docs/tools.md).",
        gt=0,
    )
    tool_memory_mb: int = option(
        1024,
        "Memory (address space, MiB) an episode's tool process may add to what it had when it started, and "
        "the memory limit of each sandboxed run of model-written code (rlhfkit:python).",
        gt=0,
    )
    sandbox: Literal["bwrap", "none"] = option(
        "bwrap",
        "Where model-written code runs (the rlhfkit:python tool, rlhfkit:code_tests reward): bwrap = "
        "bubblewrap (no network, read-only root, fresh temp folder, own process namespace) with limits; none = "
        "a child process with limits only, warned in the log and the report (docs/tools.md).",
    )
    max_tool_response_length: int | None = option(
        256,
        "Most tokens of one tool result; a longer one is cut and says so. none = no limit. All turns and "
        "results of an episode together fit in response_length.",
        gt=0,
    )
    process_reward_model: str | None = option(
        None,
        "Process reward model folder (from `rlhfkit train prm`): P(step correct) - 1 on every step-end "
        "token of a response, beside the outcome score on its last token (rlhfkit.rollout.process_rewards); "
        "alone, with no outcome scorer, the step rewards are the whole reward.",
    )
    teacher_model: str | None = option(
        None,
        "On-policy distillation (Agarwal et al. 2024): a frozen teacher's folder or hub name, with the "
        "policy's vocabulary token for token. Each sampled token's reward gets -teacher_coef * (log pi(y_t) - "
        "log pi_teacher(y_t)), the per-token KL term with the teacher in the reference's place, in any run; "
        "`train distill` needs it (docs/algorithms.md, On-policy distillation).",
    )
    teacher_coef: float = option(
        1.0,
        "The weight of the teacher's per-token term (online.teacher_model) beside the task's score.",
        ge=0,
    )
    critic_model: str | None = option(
        None,
        "Initial critic (value model) for gae; none = the reward model, else the policy "
        "(Huang et al. 2024: critic initialised from the reward model).",
    )
    response_length: int = option(
        64,
        "Most tokens generated per response; with tools, of an episode's turns and tool results together.",
        gt=0,
    )
    temperature: float = option(
        0.7, "Sampling temperature; log-probs are computed at the same temperature (Huang et al. 2024).", gt=0
    )
    top_p: float = option(1.0, "Nucleus sampling threshold; 1 = off.", gt=0, le=1)
    top_k: int = option(0, "Sample from the k most likely tokens; 0 = off.", ge=0)
    stop_token: str | None = option(
        None, "Text of the token that ends a response; none = the tokenizer's EOS."
    )
    missing_eos: Literal["penalty", "mask", "none"] = option(
        "penalty",
        "A response that hits response_length without the stop token: its score is replaced by "
        "missing_eos_score (penalty), it is left out of the loss (mask), or it is scored as is.",
    )
    missing_eos_score: float = option(
        -1.0,
        "The score given to a response without the stop token under missing_eos=penalty "
        "(the 'EOS trick', Huang et al. 2024).",
    )
    kl_coef: float = option(0.05, "Initial coefficient of the per-token KL penalty in the reward.", ge=0)
    kl_estimator: KLEstimator = option(
        "k1",
        "Per-token KL estimator (Schulman, 'Approximating KL divergence'), used in the reward and logged.",
    )
    kl_in_loss: bool = option(
        False,
        "Put the KL to the reference in the loss, kl_coef * kl_loss_estimator per token (Shao et al. 2024, "
        "DeepSeekMath's GRPO), instead of -kl_coef * kl_t in the reward; kl_estimator is then what is logged.",
    )
    kl_loss_estimator: KLLossEstimator = option(
        "k2",
        "The KL loss term of kl_in_loss (rlhfkit.algos.kl_penalty_loss): k2 and k3_is have the gradient of "
        "KL(pi || pi_ref) in every PPO epoch (the importance ratio to pi_old corrects the later ones); k3 is "
        "the plain k3 loss, whose gradient is that of the reverse direction (Liu et al. 2025), kept to compare.",
    )
    kl_target: float | None = option(
        None,
        "Adaptive KL controller target, nats per response (Ziegler et al. 2019); none = fixed kl_coef.",
        gt=0,
    )
    kl_horizon: int = option(
        10000, "Adaptive KL controller horizon, in responses (Ziegler et al. 2019).", gt=0
    )
    advantage_estimator: AdvantageEstimator = option(
        "gae",
        "Advantage estimator: gae (PPO with a critic) or a critic-free one: grpo and rloo (set by `train grpo` "
        "/ `train rloo`), reinforce_pp (REINFORCE++, Hu 2025: `train ppo online.advantage_estimator="
        "reinforce_pp`).",
    )
    group_size: int = option(1, "Responses per prompt (critic-free grpo / rloo need at least 2).", gt=0)
    normalize_advantages: bool = option(
        True,
        "Normalise the advantages as the estimator defines it: gae and reinforce_pp whiten them over the "
        "valid tokens of the batch; grpo divides the group-centred scores by the group's std (Shao et al. "
        "2024; false = Dr. GRPO, Liu et al. 2025); rloo has no normalisation. Replaces norm_by_std (grpo) "
        "and whiten_advantages (gae, reinforce_pp), still read with a warning.",
    )
    advantage_eps: float = option(
        1.0e-6, "Added to standard deviations before dividing (grpo, whitening).", gt=0
    )
    gamma: float = option(1.0, "Discount factor.", ge=0, le=1)
    lam: float = option(0.95, "GAE lambda (Schulman et al. 2016).", ge=0, le=1)
    ppo_epochs: int = option(4, "Passes over each rollout batch.", gt=0)
    num_minibatches: int = option(1, "Optimizer steps per PPO epoch.", gt=0)
    old_logprobs_from_update: bool = option(
        True,
        "With one PPO epoch of one minibatch, take the old log-probs (and the logged entropy) from the update's "
        "own forward, detached, instead of a separate no-grad forward of the actor: the ratio is then 1 by "
        "construction and one actor forward per rollout is saved (TRL's GRPO does the same at "
        "num_iterations=1). Only where nothing reads the old log-probs before the update: the KL in the loss "
        "or kl_coef 0 (no adaptive target), no distillation teacher's sampled term in the rewards, the hf "
        "generation backend, after the critic warm-up. `train distill` with a full-vocabulary distill.loss "
        "then reads the student and the teacher in that one pass (no stage-1 read of either).",
    )
    epoch_stats: bool = option(
        False,
        "Also log clipfrac and approx_kl of each PPO epoch on its own (clipfrac/epoch1, approx_kl/epoch1, ...): "
        "how far each epoch has moved from pi_old (examples/experiments/ppo_epochs.py).",
    )
    clip_eps: float = option(0.2, "PPO policy ratio clip (Schulman et al. 2017, eq. 7).", gt=0)
    clip_eps_high: float | None = option(
        None,
        "Upper ratio clip, 1 + clip_eps_high (DAPO's clip-higher, Yu et al. 2025: e.g. 0.28 with clip_eps "
        "0.2); none = clip_eps (symmetric).",
        gt=0,
    )
    dual_clip: float | None = option(
        None,
        "Dual-clip constant c > 1 (Ye et al. 2020): the loss of a negative-advantage token is at most "
        "-A * c however large its ratio; none = off.",
        gt=1,
    )
    importance_sampling_level: ImportanceSamplingLevel = option(
        "token",
        "The policy loss's importance ratio: token (PPO's, one per token) or sequence (GSPO, Zheng et al. "
        "2025: the geometric mean of a response's token ratios, so that clip_eps, clip_eps_high and dual_clip "
        "act on whole responses; TRL's importance_sampling_level). The paper clips at 3e-4 / 4e-4 and averages "
        "per sequence (loss_agg_mode=seq-mean-token-mean). It changes nothing before the first optimizer step "
        "of a rollout, so it acts with ppo_epochs or num_minibatches above 1.",
    )
    value_clip_eps: float = option(0.2, "Value clip around the rollout's values.", gt=0)
    vf_coef: float = option(0.1, "Value-loss coefficient.", ge=0)
    ent_coef: float = option(0.0, "Entropy-bonus coefficient.", ge=0)
    loss_agg_mode: LossAggregation = option(
        "token-mean", "How per-token losses become a scalar (rlhfkit.algos.aggregate_loss)."
    )
    critic_learning_rate: float | None = option(
        None, "Critic learning rate; none = train.learning_rate.", gt=0
    )
    score_clip: float | None = option(
        None,
        "Clip every score to [-score_clip, score_clip] before the KL penalty is added (Zheng et al. 2023, "
        "PPO-max); none = off.",
        gt=0,
    )
    rollout_batch_size: int | None = option(
        None,
        "Responses per generate() call, per reward-model and process-reward-model forward and per no-grad forward of an evaluation "
        "rollout, per process; none = all of them at once. A training rollout's old log-probs, reference "
        "log-probs and values run on the update's first-epoch micro-batches (train.micro_batch_size), so "
        "that the first PPO ratio is exactly 1.",
        gt=0,
    )
    critic_warmup_steps: int = option(
        0, "Rollouts at the start during which only the critic is trained (Zheng et al. 2023).", ge=0
    )
    dynamic_sampling: bool = option(
        False,
        "grpo / rloo: replace each group whose responses all score the same (it teaches nothing) by a group "
        "of a newly drawn prompt, so the update sees batch_size useful groups where it can (DAPO, Yu et al. "
        "2025); logged as groups/resampled, and groups/unfilled when the bound is reached.",
    )
    dynamic_sampling_rounds: int = option(
        3,
        "The bound on dynamic sampling's extra generation: at most this many more batches of prompts "
        "(batch_size * group_size responses each) per rollout.",
        gt=0,
    )
    generation_backend: Literal["hf", "vllm"] = option(
        "hf",
        "What samples the responses: hf (Hugging Face generate on the actor) or vllm (a vLLM engine in this "
        "process, the actor's weights synced into it before every rollout; only token ids come from it, every "
        "log-prob, value and mask is rlhfkit's own). docs/generation_backend.md.",
    )
    hf_decode: Literal["dynamic", "static", "compiled"] = option(
        "dynamic",
        "hf backend: the key / value cache of every sampling from the actor (rollouts, multi-turn episodes, "
        "evaluation, the refresh's pairs): "
        "dynamic (grows with the response), static (allocated once for prompt + response, positions rounded up "
        "to a multiple of 64) or compiled (static, the one-position forward compiled by torch.compile once per "
        "run and shape; the first call compiles). The same tokens as dynamic; a model with sliding-window or "
        "recurrent cache layers decodes dynamic (logged once). Default measured fastest on a CPU "
        "(docs/performance.md).",
    )
    sampler: Literal["exact", "multinomial"] = option(
        "exact",
        "hf backend: the draw of every sampled token (rollouts, multi-turn episodes, evaluation, the refresh's "
        "pairs), after the same processing (suppressed ids, temperature, top-k, top-p): exact (rlhfkit's own "
        "inverse-CDF draw accumulated in float64, a few ms per step, on per-row random streams: a response's "
        "tokens depend on the run's seed, its prompt and sample index, not on rollout_batch_size or the number "
        "of processes) or multinomial (generate's torch.multinomial on torch's generator, the draw of earlier "
        "rlhfkit versions, to reproduce their runs). The sampler's name and version go into config.yaml and "
        'summary.json. docs/performance.md, "The draw".',
    )
    vllm_kv_cache_gib: int = option(
        1,
        "vllm: memory of the engine's KV cache, in whole GiB (VLLM_CPU_KVCACHE_SPACE on CPU); on a GPU, this "
        "many GiB of the device (weights included) as the engine's gpu_memory_utilization.",
        ge=1,
    )
    vllm_kv_cache_dtype: str = option(
        "auto",
        "vllm: precision of the KV cache (vLLM's kv_cache_dtype): auto = the engine's dtype, which is the "
        "actor's (float32, or bfloat16 under model.dtype=bfloat16); fp8 variants where the platform has them.",
    )
    vllm_max_model_len: int | None = option(
        None,
        "vllm: the longest prompt + response the engine serves (its max_model_len); none = "
        "data.max_prompt_length + online.response_length (or refresh.max_new_tokens when a refresh samples "
        "longer) + with online.tools or online.environment, the tokens the tools add to a rendered prompt; at "
        "most the model's max_position_embeddings. A value below that sum is refused (the engine "
        "would cut responses at it).",
        gt=0,
    )
    vllm_max_logprob_gap: float = option(
        0.1,
        "vllm: stop the run when the mean |engine log-prob - trainer log-prob| of the sampled tokens "
        "(generation/logprob_gap/mean) exceeds this, in nats: the engine then holds other weights than the "
        "actor. Float32 engine and trainer agree to ~1e-5.",
        gt=0,
    )
    rollout_correction: Literal["none", "tis"] = option(
        "none",
        "Correct for tokens sampled by the engine rather than the trainer: tis weights the policy loss per "
        "token by min(pi_trainer / pi_engine, rollout_correction_cap), detached (truncated importance "
        "sampling, Yao et al. 2025). Needs generation_backend=vllm (with hf the two are the same model).",
    )
    rollout_correction_cap: float = option(
        2.0, "The cap C of rollout_correction=tis (Yao et al. 2025).", gt=0
    )
    max_staleness: int = option(
        0,
        "Rollouts that overlap training: 0 = the synchronous loop (every process samples, then trains); k >= 1 "
        "= the last online.generation_processes processes of the launch only sample, and the trainer takes a "
        "rollout's samples only when the weights that drew them are at most k updates older than its own "
        "(older ones are dropped, async/dropped). The PPO ratio is taken against the log-probs the samples "
        "were drawn with (docs/distributed.md).",
        ge=0,
    )
    generation_processes: int = option(
        0,
        "Processes of the launch (the last ones) that only sample, with online.max_staleness >= 1; the first "
        "process trains. 0 = every process samples and trains (the synchronous loop).",
        ge=0,
    )


@dataclass
class DistillConfig:
    """On-policy distillation (`rlhfkit train distill`; the teacher is ``online.teacher_model``)."""

    loss: DistillLoss = option(
        "reverse_kl",
        "reverse_kl: the sampled per-token term -(log pi - log pi_teacher) as the reward of a policy gradient "
        "(reward-to-go over the response, online.gamma); full_reverse_kl: KL(pi || pi_teacher) over the whole "
        "vocabulary at every sampled position, a loss term; jsd: GKD's generalized Jensen-Shannon divergence "
        "there (Agarwal et al. 2024). The last two read both models' output heads a chunk of positions at a "
        "time (rlhfkit.models.distill_readout).",
    )
    jsd_beta: float = option(
        0.5,
        "jsd: the mixture M = jsd_beta * pi_teacher + (1 - jsd_beta) * pi, and JSD = jsd_beta * KL(pi_teacher "
        "|| M) + (1 - jsd_beta) * KL(pi || M).",
        gt=0,
        lt=1,
    )


@dataclass
class RefreshConfig:
    """The online reward-model refresh (:mod:`rlhfkit.trainers.online.refresh`; defaults measured on the built-in
    task's tiny preset with a refresh every 5 rollouts, examples/README.md)."""

    every: int = option(
        0,
        "Refresh the reward model after every K-th rollout; 0 = never. Needs a refresh hook: the quickstart's "
        "--refresh-steps, or rlhfkit.trainers.online.refresh.RewardRefresh as OnlineHooks.refresh_reward_model.",
        ge=0,
    )
    pairs: int = option(
        128, "Prompts sampled per refresh (two responses each; identical or empty pairs are dropped).", ge=1
    )
    steps: int = option(16, "AdamW steps on the accumulated pairs per refresh.", ge=0)
    batch_size: int = option(32, "Pairs per optimizer step.", ge=1)
    fresh_fraction: float = option(
        0.5,
        "Share of each batch drawn from the pairs collected by refreshes; the rest comes from the initial "
        "pairs (all of it from collected pairs when there are no initial pairs).",
        ge=0,
        le=1,
    )
    learning_rate: float = option(2e-4, "Learning rate of a fresh AdamW at every refresh.")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    max_grad_norm: float | None = option(1.0, "Clip the gradient norm to this; none = no clipping.")
    temperature: float = option(1.0, "Sampling temperature of the pairs (as `rlhfkit label-pairs`).", gt=0)
    max_new_tokens: int = option(48, "The longest response, in tokens (the online run's response_length).")
    normalize_max_pairs: int = option(
        512, "Pairs of the anchor set the normalisation is re-fitted on (both sides).", ge=1
    )
    center_coef: float = option(0.0, "The reward trainer's centring coefficient (reward.center_coef).")
    sample_batch_size: int = option(256, "Responses per generate() call.")

    def __post_init__(self) -> None:  # also when built from Python, not from a configuration file
        check_bounds(self, "refresh.", _raise)


def _raise(key: str, message: str) -> None:
    raise ConfigError(f"{key}: {message}")
