"""Run configuration: one typed dataclass per component, every field documented once.

Each field is declared with :func:`option`, which stores its help text (and optional bounds) in the
dataclass field's ``metadata``; ``rlhfkit train --help`` lists them from there (:func:`config_help`), so
there is no second schema anywhere. A YAML file only sets values; the command line overrides any key with
``dotted.key=value`` (the value is parsed as a YAML scalar or flow list). Parsing and type conversion are
omegaconf structured configs, on a copy of the dataclasses with every ``Literal`` field typed ``str``
(:func:`_omegaconf_schema`: omegaconf 2.3, which hydra-core 1.3 needs, has no ``Literal``); this module checks
the ``Literal`` choices itself, and adds the error messages that name the key and the file, the bounds and
the cross-field checks.

To add a field for a trainer: add one ``name: type = option(default, "help")`` line to the section's
dataclass below. Nothing else needs to change (loading, overrides, validation, ``--help`` and the saved
``config.yaml`` all follow the dataclasses).

Defaults follow Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO" (kl_coef 0.05,
gamma 1, lam 0.95, 4 epochs, clip 0.2, value clip 0.2, vf_coef 0.1, temperature 0.7, dropout off,
whitened advantages, a fixed score for responses without EOS), unless a field says otherwise.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from rlhfkit.errors import ConfigError

if TYPE_CHECKING:  # the choices rlhfkit.algos declares; read by _hints (algos imports torch)
    from rlhfkit.algos import AdvantageEstimator, KLEstimator, LossAggregation

Kind = Literal["sft", "reward", "prm", "ppo", "grpo", "rloo", "dpo"]
KINDS: tuple[str, ...] = get_args(Kind)
ONLINE_KINDS = ("ppo", "grpo", "rloo")


def option(
    default: Any,
    help: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> Any:
    """A dataclass field with its help text and optional numeric bounds (checked by :func:`load_config`).

    A list default, or a section's dataclass, becomes a ``default_factory`` so instances never share it.
    """
    metadata = {"help": help, "gt": gt, "ge": ge, "lt": lt, "le": le}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    if isinstance(default, type) and dataclasses.is_dataclass(default):  # a section
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


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
        "is the number of gradient-accumulation steps. None = batch_size / processes.",
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
        "sft/reward/prm under several processes: shard the trained model over them with FSDP2 "
        "(full_shard: parameters, gradients and optimizer state; shard_grad_op: gradients and optimizer "
        "state, parameters kept whole between forward and backward). none = each process holds the whole "
        "model (data parallel). An accelerate FSDP config sets it too.",
    )
    skip_nonfinite_steps: int = option(
        0,
        "A step whose loss, gradient norm, rewards or values are not finite stops the run (exit 3); skip up "
        "to N such steps instead (no optimizer step; counted as guard/skipped_steps).",
        ge=0,
    )


@dataclass
class OnlineConfig:
    """Online RL (ppo / grpo / rloo): generation, reward, KL, advantages and the PPO update."""

    reward_model: str | None = option(None, "Frozen reward model folder (from `rlhfkit train reward`).")
    reward_functions: list[str] = option(
        [], "Reward functions 'pkg.module:fn' or 'path/to/file.py:fn', added to the reward model's score."
    )
    process_reward_model: str | None = option(
        None,
        "Process reward model folder (from `rlhfkit train prm`): P(step correct) - 1 on every step-end "
        "token of a response, beside the outcome score on its last token (rlhfkit.rollout.process_rewards).",
    )
    critic_model: str | None = option(
        None,
        "Initial critic (value model) for gae; none = the reward model, else the policy "
        "(Huang et al. 2024: critic initialised from the reward model).",
    )
    response_length: int = option(64, "Most tokens generated per response.", gt=0)
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
        "Put the KL in the loss, kl_coef * k3(pi, pi_ref) per token against the reference (Shao et al. 2024, "
        "DeepSeekMath's GRPO), instead of -kl_coef * kl_t in the reward; kl_estimator is then what is logged.",
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
        "Advantage estimator: gae (PPO with a critic) or a critic-free one. Set by the command for "
        "`train grpo` / `train rloo`.",
    )
    group_size: int = option(1, "Responses per prompt (critic-free grpo / rloo need at least 2).", gt=0)
    norm_by_std: bool = option(
        True,
        "grpo: divide group-centred scores by the group's std (Shao et al. 2024); false = Dr. GRPO "
        "(Liu et al. 2025).",
    )
    advantage_eps: float = option(
        1.0e-6, "Added to standard deviations before dividing (grpo, whitening).", gt=0
    )
    gamma: float = option(1.0, "Discount factor.", ge=0, le=1)
    lam: float = option(0.95, "GAE lambda (Schulman et al. 2016).", ge=0, le=1)
    whiten_advantages: bool = option(
        True,
        "gae and reinforce_pp: whiten advantages over the valid tokens of the batch (grpo's own "
        "normalisation is norm_by_std; rloo has none).",
    )
    ppo_epochs: int = option(4, "Passes over each rollout batch.", gt=0)
    num_minibatches: int = option(1, "Optimizer steps per PPO epoch.", gt=0)
    clip_eps: float = option(0.2, "PPO policy ratio clip (Schulman et al. 2017, eq. 7).", gt=0)
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
        "Responses per generate() call and per no-grad forward (reference, reward model, values) in a "
        "rollout, per process; none = all of them at once.",
        gt=0,
    )
    critic_warmup_steps: int = option(
        0, "Rollouts at the start during which only the critic is trained (Zheng et al. 2023).", ge=0
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
        "KL, length, ended with a stop token); 0 = none.",
        ge=0,
    )


@dataclass
class RunConfig:
    """Everything one `rlhfkit train <kind>` run needs."""

    output_dir: str = option(
        "", "The run folder: config.yaml, metrics.jsonl, checkpoints/, final/. Required."
    )
    seed: int = option(0, "Seeds python, numpy and torch (and the data order).")
    kind: Kind = option("sft", "What is trained; set by the command (`rlhfkit train <kind>`).")
    model: ModelConfig = option(ModelConfig, "The model.")
    data: DataConfig = option(DataConfig, "The data.")
    train: TrainConfig = option(TrainConfig, "The optimisation loop.")
    online: OnlineConfig = option(OnlineConfig, "Online RL (ppo / grpo / rloo only).")
    reward: RewardConfig = option(RewardConfig, "Reward-model training (reward / prm only).")
    dpo: DPOConfig = option(DPOConfig, "Direct Preference Optimization (dpo only).")
    logging: LoggingConfig = option(LoggingConfig, "Extra metric sinks.")


# Per-command defaults, applied under the file and the command line. `forced` keys may not be set to
# another value: `train grpo` with advantage_estimator=rloo is a contradiction, not a preference.
KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"online.group_size": 4},
    "rloo": {"online.group_size": 4},
}
KIND_FORCED: dict[str, dict[str, Any]] = {
    "grpo": {"online.advantage_estimator": "grpo"},
    "rloo": {"online.advantage_estimator": "rloo"},
}


# The names `data.columns` maps from: every field a shape of the module docstring reads.
STANDARD_COLUMNS = ("prompt", "chosen", "rejected", "completion", "messages", "text", "steps", "labels")


def check_columns(columns: dict | None, key: str = "data.columns") -> dict[str, str]:
    """``columns`` as a plain dict, or a ConfigError for a name that is not standard or a non-string column."""
    out = dict(columns or {})
    for name, column in out.items():
        if name not in STANDARD_COLUMNS:
            close = difflib.get_close_matches(str(name), STANDARD_COLUMNS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"one of {', '.join(STANDARD_COLUMNS)}"
            raise ConfigError(
                f"{key}: '{name}' is not a standard column name ({hint}); the mapping goes from the "
                "standard name to your column, e.g. {prompt: question}"
            )
        if not isinstance(column, str) or not column:
            raise ConfigError(f"{key}.{name}: expected the name of a column, got {column!r}")
    targets = list(out.values())
    twice = sorted({c for c in targets if targets.count(c) > 1})
    if twice:
        raise ConfigError(f"{key}: column(s) {', '.join(twice)} mapped to more than one standard name")
    return out


# ----------------------------------------------------------------------------------------------------------
# Loading, validation, saving


def load_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), kind: str = "sft"
) -> RunConfig:
    """Build a :class:`RunConfig`: dataclass defaults < per-kind defaults < YAML file < ``dotted.key=value``.

    Raises:
        ConfigError: unreadable or invalid YAML, an unknown key, a value of the wrong type or out of range,
            a missing required value, or contradicting settings; the message names the key and where it was
            set (the file, or the command-line override).
    """
    from omegaconf import OmegaConf

    if kind not in KINDS:
        raise ConfigError(f"unknown kind '{kind}'; choose one of {', '.join(KINDS)}")
    layers: list[tuple[str, dict]] = [
        (
            f"the defaults of `train {kind}`",
            _nest({**KIND_DEFAULTS.get(kind, {}), **KIND_FORCED.get(kind, {}), "kind": kind}),
        )
    ]
    if path is not None:
        layers.append((str(path), _read_yaml(path)))
    for item in overrides:
        layers.append((f"command-line override '{item}'", _parse_override(item)))

    cfg = OmegaConf.structured(_omegaconf_schema(RunConfig))
    set_by: dict[str, str] = {}  # dotted key -> where its value was last set
    for source, values in layers:
        for key in _check_keys(values, RunConfig, "", source):
            set_by[key] = source
        try:
            cfg = OmegaConf.merge(cfg, values)
        except Exception as e:  # omegaconf's ValidationError / ConfigKeyError and friends
            raise _translate(e, source) from None
    try:
        run: RunConfig = _from_plain(RunConfig, OmegaConf.to_container(cfg, resolve=True))
    except Exception as e:  # an interpolation ${...} that does not resolve
        raise _translate(e, "the configuration") from None
    _validate(run, kind, set_by)
    return run


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The configuration as plain nested dicts, lists and scalars (what ``config.yaml`` holds)."""
    return dataclasses.asdict(cfg)


