"""The checkpoint engine every trainer uses: safetensors + JSON, never pickle.

A checkpoint is a folder ``checkpoints/step-N/`` holding

    model.<name>.safetensors                       each model's state_dict (tied weights stored once; a LoRA
                                                   model's trained tensors only: adapters and head)
    optimizer.<name>.json / .safetensors           the optimizer's state_dict: structure in JSON, tensors apart
    scheduler.<name>.json (/ .safetensors)         the LR scheduler's state_dict
    rng.json / rng.safetensors                     python, numpy, torch (and CUDA) generator states
    trainer_state.json (/ .safetensors)            step, data position, KL controller, ...
    COMPLETE                                       written last: the step, every file's size and SHA-256

It is written into a temporary folder beside it and renamed into place once the marker is on disk, so
``step-N/`` is either complete or absent; a folder whose marker is missing or whose files do not match its
sizes (an interrupted copy) is not complete (:func:`complete_checkpoints`). Loading verifies every file's
checksum first (:func:`verify_checkpoint`), so a flipped byte is a named :class:`CheckpointError`, never
silently loaded weights; :func:`resume_checkpoint` picks the newest checkpoint that verifies and says on
stderr which newer ones it passed over and why. Model weights are checked to be finite before they are
written (a diverged run never leaves a checkpoint to resume into NaN). Loading restores models, optimizers,
schedulers and RNG streams so that a resumed run continues bit-identically on CPU (docs/known-bugs.md, 11;
huggingface/transformers#39215).

Every non-model state is stored with one encoder (:func:`_encode`): JSON for the structure (dicts with any
keys, lists, tuples, numbers, strings, None, non-finite floats) and one safetensors file for its tensors.
Python objects outside that set (a lambda's closure in a scheduler, a custom class) are refused with a
message naming their place, rather than pickled.

One process writes: under data parallelism, call :func:`save_checkpoint` on the main process only (the
other processes' RNG streams are not captured yet). A sharded (FSDP2) run writes its model and optimizer
shards beside this folder and the rest through :func:`save_checkpoint` (:mod:`rlhfkit.engine.sharded`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from rlhfkit.engine.finite import check_finite_weights
from rlhfkit.engine.seed import get_rng_state, set_rng_state
from rlhfkit.errors import CheckpointError

MARKER = "COMPLETE"
FORMAT = "rlhfkit-checkpoint-v1"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def save_checkpoint(
    checkpoints_dir: str | Path,
    step: int,
    models: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    schedulers: dict[str, Any] | None = None,
    trainer_state: dict[str, Any] | None = None,
    *,
    keep_last: int | None = None,
) -> Path:
    """Write ``checkpoints_dir/step-<step>/`` atomically and return its path.

    Args:
        checkpoints_dir: the run's ``checkpoints/`` folder (created if missing).
        step: the number of completed steps; a resumed run continues with ``step + 1``.
        models / optimizers / schedulers: name -> object; names are letters, digits, ``-`` and ``_``.
            Pass unwrapped models (``accelerator.unwrap_model``), so that the weight names are the model's.
        trainer_state: anything else the loop needs (data position, controller state, ...): plain data
            and tensors. ``step`` is added to it.
        keep_last: afterwards, delete all but the newest ``keep_last`` complete checkpoints.
    """
    optimizers, schedulers = optimizers or {}, schedulers or {}
    state = {"step": step, **(trainer_state or {})}
    if state["step"] != step:
        raise ValueError(f"trainer_state['step'] = {state['step']} disagrees with step = {step}")
    for name in [*models, *optimizers, *schedulers]:
        if not _NAME.match(name):
            raise ValueError(f"checkpoint object name {name!r}: use letters, digits, '-' and '_' only")

    for name, model in models.items():
        check_finite_weights(model, f"checkpoint step-{step}, model '{name}'")
    root = Path(checkpoints_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):  # left behind by a crash while saving
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step}"
    tmp.mkdir()

    for name, model in models.items():
        _save_weights(model, tmp / f"model.{name}.safetensors")
    for name, optimizer in optimizers.items():
        _save_state(optimizer.state_dict(), tmp, f"optimizer.{name}")
    for name, scheduler in schedulers.items():
        _save_state(scheduler.state_dict(), tmp, f"scheduler.{name}")
    _save_state(get_rng_state(), tmp, "rng")
    _save_state(state, tmp, "trainer_state")

    files, sums = {}, {}
    for path in sorted(tmp.iterdir()):
        _fsync(path)
        files[path.name] = path.stat().st_size
        sums[path.name] = file_sha256(path)
    marker = {
        "format": FORMAT,
        "step": step,
        "models": sorted(models),
        "optimizers": sorted(optimizers),
        "schedulers": sorted(schedulers),
        "files": files,
        "sha256": sums,
    }
    (tmp / MARKER).write_text(json.dumps(marker, indent=1))
    _fsync(tmp / MARKER)

    final = root / f"step-{step}"
    if final.exists():  # an older incomplete attempt at this step, or a run resumed from before it
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync(root)
    if keep_last is not None:
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old)
    return final


def load_checkpoint(
    path: str | Path,
    models: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    schedulers: dict[str, Any] | None = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore a checkpoint into the given objects (in place) and return its trainer state.

    The names must be exactly those saved, so that nothing is silently left at its initial value.
    Optimizer state moves to its parameters' device; tensors in the trainer state come back on CPU.

    Raises:
        CheckpointError: incomplete or corrupt checkpoint (a file whose checksum differs from the marker's,
            or that cannot be read), different names, or weights that do not fit the model.
    """
    optimizers, schedulers = optimizers or {}, schedulers or {}
    path = Path(path)
    marker = verify_checkpoint(path)
    for kind, given in (("models", models), ("optimizers", optimizers), ("schedulers", schedulers)):
        if sorted(given) != marker[kind]:
            raise CheckpointError(f"{path}: holds {kind} {marker[kind]}, but this run has {sorted(given)}")

    for name, model in models.items():
        device = next((p.device for p in model.parameters()), "cpu")
        try:
            _load_weights(model, path / f"model.{name}.safetensors", device)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(
                f"{path}: model '{name}' cannot be read ({type(e).__name__}: {_first_line(e)})"
            ) from None
        except RuntimeError as e:
            raise CheckpointError(
                f"{path}: model '{name}' does not fit the saved weights: {str(e).splitlines()[0]}"
            ) from None
    try:
        for name, optimizer in optimizers.items():
            optimizer.load_state_dict(_load_state(path, f"optimizer.{name}"))
        for name, scheduler in schedulers.items():
            scheduler.load_state_dict(_load_state(path, f"scheduler.{name}"))
        if restore_rng:
            set_rng_state(_load_state(path, "rng"))
        return _load_state(path, "trainer_state")
    except (OSError, ValueError, KeyError, TypeError, IndexError, SafetensorError) as e:
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {_first_line(e)})") from None


