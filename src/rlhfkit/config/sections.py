"""The sections of a run's configuration other than ``online`` (:mod:`rlhfkit.config.online`): the model, the
data, the optimisation loop, reward-model training, DPO and logging."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhfkit.config.fields import option


@dataclass
class ModelConfig:
    """The model being trained."""

    name_or_path: str = option(
        "",
        "The policy (sft/dpo/ppo/grpo/rloo) or backbone (reward/prm): a local folder or a hub id. Required.",
    )
    trust_remote_code: bool = option(
        False, "Run code shipped with a hub model. Off unless you trust its author."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = option(
        "auto",
        "Compute precision; auto = float32 on CPU, bfloat16 on a GPU that supports it. Trained roles "
        "(policy, critic, SFT and reward models) always keep float32 weights and optimizer state; bfloat16 "
        "runs their forwards under autocast and gives only the frozen roles (PPO reference and reward "
        "model) bfloat16 weights. On a CPU without bf16 instructions bfloat16 is much slower.",
    )
    save_dtype: Literal["float32", "bfloat16"] = option(
        "float32",
        "Dtype of the weights written to final/ (the trained weights are float32; bfloat16 halves the "
        "files).",
    )
    missing_pad: Literal["add", "eos"] = option(
        "add",
        "A tokenizer without a pad token: add a distinct <|pad|> token (every role that gets the new "
        "embedding row gets the same one: the mean of the existing rows), or pad with EOS. The pad token "
        "is never sampled and never scored.",
    )
    router_aux_loss_coef: float | None = option(
        None,
        "Weight of a mixture-of-experts router's load-balancing loss in SFT and the online update; none = "
        "the model config's own router_aux_loss_coef (0 for a dense model).",
        ge=0,
    )
    disable_dropout: bool = option(
        True,
        "Set every dropout probability to 0, so that the PPO ratio is exactly 1 before the first "
        "update (Huang et al. 2024; huggingface/trl#454).",
    )
    lora_rank: int = option(
        0,
        "LoRA rank r (Hu et al. 2021, through peft); 0 = full fine-tuning. With LoRA only the adapters (and "
        "a scalar model's head) train; the PPO reference is the policy with its adapter disabled.",
        ge=0,
    )
    lora_alpha: float = option(
        16.0, "LoRA scaling numerator: the update B A is scaled by lora_alpha / lora_rank.", gt=0
    )
    lora_dropout: float = option(
        0.0,
        "Dropout on the LoRA branch's input (ppo/grpo/rloo need 0 while model.disable_dropout is true, so "
        "that the ratio is 1 before the first update).",
        ge=0,
        lt=1,
    )
    lora_target_modules: str = option(
        "all-linear",
        "The modules that get an adapter: all-linear (every linear layer of the transformer blocks, "
        "not the output head) or comma-separated module names, e.g. q_proj,v_proj.",
    )
    gradient_checkpointing: bool = option(
        False,
        "Recompute each block's activations in the backward pass instead of storing them (trained roles: "
        "the SFT / reward model, the actor and the critic): less memory, about one more forward of time.",
    )


@dataclass
class DataConfig:
    """Training and evaluation data (formats: docs/design.md, 'Data formats')."""

    train_file: str = option(
        "",
        "Training data: a .jsonl/.json/.parquet file, a datasets folder or a hub name. For ppo/grpo/rloo, "
        "the prompts. Required.",
    )
    dataset_config: str | None = option(
        None,
        "The configuration (subset) name of a hub dataset or of a dataset repository folder in "
        "data.train_file, as datasets.load_dataset(path, name) takes it, e.g. main for openai/gsm8k; also "
        "used for data.eval_file when that names the same dataset. none = the dataset's only (or default) "
        "configuration.",
    )
    eval_file: str | None = option(None, "Evaluation data in the same format; none = no evaluation.")
    max_prompt_length: int = option(256, "Longest prompt, in tokens.", gt=0)
    max_length: int = option(512, "Longest prompt + response, in tokens (sft/reward/prm/dpo).", gt=0)
    truncation: Literal["error", "left", "right"] = option(
        "error",
        "A prompt longer than max_prompt_length: stop with an error naming the row, or drop tokens "
        "from its left (keeps the end of the prompt) or right.",
    )
    shuffle: bool = option(True, "Shuffle the training data every epoch (seeded by the run's seed).")
    columns: dict[str, str] = option(
        {},
        "Your dataset's column for each standard name (prompt, chosen, rejected, completion, messages, text, "
        "steps, labels), e.g. {prompt: question, chosen: good}; applies to train and eval data.",
    )
    train_split: str = option("train", "The split of a DatasetDict folder or hub dataset to train on.")
    eval_split: str | None = option(
        None,
        "The split to evaluate on: of data.eval_file, or, with eval_file unset, of the training dataset; "
        "none = eval_file's only split (an error names them when it has several).",
    )
    num_proc: int | None = option(
        None,
        "Worker processes that tokenise the data (datasets.map); the tokens are cached on disk either way.",
        gt=0,
    )
    chat_template: str | None = option(
        None,
        "A Jinja chat template, or the path of a file holding one, that replaces the tokenizer's (used for "
        "conversational data and saved with final/); none = the tokenizer's own.",
    )
    tools: list[str] = option(
        [],
        "sft: tools the demonstrations call, 'path/to/file.py:fn' or 'pkg.module:fn' as in online.tools; their "
        "JSON schemas go with every row that has no 'tools' column, rendered as the episodes render them "
        "(docs/tools.md).",
    )


@dataclass
class TrainConfig:
    """The optimisation loop shared by every trainer."""

    max_steps: int = option(
        200, "Optimizer steps (sft/reward/prm); rollouts, i.e. PPO iterations (ppo/grpo/rloo).", gt=0
    )
    batch_size: int = option(
        32,
        "Sequences or pairs per optimizer step, all processes together; online: prompts per rollout "
        "(responses = batch_size * online.group_size).",
        gt=0,
    )
    micro_batch_size: int | None = option(
        None,
        "Sequences per forward/backward pass per process; batch_size / (micro_batch_size * processes) "
        "is the number of gradient-accumulation steps. None = batch_size / processes; online (ppo / grpo / "
        "rloo): the most rows of the longest sequence (data.max_prompt_length + online.response_length), up "
        "to the minibatch, whose predicted update peak fits 1 GiB on a CPU (2 GiB on a GPU) and an eighth of "
        "the machine's (or GPU's) memory, the minibatch then cut into the fewest micro-batches of at most that "
        "many rows, of even sizes (whole groups for grpo / rloo / reinforce_pp): per token and decoder layer "
        "a number of bytes per hidden unit fitted to measured peaks "
        "(float32 or bf16; LoRA or full fine-tuning; a GRPO group's prompt once; the critic's tokens too, as "
        "both models' forwards make one backward), the chunked read-out's few float32 blocks and the "
        "gradients (docs/performance.md); at least 1.",
        gt=0,
    )
    learning_rate: float = option(
        1.0e-5,
        "Peak learning rate (AdamW); 0 runs every stage without changing a weight (a check that the PPO "
        "ratio is exactly 1).",
        ge=0,
    )
    weight_decay: float = option(0.0, "AdamW decoupled weight decay.", ge=0)
    adam_beta1: float = option(0.9, "AdamW beta1.", ge=0, lt=1)
    adam_beta2: float = option(0.999, "AdamW beta2.", ge=0, lt=1)
    adam_eps: float = option(1.0e-8, "AdamW epsilon.", gt=0)
    warmup_steps: int = option(0, "Linear warm-up from 0 to learning_rate over this many steps.", ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = option(
        "linear",
        "Decay after warm-up, to 0 at max_steps (linear annealing as in Ziegler et al. 2019's "
        "lm-human-preferences).",
    )
    max_grad_norm: float | None = option(
        1.0, "Clip the global gradient norm to this; none = no clipping.", gt=0
    )
    save_steps: int = option(50, "Save a checkpoint every N steps, and at the end.", gt=0)
    eval_steps: int = option(50, "Evaluate every N steps (when data.eval_file is set), and at the end.", gt=0)
    log_steps: int = option(1, "Write a line to metrics.jsonl every N steps.", gt=0)
    keep_last_checkpoints: int | None = option(
        None, "Keep only the newest N complete checkpoints; none = keep all.", gt=0
    )
    sharding: Literal["none", "full_shard", "shard_grad_op"] = option(
        "none",
        "Under several processes: shard the trained models (sft/reward/prm/dpo: the model; ppo/grpo/rloo: "
        "the actor and the critic) over them with FSDP2 (full_shard: parameters, gradients and optimizer "
        "state; shard_grad_op: gradients and optimizer state, parameters kept whole between forward and "
        "backward). none = each process holds the whole model (data parallel). An accelerate FSDP config "
        "sets it too.",
    )
    frozen_models: Literal["shard", "replicate"] = option(
        "shard",
        "With train.sharding: the frozen models (dpo's reference; the online reference, reward model and a "
        "distillation teacher) sharded "
        "too, forward-only (shard: 1/N of their weights per process, one all-gather per layer per forward), "
        "or a whole copy on every process (replicate: no all-gather, N times the memory).",
    )
    collective_timeout: float = option(
        1800.0,
        "Seconds a process waits at a collective (all-reduce, all-gather, barrier; with online.max_staleness "
        "> 0 also a generator waiting for weights and the trainer for a rollout) for the others of a "
        "multi-process run before it stops with one line naming the cause (exit 5; the newest complete "
        "checkpoint stays resumable). It bounds the wait when a process hangs or vanishes unnoticed (a lost "
        "node; NCCL); a process that raises or is killed on this machine is noticed at once. It must exceed "
        "the longest wait of a healthy run: the main process alone tokenising a large dataset into its "
        "cache, or writing a large final/ (30 min, torch's gloo default). Set when the process group starts "
        "(the first run of a process).",
        gt=0,
    )
    skip_nonfinite_steps: int = option(
        0,
        "A step whose loss, gradient norm, rewards or values are not finite stops the run (exit 3); skip up "
        "to N such steps instead (no optimizer step; counted as guard/skipped_steps).",
        ge=0,
    )


@dataclass
class RewardConfig:
    """Reward-model training (reward / prm)."""

    margin: float = option(
        0.0,
        "Margin m in the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - m) (Touvron et al. 2023) "
        "for every pair whose record has no `margin` field of its own.",
    )
    center_coef: float = option(
        0.0,
        "Weight of the auxiliary loss (r_chosen + r_rejected)^2 that keeps rewards centred on 0 "
        "(Eisenstein et al. 2023; 0.01 is usual).",
        ge=0,
    )
    length_bias_coef: float = option(
        0.0,
        "Weight of a penalty c * cov(r, z)^2 on the covariance between reward r and standardised response "
        "length z over each micro-batch's responses, against length hacking (Singhal et al. 2023); 0 = off.",
        ge=0,
    )
    normalize: bool = option(
        True,
        "After training, fit a gain and a bias so that the training responses' scores have mean 0 and std 1 "
        "(Huang et al. 2024, reward normalisation); stored in final/config.json as rlhfkit_reward_gain "
        "and rlhfkit_reward_bias, which rlhfkit applies whenever it scores with the model.",
    )
    normalize_max_pairs: int = option(
        2048,
        "Fit the normalisation on at most this many training pairs (both responses), drawn with the seed.",
        gt=0,
    )
    keep_best: bool = option(
        True,
        "final/ is the model of the trained evaluation with the best held-out accuracy (ties: lower held-out "
        "loss), not the last step's; never the untrained step-0 model, and a warning when the best is the "
        "first evaluation (needs held-out data: data.eval_file or data.eval_split).",
    )
    early_stopping_patience: int | None = option(
        None,
        "Stop after this many evaluations in a row without a better held-out accuracy (needs "
        "data.eval_file); none = train for max_steps.",
        gt=0,
    )


@dataclass
class DPOConfig:
    """Direct Preference Optimization (dpo): the policy learns from preference pairs against a frozen
    reference, with no reward model (Rafailov et al. 2023)."""

    beta: float = option(
        0.1,
        "KL strength: the implicit reward is beta * (log pi - log pi_ref) (sigmoid), or IPO's target "
        "margin is 1 / (2 beta) nats.",
        gt=0,
    )
    loss: Literal["sigmoid", "ipo"] = option(
        "sigmoid",
        "sigmoid = DPO's -log sigmoid(beta * h) (Rafailov et al. 2023, eq. 7); ipo = (h - 1 / (2 beta))^2 "
        "(Azar et al. 2023, eq. 17); h = chosen log-ratio minus rejected log-ratio.",
    )
    label_smoothing: float = option(
        0.0,
        "Conservative DPO (Mitchell 2023): the assumed probability that a label is flipped (sigmoid only).",
        ge=0,
        lt=0.5,
    )
    reference_model: str | None = option(
        None,
        "The frozen reference; none = model.name_or_path (the SFT model), or under LoRA the policy with its "
        "adapter disabled.",
    )


@dataclass
class LoggingConfig:
    """Where metrics go besides metrics.jsonl."""

    tensorboard: bool = option(
        False, "Also write TensorBoard events to <output_dir>/tensorboard (needs tensorboard)."
    )
    wandb: bool = option(False, "Also log to Weights & Biases (needs wandb and a login).")
    wandb_project: str = option("rlhfkit", "W&B project name.")
    wandb_run_name: str | None = option(None, "W&B run name; none = the output folder's name.")
    progress_bar: bool = option(True, "Show a progress bar (only ever on a terminal).")
    samples_per_step: int = option(
        8,
        "Online runs: responses per rollout written to samples.jsonl (prompt, response, score and its parts, "
        "KL, length, ended with a stop token); 0 = none, nor a distillation's teacher_samples.jsonl.",
        ge=0,
    )
