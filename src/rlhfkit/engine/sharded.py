"""Sharded training with FSDP2 (``torch.distributed.fsdp.fully_shard``): the offline trainers' model here, the
online roles through :mod:`rlhfkit.trainers.online.sharding`.

With ``train.sharding`` = ``full_shard`` (or an accelerate FSDP config: :func:`sharding_mode`) each of the W
processes holds 1/W of every parameter, gradient and optimizer moment of the trained model; each decoder
layer (the model's ``_no_split_modules``) and then the whole model are one FSDP unit (Zhao et al. 2023,
"PyTorch FSDP"). ``full_shard`` frees a layer's gathered parameters after its forward (ZeRO-3 like);
``shard_grad_op`` keeps them until the backward (ZeRO-2 like: more memory, one all-gather fewer). The loss
arithmetic is the data-parallel one: FSDP's reduce-scatter averages gradients over processes as DDP does, so
:func:`rlhfkit.engine.accel.dp_scale` applies unchanged and W sharded processes compute what one process
computes on the same global batch.

Checkpoints (:func:`save_roles`: one or several models by role name). A sharded run's
``checkpoints/step-N/`` is an ordinary engine checkpoint (scheduler, RNG,
trainer state, the ``COMPLETE`` marker) without model or optimizer files; those are in
``checkpoints/step-N.sharded/``, written by every process with ``torch.distributed.checkpoint`` (DCP) before
the marker of ``step-N`` is: the marker's trainer state lists the shard files with their sizes and SHA-256
(checked wherever every file of ``step-N`` is, so a corrupt shard makes ``--resume`` fall back to the previous
complete checkpoint on every process), so a step is complete only when both are. A check that fails at load
on any process stops every process with its line (the verdict is gathered from all of them). Only tensors go
to DCP (weights, Adam moments and step counts); the optimizer's hyper-parameters are JSON. DCP writes its index (``.metadata``) with pickle: it is read back here with
torch's weights-only unpickler and an allow-list of DCP's own record classes, and any non-tensor item is
refused, so loading runs no arbitrary code. DCP re-shards on load, so a checkpoint of W processes resumes
under another W, one included: a process that no launcher started gets a process group of one
(:func:`single_process_group`). An optimizer without state (before its first step) is saved and restored as
such, its hyper-parameters in the JSON: building its DCP state would take a step (docs/known-bugs.md, 12).

At the end of training every process gathers the full weights into a plain (unsharded) copy of the model
(:func:`unshard`): evaluation, ``final/`` (a plain Hugging Face folder with safetensors, written by the main
process) and the reward model's normalisation then run as they do without sharding. This briefly needs one
whole model per process.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

# the sharding a run uses is defined with the checks that read it (the config layer), named here too
from rlhfkit.config.checks import launch_sharding, sharding_mode  # noqa: F401
from rlhfkit.engine.checkpoint import MARKER, file_sha256
from rlhfkit.engine.checkpoint import load_checkpoint as load_engine_checkpoint
from rlhfkit.engine.checkpoint import save_checkpoint as save_engine_checkpoint
from rlhfkit.errors import CheckpointError, ConfigError

MODES = ("none", "full_shard", "shard_grad_op")
SUFFIX = ".sharded"
_PLAIN_CLASS = "_rlhfkit_plain_class"


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Shard ``model`` in place over the process group (each decoder layer, then the root) and return it.

    A plain single-process start (``python``, ``rlhfkit train ... --resume`` on one machine, no launcher)
    gets a process group of one (:func:`single_process_group`): the same sharded code and checkpoints, each
    shard the whole tensor.

    Raises:
        ConfigError: a LoRA model (already small to train: its frozen base is not sharded; use data
            parallelism), or a model that names no decoder layer class.
    """
    from torch.distributed.fsdp import fully_shard

    if mode not in MODES[1:]:
        raise ConfigError(f"train.sharding: expected one of {', '.join(MODES)}, got {mode!r}")
    if is_sharded(model):  # already sharded by its caller
        return model
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        single_process_group(next(model.parameters()).device)
    if hasattr(model, "peft_config"):
        raise ConfigError(
            f"train.sharding={mode} with model.lora_rank: a LoRA run trains only its adapters; run it with "
            "train.sharding=none (data parallel), which already keeps the frozen base out of the optimizer"
        )
    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise ConfigError(
            f"train.sharding={mode}: {type(model).__name__} names no decoder layer class "
            "(_no_split_modules) to shard by; use train.sharding=none"
        )
    plain_class = type(model)
    reshard = mode == "full_shard"
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard)
    # The root (embeddings, final norm, head) stays gathered from forward to backward in a trained model, as
    # FSDP2's own default for the root: FSDP re-gathers a resharded unit when the gradient reaches the unit's
    # outputs, and a scalar model's loss reads its head's per-token output (rlhfkit.models.readout
    # token_scores), not the model's output, so a resharded root would be missing in the backward. A frozen
    # model has no backward: its root is resharded after each forward.
    trained = any(p.requires_grad for p in model.parameters())
    fully_shard(model, reshard_after_forward=reshard and not trained)
    setattr(model, _PLAIN_CLASS, plain_class)
    return model


