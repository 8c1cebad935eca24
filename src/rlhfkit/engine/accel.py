"""Devices and processes through accelerate: one :class:`accelerate.Accelerator` per run.

rlhfkit does its own loss normalisation (``aggregate_loss`` with the whole minibatch as normaliser), so
gradient accumulation here is plain: every micro-batch's loss is already divided by the global token (or
sequence) count and the gradients are summed; under data parallelism DDP *averages* gradients over
processes, so each process multiplies its loss by the number of processes (:func:`dp_scale`) to keep the
sum. Statistics that the math needs over the whole batch (loss normalisers, advantage whitening) and the
logged metrics are summed over processes with :func:`all_sum`, one all-reduce each.

Launching several processes (each one a full copy of every model: data parallel, DDP):

    torchrun --standalone --nproc_per_node 2 -m rlhfkit.cli train sft --config sft.yaml     # CPU (gloo) or GPUs
    accelerate launch --multi_gpu --num_processes 4 -m rlhfkit.cli train ppo --config ppo.yaml   # GPUs

(``accelerate launch --cpu --num_processes 2`` starts ONE process; on CPU use torchrun.) Every run says
at start how many processes it has (:func:`world_info`, also in ``config.yaml``'s run line). Sharded
training: FSDP2 for every trainer (``train.sharding``, or an accelerate FSDP config:
:mod:`rlhfkit.engine.sharded`, which shards the models itself, so accelerate is kept from wrapping them);
DeepSpeed and Megatron-LM are refused at start-up (:func:`check_supported`).
"""

from __future__ import annotations

import os
import re
import sys
from datetime import timedelta
from typing import Any

import torch

from rlhfkit.errors import ConfigError

SHARDED_LAUNCH_ENV = {
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
}
"""What ``accelerate launch`` sets for a sharded configuration (accelerate ignores it on CPU and falls back to
plain data parallelism without a word; rlhfkit refuses it everywhere, so a launch trains as it says)."""


def make_accelerator(
    cpu: bool | None = None, sharding: bool = False, collective_timeout: float | None = None
):
    """An Accelerator with no mixed-precision wrapping (the dtype is chosen when the weights are loaded:
    :func:`rlhfkit.models.resolve_dtype`); refuses a launch rlhfkit cannot train under.

    ``sharding``: the caller shards its model itself under an accelerate FSDP config
    (:mod:`rlhfkit.engine.sharded`); the Accelerator is then built as for data parallelism, so that it
    neither wraps the model nor, on CPU, silently ignores the config.
    ``collective_timeout``: seconds a collective waits for the other processes (``train.collective_timeout``,
    the process group's timeout, gloo and NCCL alike); a collective that runs past it raises, and
    :func:`lost_process` names that. Applies when this call starts the process group (the first in a
    process); None keeps torch's default.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    check_supported(sharding=sharding)
    if cpu is None:
        cpu = not torch.cuda.is_available()
    hidden = os.environ.pop("ACCELERATE_USE_FSDP", None) if sharding else None
    if hidden is not None:
        # transformers would then load the weights on the first process only and leave the others' for
        # accelerate's FSDP wrapper to broadcast, which is not used here: every process loads them.
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    try:
        handlers = (
            [InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout))]
            if collective_timeout is not None
            else []
        )
        accelerator = Accelerator(
            cpu=cpu, mixed_precision="no", step_scheduler_with_optimizer=False, kwargs_handlers=handlers
        )
    finally:
        if hidden is not None:
            os.environ["ACCELERATE_USE_FSDP"] = hidden
    check_supported(accelerator, sharding=sharding)
    return accelerator


def check_supported(accelerator=None, sharding: bool = False) -> None:
    """ConfigError for a launch whose model wrapping rlhfkit's checkpoints and losses do not handle.

    Under FSDP or DeepSpeed every process holds a shard of each model. FSDP is handled by the offline
    trainers (``sharding=True``: :mod:`rlhfkit.engine.sharded`); the online loop's unwrapped forwards need
    whole models, and DeepSpeed's engine wraps the optimizer and checkpoints in its own format, so those
    launches would fail late or save a shard. They are refused before any model is loaded (from the
    launcher's environment, and from what ``accelerator`` ended up with), naming what works instead.
    """
    asked = [
        name
        for var, name in SHARDED_LAUNCH_ENV.items()
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes")
        and not (sharding and name == "FSDP")
    ]
    if accelerator is not None:
        kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
        if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
            asked.append(kind)
    if asked:
        where = "the trainers' own FSDP2" if asked[0] == "FSDP" else "FSDP2 through train.sharding"
        raise ConfigError(
            f"this launch asks for sharded training ({asked[0]}), which rlhfkit does not support here "
            f"({where}: examples/accelerate/fsdp_full_shard.yaml or train.sharding=full_shard); launch "
            "plain data parallelism instead: torchrun --nproc_per_node N -m rlhfkit.cli ..., or accelerate "
            "launch --multi_gpu --num_processes N -m rlhfkit.cli ... (each process holds the whole model), "
            "or use LoRA (model.lora_rank) to fit a larger model"
        )


def dp_scale(accelerator) -> float:
    """Multiply a globally normalised loss by this before backward, so DDP's gradient mean becomes a sum."""
    return float(accelerator.num_processes)


def all_sum(accelerator, values: torch.Tensor | float) -> torch.Tensor:
    """``values`` summed over processes: one all-reduce, in float64 (a float64 copy on one process).

    Pack everything that is summed at one point into one tensor: each call is a round trip between
    processes.
    """
    values = torch.as_tensor(values).detach().to(accelerator.device, torch.float64)
    if accelerator.num_processes == 1:
        return values.clone()
    return accelerator.reduce(values, reduction="sum")


def auto_precision() -> str:
    """What ``model.dtype=auto`` computes in here: bfloat16 on a CUDA GPU that supports it, else float32."""
    return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"


def world_info(accelerator) -> dict[str, Any]:
    """How this run is spread: processes, launcher, backend, device, torch threads per process."""
    backend = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        backend = torch.distributed.get_backend()
    launcher = (
        "torchrun"
        if "TORCHELASTIC_RUN_ID" in os.environ
        else "accelerate"
        if "ACCELERATE_MIXED_PRECISION" in os.environ
        else "python"
    )
    return {
        "world_size": accelerator.num_processes,
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)),
        "launcher": launcher,
        "backend": backend,
        "device": accelerator.device.type,
        "distributed_type": str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)),
        "threads_per_process": torch.get_num_threads(),
    }