RUN_INFO_PREFIX = "# run: "


def save_config(cfg: RunConfig, path: str | Path, run_info: dict[str, Any] | None = None) -> None:
    """Write ``cfg`` as YAML that :func:`load_config` reads back to an equal :class:`RunConfig`.

    ``run_info`` (how the run was launched: processes, launcher, threads) goes into a comment line
    ``# run: {json}`` (:func:`read_run_info`), so that the file stays a loadable configuration.
    """
    import json

    import yaml

    path = Path(path)
    header = f"# rlhfkit resolved configuration; rerun with: rlhfkit train {cfg.kind} --config {path.name}\n"
    if run_info:
        header += RUN_INFO_PREFIX + json.dumps(run_info, sort_keys=True) + "\n"
    text = header + yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def read_run_info(path: str | Path) -> dict[str, Any] | None:
    """The run line of a ``config.yaml`` that :func:`save_config` wrote, or None."""
    import json

    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith(RUN_INFO_PREFIX):
            return json.loads(line[len(RUN_INFO_PREFIX) :])
    return None


def config_help(cls: type = RunConfig, prefix: str = "") -> str:
    """One entry per key: ``dotted.key (type, default: value)`` and its help text, for ``--help``."""
    lines = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if _is_section(hints[f.name]):
            lines.append(f"{key}:  {f.metadata['help']}")
            lines.append(config_help(hints[f.name], key + "."))
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        lines.append(f"  {key} ({_type_name(hints[f.name])}, default: {_show(default)})")
        lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)