def single_process_group(device: torch.device | str) -> None:
    """Start a process group of one for a process that no launcher started (gloo on a CPU, NCCL on a GPU),
    so that a sharded run, or the resume of one, runs on a single process as under ``torchrun
    --nproc_per_node 1``. :func:`rlhfkit.engine.accel.end_processes` ends it with the command.

    Raises:
        ConfigError: the launcher says there are several processes (``WORLD_SIZE``) but none started a group.
    """
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world != 1:
        raise ConfigError(
            f"WORLD_SIZE={world} but no process group was started; launch with torchrun --nproc_per_node N "
            "-m rlhfkit.cli ... (or accelerate launch)"
        )
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm of a sharded model (every process's shards together); the norm before."""
    from torch.distributed.tensor import DTensor

    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(total.full_tensor() if isinstance(total, DTensor) else total)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights of a sharded model, on every process (a collective: every process must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def unshard(model: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of a sharded model with its whole weights, on every process (a collective)."""
    # each weight in its own storage: a gathered one can be a view of a larger buffer, which safetensors
    # refuses to save (copied only then, so that the whole model is not held twice)
    full = {
        name: t.detach()
        if t.untyped_storage().nbytes() == t.numel() * t.element_size()
        else t.detach().clone()
        for name, t in full_state_dict(model).items()
    }
    plain_class = getattr(model, _PLAIN_CLASS)
    with torch.device("meta"):
        plain = plain_class(model.config)
    plain.load_state_dict(full, strict=True, assign=True)
    buffers = dict(model.named_buffers())
    for name, buffer in list(plain.named_buffers()):  # not in the state dict: rotary frequencies, ...
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            plain.get_submodule(owner)._buffers[leaf] = buffers[name]
    if getattr(model.config, "tie_word_embeddings", False):
        plain.tie_weights()
    left = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"unshard: no value for {left[:3]}")
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    trained = {name: p.requires_grad for name, p in model.named_parameters()}
    for name, p in plain.named_parameters():
        p.requires_grad_(trained.get(name, True))
    plain.train(model.training)
    return plain


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: DCP for the shards, the engine's checkpoint for the rest


def _tensors_only(obj: Any, where: str) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            _tensors_only(value, f"{where}.{key}")
    elif not isinstance(obj, torch.Tensor):
        raise TypeError(f"sharded checkpoint: {where} is a {type(obj).__name__}, not a tensor")


def _dcp_state(models: dict, optimizers: dict) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """(the tensors of every model and optimizer, sharded; each optimizer's param_groups, plain data).

    The keys are ``model`` / ``optim`` for the role named ``model`` (the offline trainers' one model) and
    ``<role>.model`` / ``<role>.optim`` for the others (the online actor and critic). torch builds the DCP
    state of an optimizer that holds none by taking a step at lr 0, which leaves AdamW at step 1 with zero
    moments (docs/known-bugs.md): harmless for a load target, whose state the load replaces, but a save passes
    only the optimizers that hold state (:func:`_stateless`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {}
    groups: dict[str, list[dict[str, Any]]] = {}
    for name, model in models.items():
        prefix = "" if name == "model" else f"{name}."
        state[prefix + "model"] = get_model_state_dict(model)
        if name in optimizers:
            optim = get_optimizer_state_dict(model, optimizers[name])
            state[prefix + "optim"] = optim["state"]
            groups[name] = optim["param_groups"]
    _tensors_only(state, "state")
    return state, groups


def _stateless(optimizers: dict) -> dict[str, list[dict[str, Any]]]:
    """The hyper-parameters of each optimizer that holds no state yet (before its first step: a critic's
    warm-up leaves the actor's untouched, a skipped rollout both), by role: saved and restored as having no
    state, so that a save changes nothing and a resumed optimizer takes the first step a fresh one takes."""
    return {
        name: [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        for name, optimizer in optimizers.items()
        if not optimizer.state
    }


def shard_folder(step_dir: str | Path) -> Path:
    step_dir = Path(step_dir)
    return step_dir.with_name(step_dir.name + SUFFIX)


def save_checkpoint(
    checkpoints_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    *,
    main_process: bool,
    keep_last: int | None = None,
) -> None:
    """:func:`save_roles` for one model (the offline trainers). A collective."""
    save_roles(
        checkpoints_dir,
        step,
        {"model": model},
        {"model": optimizer},
        {"model": scheduler},
        trainer_state,
        main_process=main_process,
        keep_last=keep_last,
    )


def save_roles(
    checkpoints_dir: str | Path,
    step: int,
    models: dict[str, torch.nn.Module],
    optimizers: dict,
    schedulers: dict,
    trainer_state: dict[str, Any],
    *,
    main_process: bool,
    keep_last: int | None = None,
) -> None:
    """Write ``step-N.sharded/`` (every process: its shards of ``models`` and ``optimizers``, by role name)
    then ``step-N/`` (the main process: ``schedulers``, RNG, ``trainer_state``, the marker). A collective."""
    import torch.distributed.checkpoint as dcp

    root = Path(checkpoints_dir)
    shards = shard_folder(root / f"step-{step}")
    if main_process and shards.exists():  # an attempt at this step that never got its marker
        shutil.rmtree(shards)
    torch.distributed.barrier()
    stateless = _stateless(optimizers)
    state, groups = _dcp_state(models, {n: o for n, o in optimizers.items() if n not in stateless})
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(shards)))
    torch.distributed.barrier()
    if main_process:
        written = [p for p in sorted(shards.iterdir()) if p.is_file()]
        info = {
            "folder": shards.name,
            "files": {p.name: p.stat().st_size for p in written},
            "sha256": {p.name: file_sha256(p) for p in written},
            "world_size": torch.distributed.get_world_size(),
            "param_groups": groups,
            "stateless_optimizers": stateless,
        }
        save_engine_checkpoint(
            root, step, {}, {}, schedulers, {**trainer_state, "sharded": info}, keep_last=keep_last
        )
        kept = {p.name for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(SUFFIX)}
        for folder in root.glob(f"step-*{SUFFIX}"):  # the shards of deleted (or never completed) steps
            if folder.name[: -len(SUFFIX)] not in kept:
                shutil.rmtree(folder, ignore_errors=True)
    torch.distributed.barrier()


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer, scheduler) -> dict[str, Any]:
    """:func:`load_roles` for one model (the offline trainers). A collective."""
    return load_roles(path, {"model": model}, {"model": optimizer}, {"model": scheduler})


def load_roles(path: str | Path, models: dict, optimizers: dict, schedulers: dict) -> dict[str, Any]:
    """Restore a sharded checkpoint (written under any number of processes) into sharded ``models`` and
    their ``optimizers``, by role name. A collective.

    Raises:
        CheckpointError: ``path`` is not a sharded checkpoint, or its shards are missing or changed.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    state = _on_every_process(lambda: _engine_state(path, schedulers))
    info = state.pop("sharded")
    shards = path.with_name(info["folder"])
    groups = info["param_groups"]
    if isinstance(groups, list):  # written before checkpoints held several roles
        groups = {"model": groups}
    stateless = info.get("stateless_optimizers", {})
    target, _ = _dcp_state(models, {n: o for n, o in optimizers.items() if n not in stateless})
    reader, planner = safe_reader_and_planner(shards)
    dcp.load(target, storage_reader=reader, planner=planner)
    for name, model in models.items():
        prefix = "" if name == "model" else f"{name}."
        set_model_state_dict(model, target[prefix + "model"])
        if name in stateless:  # saved before its first step: its hyper-parameters only, no state
            _restore_hyper_parameters(optimizers[name], stateless[name], path)
        elif name in optimizers:
            set_optimizer_state_dict(
                model,
                optimizers[name],
                {"state": target[prefix + "optim"], "param_groups": groups[name]},
            )
    return state


def _engine_state(path: Path, schedulers: dict) -> dict[str, Any]:
    """The trainer state of the sharded checkpoint ``path``, its schedulers restored, every file of ``step-N/``
    and of its shard folder verified (:func:`rlhfkit.engine.checkpoint.verify_checkpoint`)."""
    try:
        saved = json.loads((path / MARKER).read_text()).get("models")
    except (OSError, ValueError, AttributeError):
        saved = None  # no readable marker: the load names it
    if saved:
        raise CheckpointError(
            f"{path}: holds the models {saved} whole, not sharded; a run with train.sharding resumes only "
            "checkpoints of a sharded run (resume this one with train.sharding=none)"
        )
    state = load_engine_checkpoint(path, {}, {}, schedulers)
    if not isinstance(state.get("sharded"), dict):
        raise CheckpointError(f"{path}: not a sharded checkpoint; resume it with train.sharding=none")
    return state


def _on_every_process(check):
    """``check()``'s result on every process, or, where it raised a CheckpointError on any process, that
    error (the lowest rank's) raised on every process: no process goes on into a collective that the others
    left, and each stops with the same line."""
    verdict = None
    try:
        result = check()
    except (CheckpointError, OSError) as e:
        result, verdict = None, str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    verdicts: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(verdicts, verdict)
    found = next((v for v in verdicts if v is not None), None)
    if found is not None:
        raise CheckpointError(found)
    return result


def _restore_hyper_parameters(optimizer, groups: list[dict[str, Any]], path: Path) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{path}: the optimizer has {len(optimizer.param_groups)} parameter groups, the checkpoint "
            f"{len(groups)}"
        )
    for live, saved in zip(optimizer.param_groups, groups, strict=True):
        live.update({k: tuple(v) if isinstance(live.get(k), tuple) else v for k, v in saved.items()})


_ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
"""What DCP's index may name: its own record classes, torch sizes, dtypes and layouts, paths."""


def read_metadata(folder: str | Path):
    """DCP's index of ``folder``, unpickled with weights-only semantics: any global outside
    :data:`_ALLOWED_GLOBALS` (and torch dtypes) is refused before it is called, so no arbitrary code runs
    (the restricted ``find_class`` of the Python documentation, "Restricting Globals")."""
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if name in _ALLOWED_GLOBALS.get(module, ()):
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed")

    with open(Path(folder) / ".metadata", "rb") as f:
        try:
            return Restricted(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
            raise CheckpointError(
                f"{folder}/.metadata: refused by the weights-only reader: {str(e).splitlines()[0]}"
            ) from None


def safe_reader_and_planner(folder: str | Path):
    """DCP's file reader with its index read by :func:`read_metadata` instead of ``pickle.load``, and DCP's
    load planner refusing any non-tensor item (which DCP would ``torch.load`` without restriction)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    reader_class, planner_class = FileSystemReader, DefaultLoadPlanner

    class SafeReader(reader_class):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if kwargs.get("rank") is not None:
                raise CheckpointError(f"{self.path}: per-rank DCP metadata is not used by rlhfkit")
            metadata = read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class TensorsOnlyPlanner(planner_class):
        def load_bytes(self, read_item, value) -> None:
            raise CheckpointError(
                f"sharded checkpoint: item {read_item.dest_index.fqn!r} is not a tensor; rlhfkit stores "
                "only tensors there and does not unpickle anything else"
            )

    return SafeReader(str(folder)), TensorsOnlyPlanner()