def announce(info: dict[str, Any], kind: str) -> None:
    """One line on stderr at the start of a run (main process): how many processes train, and where."""
    n = info["world_size"]
    print(
        f"rlhfkit: {kind} on {n} process{'es' if n > 1 else ''} ({info['launcher']}"
        f"{', ' + info['backend'] if info['backend'] else ''}, {info['device']}), "
        f"{info['threads_per_process']} torch thread{'s' if info['threads_per_process'] > 1 else ''} each"
        + (f", model sharded ({info['sharding']}, FSDP2)" if info.get("sharding", "none") != "none" else ""),
        file=sys.stderr,
        flush=True,
    )


def launch_rank() -> int:
    """This process's global rank as the launcher set it (0 without a launcher); readable before any
    Accelerator exists."""
    return int(os.environ.get("RANK", "0") or 0)


def end_processes(wait: bool = True) -> None:
    """Leave the process group: every process waits for the others (``wait``), then destroys its group.

    Without it a process can exit while gloo's threads still run, and abort in C++
    ("terminate called without an active exception", SIGABRT) after training has finished. Safe to call
    when no group exists; called once at the end of every command (not between the stages of one
    process, which share the group). After an error pass ``wait=False``: the other processes may never
    arrive.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    try:
        if wait:
            torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


LOST_PROCESS_SIGNS = (
    "connection closed by peer",  # gloo: the other end's socket closed (it raised and left, or was killed)
    "connection reset by peer",
    "broken pipe",
    "timed out waiting",  # gloo: the collective ran past train.collective_timeout
    "operation timeout",  # NCCL's watchdog, likewise
    "communicator was aborted",  # NCCL
)
"""What a collective's error says (lower case) when another process of the run ended or stopped answering."""


def lost_process(exc: BaseException) -> str | None:
    """The cause in a few words when ``exc`` is a collective that failed because another process of this
    multi-process run ended, was killed or stopped answering; None for any other exception (a bug keeps its
    traceback) and in a process without a process group.

    torch raises these as ``torch.distributed.DistError`` (NCCL, the store) or as a plain ``RuntimeError``
    carrying gloo's message; the chain of causes is searched, since a wrapper may re-raise.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if torch.distributed.get_world_size() < 2:
        return None
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if isinstance(seen, getattr(torch.distributed, "DistError", ())) or (
            isinstance(seen, RuntimeError) and any(sign in text.lower() for sign in LOST_PROCESS_SIGNS)
        ):
            first = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else "")
            first = first.split(". This is typically")[0]  # gloo's advice that follows says the same
            return (
                f"process {torch.distributed.get_rank()} of {torch.distributed.get_world_size()}: another "
                f"process of this run ended or stopped answering ({type(seen).__name__}: {first[:200]})"
            )
        seen = seen.__cause__ or seen.__context__
    return None