def _read_yaml(path: str | Path) -> dict:
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        # omegaconf's YAML loader: reads 1e-5 as a number and refuses duplicate keys (PyYAML keeps the last).
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{where}: not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys (like `train:` and `model:`), got a list")
    return data


def _parse_override(item: str) -> dict:
    from omegaconf import OmegaConf

    key, sep, _ = item.partition("=")
    if not sep or not all(part.isidentifier() for part in key.split(".")):
        raise ConfigError(
            f"command-line override '{item}': expected dotted.key=value, e.g. train.learning_rate=1e-5"
        )
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except Exception as e:
        raise ConfigError(f"command-line override '{item}': {str(e).splitlines()[0]}") from None


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _check_keys(values: dict, cls: type, prefix: str, source: str) -> list[str]:
    """Refuse unknown keys (suggesting the closest known one); return the dotted keys set."""
    hints = _hints(cls)
    seen = []
    for name, value in values.items():
        key = prefix + str(name)
        if name not in hints:
            close = difflib.get_close_matches(str(name), list(hints), n=1)
            hint = (
                f" (did you mean '{prefix}{close[0]}'?)"
                if close
                else f"; known keys here: {', '.join(hints)}"
            )
            raise ConfigError(f"{source}: unknown key '{key}'{hint}")
        if _is_section(hints[name]):
            if value is None:  # `online:` with every key commented out
                values[name] = value = {}
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{source}: '{key}' is a section; expected a mapping of its keys, got {value!r}"
                )
            seen += _check_keys(value, hints[name], key + ".", source)
        else:
            seen.append(key)
    return seen