def _trained_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter] | None:
    """A LoRA (peft) model's trained parameters, by name; None for any other model (saved whole)."""
    if not hasattr(model, "peft_config"):
        return None
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _save_weights(model: torch.nn.Module, file: Path) -> None:
    """A model's weights; of a LoRA model only the trained ones (its base is frozen and reloaded from its
    folder on resume, so a checkpoint holds the adapters and head, not a copy of the base)."""
    trained = _trained_weights(model)
    if trained is None:
        save_model(model, str(file))  # drops the duplicates of tied weights
    else:
        save_file({name: p.detach().to("cpu").contiguous() for name, p in trained.items()}, str(file))


def _load_weights(model: torch.nn.Module, file: Path, device) -> None:
    """Load what :func:`_save_weights` wrote, strictly: every saved tensor, no more, no fewer (RuntimeError)."""
    trained = _trained_weights(model)
    if trained is None:
        load_model(model, str(file), strict=True, device=str(device))
        return
    tensors = load_file(str(file))
    if set(tensors) != set(trained):
        missing, unexpected = sorted(set(trained) - set(tensors)), sorted(set(tensors) - set(trained))
        raise RuntimeError(f"LoRA weights differ: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, p in trained.items():
            if tensors[name].shape != p.shape:
                raise RuntimeError(
                    f"{name}: saved shape {tuple(tensors[name].shape)}, model {tuple(p.shape)}"
                )
            p.copy_(tensors[name])


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    """The newest complete ``step-N`` folder in ``checkpoints_dir``, or None if there is none."""
    complete = complete_checkpoints(checkpoints_dir)
    return complete[-1] if complete else None


def complete_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """Every complete ``step-N`` folder in ``checkpoints_dir``, oldest first."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and _read_marker(child) is not None:
            found.append((int(match.group(1)), child))
    return [p for _, p in sorted(found)]


def checkpoint_step(path: str | Path) -> int:
    """The step a complete checkpoint was saved at."""
    marker = _read_marker(Path(path))
    if marker is None:
        raise CheckpointError(f"{path}: not a complete rlhfkit checkpoint (no valid {MARKER} marker)")
    return marker["step"]


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, as hex (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(path: str | Path) -> dict:
    """The marker of a complete checkpoint whose every file matches its recorded SHA-256, a sharded run's
    shard files (``step-N.sharded/``) included.

    A marker written before checksums were recorded is checked by size only.

    Raises:
        CheckpointError: no valid marker, a missing or truncated file, or a file whose checksum differs.
    """
    path = Path(path)
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path}: not a complete rlhfkit checkpoint (no readable {MARKER} marker: {_first_line(e)})"
        ) from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a complete rlhfkit checkpoint ({MARKER} is not an {FORMAT} marker)"
        )
    if _read_marker(path) is None:
        raise CheckpointError(
            f"{path}: not a complete rlhfkit checkpoint (a file listed in {MARKER} is missing or truncated)"
        )
    sums = marker.get("sha256") or {}
    for name in sorted(sums):
        if file_sha256(path / name) != sums[name]:
            raise CheckpointError(f"{path}: corrupt: {name} does not match its checksum in {MARKER}")
    _verify_shards(path)
    return marker


def _verify_shards(path: Path) -> None:
    """A sharded run's model and optimizer shards (``step-N.sharded/``, :mod:`rlhfkit.engine.sharded`), listed
    with their sizes and SHA-256 in the trainer state of ``step-N``: each there, of its size and checksum."""
    try:
        info = _decode(json.loads((path / "trainer_state.json").read_text()).get("sharded"), {}) or {}
        shards, sums = path.with_name(info["folder"]) if info else path, info.get("sha256") or {}
        sizes = {
            name: (shards / name).stat().st_size
            for name in info.get("files", {})
            if (shards / name).is_file()
        }
        bad = [n for n in sorted(info.get("files", {})) if sizes.get(n) != info["files"][n]]
        bad = bad or [n for n in sorted(sums) if file_sha256(shards / n) != sums[n]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {_first_line(e)})") from None
    if bad:
        raise CheckpointError(
            f"{shards / bad[0]}: corrupt: missing, or not the size or checksum that {path} records"
        )


def resume_checkpoint(checkpoints_dir: str | Path, announce: bool = True) -> Path | None:
    """The newest checkpoint that verifies (:func:`verify_checkpoint`), or None.

    Each newer ``step-N`` folder passed over (incomplete, truncated, corrupt) is named on stderr with the
    reason when ``announce``, and so is the one used instead.
    """
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return None
    candidates = sorted(
        (int(m.group(1)), child)
        for child in root.iterdir()
        if (m := _STEP_DIR.match(child.name)) and child.is_dir()
    )
    passed: list[str] = []
    for _, child in reversed(candidates):
        try:
            verify_checkpoint(child)
        except CheckpointError as e:
            passed.append(str(e))
            continue
        if passed and announce:
            for reason in passed:
                print(f"rlhfkit: warning: checkpoint {reason}; not used", file=sys.stderr, flush=True)
            print(f"rlhfkit: resuming from the previous complete checkpoint, {child}", file=sys.stderr)
        return child
    if passed and announce:
        for reason in passed:
            print(f"rlhfkit: warning: checkpoint {reason}; not used", file=sys.stderr, flush=True)
        print("rlhfkit: no complete checkpoint is left; the run starts again from step 0", file=sys.stderr)
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _read_marker(path: Path) -> dict | None:
    """The marker's contents if it exists and every file it lists is there with its size, else None."""
    try:
        marker = json.loads((path / MARKER).read_text())
        if marker.get("format") != FORMAT:
            return None
        for name, size in marker["files"].items():
            if (path / name).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    return marker


def _fsync(path: Path) -> None:
    """Flush a file, or a folder's entries, to disk (folders cannot be opened on Windows: skipped)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------
# Plain data + tensors <-> JSON + safetensors


def _save_state(obj: Any, folder: Path, stem: str) -> None:
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(obj, stem, tensors, set())
    (folder / f"{stem}.json").write_text(json.dumps(encoded, indent=1, allow_nan=False))
    if tensors:
        save_file(tensors, str(folder / f"{stem}.safetensors"))


def _load_state(folder: Path, stem: str) -> Any:
    encoded = json.loads((folder / f"{stem}.json").read_text())
    tensor_file = folder / f"{stem}.safetensors"
    tensors = load_file(str(tensor_file)) if tensor_file.exists() else {}
    return _decode(encoded, tensors)


def _encode(obj: Any, where: str, tensors: dict[str, torch.Tensor], storages: set[int]) -> Any:
    """JSON-ready form of ``obj``; its tensors go to ``tensors``. ``where`` names the place, for errors."""
    if obj is None or isinstance(obj, bool | str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else {"__float__": repr(float(obj))}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in storages:  # safetensors refuses two views of one storage
            t = t.clone()
        if t.numel():
            storages.add(t.untyped_storage().data_ptr())
        key = str(len(tensors))  # not `where`: dict keys containing "." could make two places collide
        tensors[key] = t
        return {"__tensor__": key}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{where}.{i}", tensors, storages) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{where}.{i}", tensors, storages) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, f"{where}.{k}", tensors, storages) for k, v in obj.items()}
        return {
            "__items__": [
                [
                    _encode(k, f"{where}.key{i}", tensors, storages),
                    _encode(v, f"{where}.{k}", tensors, storages),
                ]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    if hasattr(obj, "item") and getattr(obj, "shape", None) == ():  # a numpy scalar
        return _encode(obj.item(), where, tensors, storages)
    raise TypeError(
        f"checkpoint: cannot store {type(obj).__name__} at {where}; use plain data and tensors "
        "(rlhfkit never pickles)"
    )


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}
