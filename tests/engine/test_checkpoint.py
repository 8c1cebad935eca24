"""Checkpoint engine: safetensors + JSON round trips, atomic folders, bit-identical resume on CPU."""

import json
import math
import pickle
import random

import numpy as np
import pytest
import torch
from torch import nn

from rlhfkit.engine.checkpoint import (
    _decode,
    _encode,
    checkpoint_step,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rlhfkit.engine.seed import get_rng_state, seed_everything, set_rng_state
from rlhfkit.errors import CheckpointError, UserError


class Net(nn.Module):
    """Tiny model with dropout (draws from torch's RNG) and tied input/output weights."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight  # tied, as in many language models


def build(seed):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def train(model, opt, sched, steps):
    """Each step draws from python's, numpy's and torch's global generators."""
    for _ in range(steps):
        tokens = torch.randint(0, 11, (4, 5))
        shift = random.randrange(11)
        scale = float(np.random.uniform(0.5, 1.5))
        h = model.drop(torch.tanh(model.hidden(model.embed(tokens)))) * scale
        logits = model.out(h)  # (B, T, V)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ((tokens + shift) % 11).flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()


def resumed_run(tmp_path, restore_rng=True):
    seed_everything(0)
    model, opt, sched = build(0)
    train(model, opt, sched, 3)
    path = save_checkpoint(
        tmp_path / "checkpoints",
        3,
        {"policy": model},
        {"policy": opt},
        {"policy": sched},
        {"data_position": 12, "kl_coef": 0.05},
    )
    # A fresh process: other initial weights, other RNG positions.
    seed_everything(99)
    model, opt, sched = build(123)
    train(model, opt, sched, 1)
    model, opt, sched = build(7)
    state = load_checkpoint(
        path, {"policy": model}, {"policy": opt}, {"policy": sched}, restore_rng=restore_rng
    )
    train(model, opt, sched, 3)
    return model, opt, sched, state


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    seed_everything(0)
    model, opt, sched = build(0)
    train(model, opt, sched, 6)
    next_draws = (random.random(), float(np.random.rand()), torch.rand(2))

    resumed, r_opt, r_sched, state = resumed_run(tmp_path)
    resumed_draws = (random.random(), float(np.random.rand()), torch.rand(2))
    assert state == {"step": 3, "data_position": 12, "kl_coef": 0.05}
    for (name, p), q in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert resumed.out.weight is resumed.embed.weight  # still tied after loading
    for s, t in zip(opt.state.values(), r_opt.state.values(), strict=True):
        assert all(torch.equal(s[k], t[k]) for k in s)
    assert (
        sched.state_dict() == r_sched.state_dict()
        and opt.param_groups[0]["lr"] == r_opt.param_groups[0]["lr"]
    )
    # The next draws of every generator agree too.
    assert next_draws[:2] == resumed_draws[:2] and torch.equal(next_draws[2], resumed_draws[2])


def test_without_the_rng_restore_the_runs_differ(tmp_path):
    """Negative control: the test above depends on restoring RNG streams, not on luck."""
    seed_everything(0)
    model, opt, sched = build(0)
    train(model, opt, sched, 6)
    resumed, *_ = resumed_run(tmp_path, restore_rng=False)
    assert not torch.equal(model.hidden.weight, resumed.hidden.weight)


def test_rng_streams_continue_identically(tmp_path):
    seed_everything(5)
    torch.rand(3), random.random(), np.random.rand()
    path = save_checkpoint(tmp_path, 1, {})
    expected = (
        torch.rand(4),
        [random.random() for _ in range(3)],
        np.random.rand(3),
        random.gauss(0, 1),
        np.random.normal(),
    )
    seed_everything(6)
    load_checkpoint(path, {})
    got = (
        torch.rand(4),
        [random.random() for _ in range(3)],
        np.random.rand(3),
        random.gauss(0, 1),
        np.random.normal(),
    )
    assert torch.equal(expected[0], got[0]) and expected[1] == got[1] and np.array_equal(expected[2], got[2])
    assert expected[3:] == got[3:]
    # and the state survives a second capture/restore in memory
    state = get_rng_state()
    a = torch.rand(2)
    set_rng_state(state)
    assert torch.equal(a, torch.rand(2))


def test_incomplete_checkpoints_are_ignored(tmp_path):
    model = nn.Linear(3, 2)
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(root) is None
    for step in (2, 4, 10):
        save_checkpoint(root, step, {"m": model})
    assert latest_checkpoint(root).name == "step-10" and checkpoint_step(latest_checkpoint(root)) == 10
    (root / "step-10" / "COMPLETE").unlink()  # crashed before the marker
    assert latest_checkpoint(root).name == "step-4"
    with (root / "step-4" / "model.m.safetensors").open("ab") as f:  # an interrupted copy: size differs
        f.write(b"x")
    assert latest_checkpoint(root).name == "step-2"
    (root / ".tmp-step-12").mkdir()  # a save in progress
    (root / "step-x").mkdir()
    assert [p.name for p in complete_checkpoints(root)] == ["step-2"]
    with pytest.raises(CheckpointError, match="not a complete rlhfkit checkpoint"):
        load_checkpoint(root / "step-10", {"m": model})
    # saving again at step 10 replaces the incomplete folder and clears the stale temporary one
    save_checkpoint(root, 10, {"m": model})
    assert latest_checkpoint(root).name == "step-10" and not (root / ".tmp-step-12").exists()
    assert issubclass(CheckpointError, UserError)


def test_keep_last(tmp_path):
    model = nn.Linear(2, 2)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"m": model}, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-4", "step-5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-5"]