def _translate(e: Exception, source: str) -> ConfigError:
    key = getattr(e, "full_key", None)
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    return ConfigError(f"{source}: {key}: {message}" if key else f"{source}: {message}")


def _validate(run: RunConfig, kind: str, set_by: dict[str, str]) -> None:
    def fail(key: str, message: str) -> None:
        where = f" (set in {set_by[key]})" if key in set_by else ""
        raise ConfigError(f"{key}{where}: {message}")

    if run.kind != kind:
        fail("kind", f"this configuration is for `train {run.kind}`, but the command is `train {kind}`")
    for key, value in KIND_FORCED.get(kind, {}).items():
        if _get(run, key) != value:
            fail(
                key,
                f"`train {kind}` always uses {value}; for another choice run "
                f"`train ppo {key}={_get(run, key)}`",
            )
    _check_bounds(run, "", fail)
    _check_choices(run, "", fail)
    check_columns(run.data.columns)
    for key in ("output_dir", "model.name_or_path", "data.train_file"):
        if not _get(run, key):
            fail(key, f"required; set it in the config file or on the command line ({key}=...)")
    t = run.train
    # Online runs accumulate over responses (batch_size * group_size per rollout, split in minibatches), and
    # a last, smaller micro-batch is exact there (whole-minibatch normaliser): no divisibility needed.
    if t.micro_batch_size is not None and kind not in ONLINE_KINDS and t.batch_size % t.micro_batch_size:
        fail(
            "train.micro_batch_size",
            f"must divide train.batch_size ({t.batch_size}), got {t.micro_batch_size}",
        )
    if kind not in ONLINE_KINDS and run.data.max_prompt_length >= run.data.max_length:
        fail(
            "data.max_prompt_length",
            f"must be below data.max_length ({run.data.max_length}) to leave room "
            f"for a response, got {run.data.max_prompt_length}",
        )
    if kind not in ("sft", "reward", "prm") and t.sharding != "none":
        fail(
            "train.sharding",
            f"{t.sharding} is not supported by `train {kind}` yet (sft, reward and prm only); "
            "use train.sharding=none (data parallel: each process holds the whole model) with LoRA "
            "(model.lora_rank) to fit a larger policy",
        )
    if kind == "dpo" and run.dpo.loss == "ipo" and run.dpo.label_smoothing:
        fail("dpo.label_smoothing", "applies to the sigmoid loss only; set it to 0 with dpo.loss=ipo")
    if kind in ONLINE_KINDS:
        o = run.online
        if run.model.lora_rank and run.model.lora_dropout and run.model.disable_dropout:
            fail(
                "model.lora_dropout",
                f"{run.model.lora_dropout} makes the PPO ratio differ from 1 before any "
                "update; set it to 0 (or model.disable_dropout=false to keep every dropout)",
            )
        if not o.reward_model and not o.reward_functions:
            fail(
                "online.reward_model",
                "set online.reward_model and/or online.reward_functions: nothing scores the responses",
            )
        if o.advantage_estimator in ("grpo", "rloo") and o.group_size < 2:
            fail(
                "online.group_size",
                f"advantage_estimator={o.advantage_estimator} compares the responses to one "
                f"prompt, so it needs group_size >= 2, got {o.group_size}",
            )
        responses = t.batch_size * o.group_size
        if responses % o.num_minibatches:
            fail(
                "online.num_minibatches",
                f"must divide the responses per rollout (train.batch_size * "
                f"online.group_size = {responses}), got {o.num_minibatches}",
            )


