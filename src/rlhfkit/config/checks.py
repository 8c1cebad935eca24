"""Checks of a configuration: numeric bounds, ``Literal`` choices, the column mapping and every cross-field
rule, at load time (:func:`validate`; each failure a ConfigError naming the key and where it was set), and
the one rule that needs the launch, the process count (:func:`check_process_count`).

The sharding rules read the sharding the run will use (:func:`sharding_mode`): ``train.sharding``, or an
``accelerate launch`` FSDP config, which the launcher passes as environment variables before the
configuration is read. It is defined here, below the engine that shards by it, so that the checks and the
trainers cannot disagree on it."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
from typing import Any

from rlhfkit.config.fields import check_bounds, field_types, get_dotted, literal_choices
from rlhfkit.config.run import KIND_FORCED, ONLINE_KINDS, RunConfig
from rlhfkit.errors import ConfigError

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


def launch_sharding(env: dict[str, str] | None = None) -> str:
    """The sharding an ``accelerate launch`` FSDP config asks for (``none`` without one).

    accelerate passes its config as environment variables: ``ACCELERATE_USE_FSDP`` and either
    ``FSDP_RESHARD_AFTER_FORWARD`` (FSDP2 configs) or ``FSDP_SHARDING_STRATEGY`` (FSDP1 configs).
    """
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_FSDP", "").strip().lower() not in ("1", "true", "yes"):
        return "none"
    strategy = env.get("FSDP_SHARDING_STRATEGY", "").strip().upper()
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "").strip().upper()
    if strategy in ("SHARD_GRAD_OP", "2") or reshard in ("FALSE", "SHARD_GRAD_OP"):
        return "shard_grad_op"
    if strategy in ("NO_SHARD", "3"):
        return "none"
    return "full_shard"


def sharding_mode(cfg) -> str:
    """The sharding the run uses: ``train.sharding``, or when that is ``none`` the launcher's FSDP config
    (:func:`launch_sharding`)."""
    configured = getattr(cfg.train, "sharding", "none")
    return configured if configured != "none" else launch_sharding()


def _sharding_source(run: RunConfig, sharding: str) -> str:
    """Where the sharding comes from, for a message: ``train.sharding=X`` or the accelerate launch."""
    if run.train.sharding != "none":
        return f"train.sharding={sharding}"
    return (
        f"sharding={sharding} from the accelerate FSDP launch (ACCELERATE_USE_FSDP; a launch without an FSDP "
        "config does not shard)"
    )


def key_failure(set_by: dict[str, str]):
    """``fail(key, message)``: a ConfigError naming the key and where it was last set (``set_by``)."""

    def fail(key: str, message: str) -> None:
        where = f" (set in {set_by[key]})" if key in set_by else ""
        raise ConfigError(f"{key}{where}: {message}")

    return fail


def validate(run: RunConfig, kind: str, set_by: dict[str, str]) -> None:
    fail = key_failure(set_by)
    if run.kind != kind:
        fail("kind", f"this configuration is for `train {run.kind}`, but the command is `train {kind}`")
    for key, value in KIND_FORCED.get(kind, {}).items():
        if get_dotted(run, key) != value:
            fail(
                key,
                f"`train {kind}` always uses {value}; for another choice run "
                f"`train ppo {key}={get_dotted(run, key)}`",
            )
    check_bounds(run, "", fail)
    _check_choices(run, "", fail)
    check_columns(run.data.columns)
    for key in ("output_dir", "model.name_or_path", "data.train_file"):
        if not get_dotted(run, key):
            fail(key, f"required; set it in the config file or on the command line ({key}=...)")
    train = run.train
    # Online runs accumulate over responses (batch_size * group_size per rollout, split in minibatches), and
    # a last, smaller micro-batch is exact there (whole-minibatch normaliser): no divisibility needed.
    if (
        train.micro_batch_size is not None
        and kind not in ONLINE_KINDS
        and train.batch_size % train.micro_batch_size
    ):
        fail(
            "train.micro_batch_size",
            f"must divide train.batch_size ({train.batch_size}), got {train.micro_batch_size}",
        )
    if kind not in ONLINE_KINDS and run.data.max_prompt_length >= run.data.max_length:
        fail(
            "data.max_prompt_length",
            f"must be below data.max_length ({run.data.max_length}) to leave room "
            f"for a response, got {run.data.max_prompt_length}",
        )
    if train.warmup_steps > train.max_steps:
        warn_long_warmup(train, set_by)
    sharding = sharding_mode(run)
    if sharding != "none":
        _check_sharding(run, kind, fail, _sharding_source(run, sharding))
    if kind == "dpo" and run.dpo.loss == "ipo" and run.dpo.label_smoothing:
        fail("dpo.label_smoothing", "applies to the sigmoid loss only; set it to 0 with dpo.loss=ipo")
    if run.data.tools and kind != "sft":
        fail("data.tools", f"is read by `train sft` only (its demonstrations); `train {kind}` ignores it")
    heldout = run.data.eval_file or run.data.eval_split
    if kind in ("reward", "prm") and run.reward.early_stopping_patience is not None and not heldout:
        fail(
            "reward.early_stopping_patience",
            "early stopping watches the held-out accuracy, so it needs data.eval_file (or data.eval_split)",
        )
    if kind in ONLINE_KINDS:
        online = run.online
        if run.model.lora_rank and run.model.lora_dropout and run.model.disable_dropout:
            fail(
                "model.lora_dropout",
                f"{run.model.lora_dropout} makes the PPO ratio differ from 1 before any "
                "update; set it to 0 (or model.disable_dropout=false to keep every dropout)",
            )
        if online.advantage_estimator != "gae" and online.critic_model:
            fail(
                "online.critic_model",
                f"is set, but advantage_estimator={online.advantage_estimator} has no critic; remove it or "
                "use advantage_estimator=gae",
            )
        if online.advantage_estimator != "gae" and online.critic_warmup_steps:
            fail(
                "online.critic_warmup_steps",
                f"{online.critic_warmup_steps}, but advantage_estimator={online.advantage_estimator} has no "
                "critic to warm up; set it to 0",
            )
        if kind == "distill" and not online.teacher_model:
            fail(
                "online.teacher_model",
                "required by `train distill`: the teacher's folder or hub name (its vocabulary must be the "
                "policy's, token for token)",
            )
        scorers = online.reward_model or online.reward_functions or online.environment
        if not scorers and not online.teacher_model and not online.process_reward_model:
            fail(
                "online.reward_model",
                "set online.reward_model and/or online.reward_functions (or an online.environment with "
                "get_reward, an online.process_reward_model whose step rewards are the whole reward, or an "
                "online.teacher_model to distil): nothing scores the responses",
            )
        if kind == "distill" and run.distill.loss == "full_reverse_kl" and (online.top_k or online.top_p < 1):
            fail(
                "distill.loss",
                "full_reverse_kl sums over the student's whole distribution, and with online.top_k / top_p "
                "each model is truncated to its own set: wherever the sets differ the KL is infinite; set "
                "online.top_k=0 and online.top_p=1, or use distill.loss=jsd (finite there) or reverse_kl",
            )
        if online.teacher_model and online.teacher_coef == 0:
            fail("online.teacher_coef", "0 leaves the teacher out; remove online.teacher_model instead")
        weights = online.reward_weights
        if weights is not None and len(weights) != len(online.reward_functions):
            fail(
                "online.reward_weights",
                f"{len(weights)} weight(s) for {len(online.reward_functions)} reward function(s) in "
                "online.reward_functions: give one weight per function, in their order (the reward model "
                "and an environment's get_reward are added with weight 1), or null for all 1",
            )
        if weights is not None and not all(math.isfinite(w) for w in weights):
            fail("online.reward_weights", f"every weight must be a finite number, got {weights}")
        if online.advantage_estimator in ("grpo", "rloo") and online.group_size < 2:
            fail(
                "online.group_size",
                f"advantage_estimator={online.advantage_estimator} compares the responses to one "
                f"prompt, so it needs group_size >= 2, got {online.group_size}",
            )
        if online.dynamic_sampling and online.advantage_estimator not in ("grpo", "rloo"):
            fail(
                "online.dynamic_sampling",
                f"replaces groups whose responses all score the same, but advantage_estimator="
                f"{online.advantage_estimator} does not compare a prompt's responses; use grpo or rloo, or "
                "set it to false",
            )
        if online.dynamic_sampling and online.process_reward_model and not scorers:
            fail(
                "online.dynamic_sampling",
                "compares a group's outcome scores, and with online.process_reward_model alone every outcome "
                "is 0 (the step rewards are the whole reward), so it would replace every group; add an outcome "
                "scorer (online.reward_model or online.reward_functions) or set it to false",
            )
        if online.rollout_correction != "none" and online.generation_backend == "hf":
            fail(
                "online.rollout_correction",
                f"{online.rollout_correction} corrects for an engine that samples from other numerics than "
                "the trainer; with generation_backend=hf the actor samples itself (the weight is 1): set "
                "online.generation_backend=vllm or rollout_correction=none",
            )
        if online.generation_backend == "vllm" and online.vllm_max_model_len is not None:
            _check_engine_length(run, fail)
        if online.max_staleness or online.generation_processes:
            _check_async(run, fail, sharding)
        responses = train.batch_size * online.group_size
        if responses % online.num_minibatches:
            fail(
                "online.num_minibatches",
                f"must divide the responses per rollout (train.batch_size * "
                f"online.group_size = {responses}), got {online.num_minibatches}",
            )


def warn_long_warmup(train, set_by: dict[str, str]) -> None:
    """One ``rlhfkit: warning:`` line when the warm-up outlasts the run: the learning rate then rises the whole
    run and ends at max_steps / warmup_steps of train.learning_rate (:func:`rlhfkit.engine.optim.lr_lambda`).
    A warning, not an error: a recipe tried for a few steps (``train.max_steps=2`` on the command line) is the
    usual way to meet it, and that run should go ahead; a full run said so at its start is fixed at once."""
    where = "".join(f" (set in {set_by[k]})" for k in ("train.warmup_steps",) if k in set_by)
    print(
        f"rlhfkit: warning: train.warmup_steps={train.warmup_steps}{where} is longer than train.max_steps="
        f"{train.max_steps}: the learning rate rises for the whole run and reaches only "
        f"{train.max_steps / train.warmup_steps:.0%} of train.learning_rate={train.learning_rate:g} at the "
        "last step; lower train.warmup_steps to train at that rate",
        file=sys.stderr,
    )


def _check_sharding(run: RunConfig, kind: str, fail, sharding: str) -> None:
    """What sharding cannot be combined with (each refused with its reason); ``sharding`` says where the
    sharding comes from (:func:`_sharding_source`)."""
    if kind in ("dpo", *ONLINE_KINDS) and run.model.lora_rank:
        # The LoRA reference is the policy with its adapter disabled, and the LoRA critic an adapter on the
        # reward model's weights: one FSDP2 module would serve a trained and a frozen role, whose parameters
        # FSDP2 gathers and reduce-scatters as one flat group (the adapters' and the base's together).
        fail(
            "model.lora_rank",
            f"{run.model.lora_rank} with {sharding}: LoRA shares the base weights between a "
            "trained and a frozen role, which FSDP2 does not shard apart; use train.sharding=none (data "
            "parallel: a LoRA run keeps the frozen base out of the optimizer) or model.lora_rank=0",
        )
    if kind in ONLINE_KINDS and run.refresh.every:
        fail(
            "refresh.every",
            f"{run.refresh.every} with {sharding}: the refresh trains the reward model in "
            "place, unsharded; set refresh.every=0 or train.sharding=none",
        )
    if kind in ONLINE_KINDS and (run.data.eval_file or run.data.eval_split):
        # each process samples its own share of the held-out prompts, so the processes would run different
        # numbers of forwards through the sharded models, whose all-gathers must pair up
        key = "data.eval_file" if run.data.eval_file else "data.eval_split"
        fail(key, f"held-out sampling is not supported with {sharding} yet; remove {key}")


ASYNC_LATER = "not supported with online.max_staleness > 0 yet"


def _check_async(run: RunConfig, fail, sharding: str) -> None:
    """What rollouts that overlap training (``online.max_staleness`` > 0 on ``online.generation_processes``
    of their own: :mod:`rlhfkit.trainers.online.async_loop`) cannot be combined with yet, each refused naming
    the key and the reason."""
    online = run.online
    if online.max_staleness and not online.generation_processes:
        fail(
            "online.max_staleness",
            f"{online.max_staleness} needs processes that only sample (online.generation_processes >= 1, "
            "launched with torchrun --nproc_per_node at least one more); sampling and training in the same "
            "process overlap nothing, so it is not supported",
        )
    if online.generation_processes and not online.max_staleness:
        fail(
            "online.generation_processes",
            f"{online.generation_processes} needs online.max_staleness >= 1 (0 is the synchronous loop, in "
            "which every process samples and trains); set online.max_staleness=1 or generation_processes=0",
        )
    later = [
        ("online.generation_backend", online.generation_backend != "hf", online.generation_backend),
        ("online.tools", bool(online.tools), "tools episodes"),
        ("online.environment", bool(online.environment), "an environment's episodes"),
        ("online.dynamic_sampling", online.dynamic_sampling, "dynamic sampling"),
        ("refresh.every", bool(run.refresh.every), "the reward-model refresh"),
        ("train.sharding", sharding != "none", f"sharding ({sharding})"),
    ]
    for key, asked, what in later:
        if asked:
            fail(
                key, f"{what} is {ASYNC_LATER}; set online.max_staleness=0 and online.generation_processes=0"
            )


def _check_choices(obj: Any, prefix: str, fail) -> None:
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_choices(value, prefix + f.name + ".", fail)
            continue
        choices = literal_choices(hints[f.name])
        if choices is not None and value is not None and value not in choices:
            fail(prefix + f.name, f"must be one of {', '.join(map(str, choices))}, got {value!r}")


def check_process_count(cfg: RunConfig, num_processes: int) -> None:
    """ConfigError unless ``train.batch_size`` splits evenly over the processes of the launch (each process
    takes an equal share of every batch; online, whole prompt groups)."""
    batch_size = cfg.train.batch_size
    generators = cfg.online.generation_processes if cfg.kind in ONLINE_KINDS else 0
    if generators and generators >= num_processes:
        raise ConfigError(
            f"online.generation_processes ({generators}) must be below the launched processes "
            f"({num_processes}): at least one process trains; launch torchrun --nproc_per_node "
            f"{generators + 1} or more"
        )
    if generators and num_processes - generators > 1:
        raise ConfigError(
            f"online.generation_processes ({generators}) leaves {num_processes - generators} training "
            f"processes of {num_processes}: more than one training process beside generation processes is "
            f"not supported yet; launch torchrun --nproc_per_node {generators + 1}"
        )
    if generators:
        return  # the one training process takes every batch whole
    if batch_size % num_processes:
        share = (
            "samples whole prompt groups"
            if cfg.kind in ONLINE_KINDS
            else "takes an equal share of every batch"
        )
        raise ConfigError(
            f"train.batch_size ({batch_size}) must be a multiple of the number of processes "
            f"({num_processes}): each process {share}"
        )


def _check_engine_length(run: RunConfig, fail) -> None:
    """``online.vllm_max_model_len`` must hold the longest prompt and the longest response the engine serves
    (as its default does): the engine stops a request at that cap, so a shorter one would cut responses
    without a stop token, as if the model had run out of ``online.response_length``."""
    online, refresh = run.online, run.refresh
    longest = ("online.response_length", online.response_length)
    if refresh.every and refresh.max_new_tokens > online.response_length:  # a refresh samples from the engine
        longest = ("refresh.max_new_tokens", refresh.max_new_tokens)
    needed = run.data.max_prompt_length + longest[1]
    if online.vllm_max_model_len < needed:
        fail(
            "online.vllm_max_model_len",
            f"{online.vllm_max_model_len} is below data.max_prompt_length + {longest[0]} = {needed}: the engine "
            f"would cut responses at its length cap; set it to at least {needed}, or leave it unset (that sum)",
        )