def test_names_and_shapes_must_match(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path, 1, {"actor": model}, {"actor": opt})
    with pytest.raises(
        CheckpointError, match=r"holds models \['actor'\], but this run has \['actor', 'critic'\]"
    ):
        load_checkpoint(path, {"actor": model, "critic": nn.Linear(3, 1)}, {"actor": opt})
    with pytest.raises(CheckpointError, match="holds optimizers"):
        load_checkpoint(path, {"actor": model})
    with pytest.raises(CheckpointError, match="model 'actor' does not fit"):
        load_checkpoint(path, {"actor": nn.Linear(4, 2)}, {"actor": opt})
    with pytest.raises(ValueError, match="name 'a/b'"):
        save_checkpoint(tmp_path, 2, {"a/b": model})


def test_only_safetensors_and_json_no_pickle(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    monkeypatch.setattr(torch, "save", refuse)
    monkeypatch.setattr(pickle, "dump", refuse)
    monkeypatch.setattr(pickle, "dumps", refuse)
    seed_everything(0)
    model, opt, sched = build(0)
    train(model, opt, sched, 1)
    path = save_checkpoint(tmp_path, 1, {"policy": model}, {"policy": opt}, {"policy": sched})
    names = sorted(p.name for p in path.iterdir())
    assert names == [
        "COMPLETE",
        "model.policy.safetensors",
        "optimizer.policy.json",
        "optimizer.policy.safetensors",
        "rng.json",
        "rng.safetensors",
        "scheduler.policy.json",
        "trainer_state.json",
    ]
    for name in names:
        if name.endswith(".json") or name == "COMPLETE":
            json.loads((path / name).read_text())  # strict JSON (no NaN literals)


def test_encoder_round_trips_plain_data_and_tensors():
    base = torch.arange(12, dtype=torch.float32)
    obj = {
        "ints": {0: "a", 3: (1, 2.5, None)},
        "__dunder": [True, False, "x"],
        "floats": [math.inf, -math.inf, 1e-300, 0.1],
        "tensors": [
            torch.tensor(3.0),
            torch.randn(2, 3).to(torch.bfloat16),
            torch.tensor([1, 2], dtype=torch.int64),
            torch.tensor([True, False]),
            torch.empty(0, 4),
            base[:4],
            base[4:],
            base.view(3, 4).t(),
        ],
        "numpy": np.float32(0.25),
        "np_int": np.int64(7),
        "dotted.key": {"a": torch.ones(1)},
        "dotted": {"key.a": torch.zeros(1)},
    }
    tensors = {}
    encoded = _encode(obj, "state", tensors, set())
    text = json.dumps(encoded, allow_nan=False)
    decoded = _decode(json.loads(text), tensors)
    assert decoded["ints"] == {0: "a", 3: (1, 2.5, None)} and decoded["__dunder"] == [True, False, "x"]
    assert decoded["floats"] == [math.inf, -math.inf, 1e-300, 0.1]
    for a, b in zip(obj["tensors"], decoded["tensors"], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert decoded["numpy"] == 0.25 and decoded["np_int"] == 7 and type(decoded["np_int"]) is int
    assert torch.equal(decoded["dotted.key"]["a"], torch.ones(1))
    assert torch.equal(decoded["dotted"]["key.a"], torch.zeros(1))
    nan = _decode(json.loads(json.dumps(_encode(math.nan, "x", {}, set()))), {})
    assert math.isnan(nan)
    with pytest.raises(TypeError, match=r"cannot store function at state\.fn"):
        _encode({"fn": lambda: 1}, "state", {}, set())


class _Interrupted(Exception):
    """Stands for a kill at one point of a save."""


def _interrupt_after(monkeypatch, k: int) -> list[str]:
    """Make the k-th file-system write of a save (a safetensors file, a text/bytes file, a rename) raise right
    after it has happened; returns the log of writes seen."""
    import os
    import pathlib

    import rlhfkit.engine.checkpoint as engine

    seen: list[str] = []
    depth = [0]  # Path.rename calls os.rename: count the outer call only

    def wrap(owner, name, label):
        real = getattr(owner, name)

        def write(*args, **kwargs):
            depth[0] += 1
            try:
                result = real(*args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0]:
                return result
            seen.append(f"{label}:{args[1] if label in ('save', 'file') else args[0]}")
            if len(seen) == k:
                raise _Interrupted(seen[-1])
            return result

        monkeypatch.setattr(owner, name, write)

    for name in ("save_model", "save_file"):
        if hasattr(engine, name):
            wrap(engine, name, "save" if name == "save_model" else "file")
    for name in ("write_text", "write_bytes", "rename", "replace"):
        wrap(pathlib.Path, name, name)
    for name in ("rename", "replace"):
        wrap(os, name, name)
    return seen


def test_a_save_interrupted_at_each_write_leaves_the_previous_checkpoint_the_newest(tmp_path, monkeypatch):
    """Kill a save after each of its writes in turn (every file, the marker, the final rename): the newest
    complete checkpoint is still the previous one and loads; a checkpoint written straight into step-N, or
    whose marker lands before its last file, fails here. Then an uninterrupted save of the same step works."""
    root = tmp_path / "checkpoints"
    model, opt, sched = build(0)
    train(model, opt, sched, 1)
    save_checkpoint(root, 1, {"policy": model}, {"policy": opt}, {"policy": sched}, {"data_position": 4})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, sched, 1)

    # How many writes a whole save makes (into a scratch folder, same objects).
    with monkeypatch.context() as m:
        writes = _interrupt_after(m, 0)
        save_checkpoint(
            tmp_path / "scratch",
            2,
            {"policy": model},
            {"policy": opt},
            {"policy": sched},
            {"data_position": 8},
        )
    assert len(writes) >= 7, (
        writes
    )  # model, optimizer (json + tensors), scheduler, rng, trainer state, marker...
    for k in range(1, len(writes)):  # the last write is the one that publishes step-2
        with monkeypatch.context() as m:
            seen = _interrupt_after(m, k)
            with pytest.raises(_Interrupted):
                save_checkpoint(
                    root, 2, {"policy": model}, {"policy": opt}, {"policy": sched}, {"data_position": 8}
                )
        assert latest_checkpoint(root).name == "step-1", (k, seen[-1])
        fresh, fresh_opt, fresh_sched = build(5)
        state = load_checkpoint(
            latest_checkpoint(root), {"policy": fresh}, {"policy": fresh_opt}, {"policy": fresh_sched}
        )
        assert state["data_position"] == 4
        assert all(torch.equal(v, saved[key]) for key, v in fresh.state_dict().items())
    save_checkpoint(root, 2, {"policy": model}, {"policy": opt}, {"policy": sched}, {"data_position": 8})
    assert latest_checkpoint(root).name == "step-2" and checkpoint_step(root / "step-2") == 2


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_file_of_a_checkpoint_is_under_the_marker_which_is_written_last(tmp_path, monkeypatch, capsys):
    """Every file of ``step-N/`` (model, optimizer, scheduler, RNG and trainer state, JSON and tensors) has its
    size and SHA-256 in the marker, and the marker is written after every one of them (only the publishing
    rename follows it); each file damaged in turn is named at resume, which falls back to the previous
    checkpoint. A file left out of the checksums, or written after the marker, fails here."""
    import shutil
    from pathlib import Path

    from rlhfkit.engine.checkpoint import MARKER, resume_checkpoint

    root = tmp_path / "checkpoints"
    model, opt, sched = build(0)
    train(model, opt, sched, 1)
    save_checkpoint(root, 1, {"policy": model}, {"policy": opt}, {"policy": sched}, {"data_position": 4})
    train(model, opt, sched, 1)
    state = {"data_position": 8, "kl": torch.tensor([0.5, 0.25])}  # a tensor: trainer_state.safetensors too
    with monkeypatch.context() as m:
        writes = _interrupt_after(m, 0)  # the log of every write, none interrupted
        path = save_checkpoint(root, 2, {"policy": model}, {"policy": opt}, {"policy": sched}, state)

    files = sorted(p.name for p in path.iterdir() if p.name != MARKER)
    for stem in ("model.policy", "optimizer.policy", "scheduler.policy", "rng", "trainer_state"):
        assert any(name.startswith(stem + ".") for name in files), stem
    assert {"rng.json", "rng.safetensors", "trainer_state.json", "trainer_state.safetensors"} <= set(files)
    marker = json.loads((path / MARKER).read_text())
    assert sorted(marker["sha256"]) == sorted(marker["files"]) == files

    written = [Path(entry.split(":", 1)[1]).name for entry in writes]
    last = written.index(MARKER)
    assert set(files) <= set(written[:last]), "a file of the checkpoint was written after its marker"
    assert written.count(MARKER) == 1
    assert all(entry.startswith(("rename", "replace")) for entry in writes[last + 1 :]), writes[last:]

    pristine = tmp_path / "pristine"
    shutil.copytree(path, pristine)
    for name in [*files, MARKER]:
        shutil.rmtree(path)
        shutil.copytree(pristine, path)
        _flip_a_byte(path / name)
        capsys.readouterr()
        assert resume_checkpoint(root) == root / "step-1", name
        err = capsys.readouterr().err
        named = MARKER if name == MARKER else f"corrupt: {name} does not match its checksum in {MARKER}"
        assert "step-2: " in err and named in err and "resuming from the previous" in err, (name, err)