def _check_bounds(obj: Any, prefix: str, fail) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_bounds(value, prefix + f.name + ".", fail)
            continue
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            fail(prefix + f.name, f"must be a finite number, got {value}")
        for bound, holds in (
            ("gt", value.__gt__),
            ("ge", value.__ge__),
            ("lt", value.__lt__),
            ("le", value.__le__),
        ):
            limit = f.metadata.get(bound)
            if limit is not None and not holds(limit):
                symbol = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}[bound]
                fail(prefix + f.name, f"must be {symbol} {limit}, got {value}")


def _choices(tp: Any) -> tuple | None:
    """The values of a ``Literal[...]`` type (also inside ``Optional``), else None."""
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return args
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if typing.get_origin(arg) is Literal:
                return typing.get_args(arg)
    return None


def _check_choices(obj: Any, prefix: str, fail) -> None:
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_choices(value, prefix + f.name + ".", fail)
            continue
        choices = _choices(hints[f.name])
        if choices is not None and value is not None and value not in choices:
            fail(prefix + f.name, f"must be one of {', '.join(map(str, choices))}, got {value!r}")


_SCHEMAS: dict[type, type] = {}


def _omegaconf_schema(cls: type) -> type:
    """A copy of the dataclass ``cls`` (and of its sections) with ``Literal[...]`` fields typed ``str``, which
    every omegaconf version takes; :func:`_check_choices` checks the choices afterwards."""
    import typing

    if cls in _SCHEMAS:
        return _SCHEMAS[cls]
    hints, fields = _hints(cls), []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            section = _omegaconf_schema(tp)
            fields.append((f.name, section, field(default_factory=section)))
            continue
        choices = _choices(tp)
        if choices is not None:
            tp = str if typing.get_origin(tp) is Literal else str | None
        default = (
            field(default_factory=f.default_factory)
            if f.default is dataclasses.MISSING
            else field(default=f.default)
        )
        fields.append((f.name, tp, default))
    _SCHEMAS[cls] = dataclasses.make_dataclass(cls.__name__, fields)
    return _SCHEMAS[cls]


def _from_plain(cls: type, values: dict) -> Any:
    """``cls`` (a section dataclass) built from the plain nested dict omegaconf gives back."""
    hints = _hints(cls)
    return cls(
        **{
            name: _from_plain(hints[name], value) if _is_section(hints[name]) else value
            for name, value in values.items()
        }
    )


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        import typing

        _HINTS[cls] = typing.get_type_hints(cls, localns=_algos_choices())
    return _HINTS[cls]


def _algos_choices() -> dict[str, Any]:
    """The choice types of the fields whose values name an ``rlhfkit.algos`` registry entry, declared there
    once. Imported when a configuration is first read or described, not with this module: ``algos`` imports
    torch, which ``rlhfkit --help``, argument errors and ``rlhfkit report`` need not wait for."""
    from rlhfkit.algos import AdvantageEstimator, KLEstimator, LossAggregation

    return {
        "AdvantageEstimator": AdvantageEstimator,
        "KLEstimator": KLEstimator,
        "LossAggregation": LossAggregation,
    }


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner) + (" or none" if len(inner) < len(args) else "")
    if origin is list:
        return f"list of {_type_name(args[0])}"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
