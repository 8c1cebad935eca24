"""Sharded training (FSDP2 on CPU, gloo, 2 processes): the same model as one process, checkpoints that resume.

One torchrun launch (:mod:`tests.distributed.sharded_worker`) trains SFT (full_shard, with a stop and
--resume) and a reward model (shard_grad_op, keeping one checkpoint); the same runs without sharding on one
process here are the reference. Everything is float64, so that the comparison is exact up to summation order.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli import main
from rlhfkit.config import read_run_info
from rlhfkit.engine import sharded
from rlhfkit.engine.checkpoint import complete_checkpoints
from rlhfkit.errors import CheckpointError
from rlhfkit.models import loading
from tests.distributed import sharded_worker
from tests.distributed.test_data_parallel import torchrun
from tests.trainers.sft_fixtures import write_sft_problem
from tests.trainers.test_reward import write_reward_problem


def write_sharded_problems(root: Path) -> Path:
    for name in ("sft", "reward"):
        (root / name).mkdir(parents=True)
    write_sft_problem(root / "sft")
    write_reward_problem(root / "reward", n_train=32, n_eval=16)
    (root / "run.yaml").write_text("seed: 0\n")
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the two-process sharded runs' folder, the one-process reference runs' folder)."""
    root = write_sharded_problems(tmp_path_factory.mktemp("problems"))
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    proc = torchrun("-m", "tests.distributed.sharded_worker", str(root), str(two))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr
    assert (
        proc.stderr.count("1 torch thread each, model sharded (full_shard, FSDP2)") == 3
    )  # sft, stop, resume
    assert (
        proc.stderr.count(
            "reward on 2 processes (torchrun, gloo, cpu), 1 torch thread each, model sharded (shard_grad_op"
        )
        == 1
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLHFKIT_NUM_THREADS", "1")
        patch.setitem(loading.DTYPES, "float32", torch.float64)
        for argv in sharded_worker.runs(root, one, sharded=False):
            assert main(argv) == 0
    return two, one


def _final(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "final" / "model.safetensors"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft", "reward"])
def test_two_sharded_processes_train_the_model_one_process_trains(runs, name):
    two, one = runs
    weights = _final(two / name)
    assert next(iter(weights.values())).dtype == torch.float64  # a plain, whole HF folder
    assert _max_diff(weights, _final(one / name)) <= 1e-10
    rows_two = [json.loads(line) for line in (two / name / "metrics.jsonl").read_text().splitlines()]
    rows_one = [json.loads(line) for line in (one / name / "metrics.jsonl").read_text().splitlines()]
    norms_two = {r["step"]: r["grad_norm"] for r in rows_two if "grad_norm" in r}
    norms_one = {r["step"]: r["grad_norm"] for r in rows_one if "grad_norm" in r}
    assert sorted(norms_two) == sorted(norms_one) == [1, 2]
    for step in (1, 2):  # the clipped norm is the global one, over both processes' shards
        assert norms_two[step] == pytest.approx(norms_one[step], rel=1e-9)


@pytest.mark.slow
def test_a_sharded_run_checkpoints_its_shards_and_resumes_exactly(runs):
    two, _ = runs
    assert _max_diff(_final(two / "sft-resumed"), _final(two / "sft")) == 0.0
    checkpoints = two / "sft" / "checkpoints"
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["step-1", "step-2"]
    step = checkpoints / "step-2"
    assert not list(step.glob("model.*")) and not list(step.glob("optimizer.*"))  # they are the shards
    assert read_run_info(two / "sft" / "config.yaml")["sharding"] == "full_shard"
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["sharded"]["folder"] == "step-2.sharded" and state["sharded"]["world_size"] == 2
    assert (checkpoints / "step-2.sharded" / ".metadata").is_file()
    metadata = sharded.read_metadata(checkpoints / "step-2.sharded")
    assert any(key.startswith("model.") for key in metadata.state_dict_metadata)
    assert any(key.startswith("optim.") for key in metadata.state_dict_metadata)
    # keep_last_checkpoints=1 removes an old step's shards with its folder
    kept = sorted(p.name for p in (two / "reward" / "checkpoints").iterdir())
    assert kept == ["step-2", "step-2.sharded"]


class _Boom:
    def __reduce__(self):
        return (Path.touch, (Path("SHOULD_NOT_EXIST"),))


def test_the_shard_index_is_read_without_running_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": _Boom()}))
    with pytest.raises(CheckpointError, match="refused by the weights-only reader: pathlib.Path.touch"):
        sharded.read_metadata(tmp_path)
    assert not (tmp_path / "SHOULD_NOT_EXIST").exists()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "none"),
        ({"ACCELERATE_USE_FSDP": "false", "FSDP_RESHARD_AFTER_FORWARD": "true"}, "none"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "true"}, "full_shard"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "false"}, "shard_grad_op"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}, "shard_grad_op"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "FULL_SHARD"}, "full_shard"),
    ],
)
def test_an_accelerate_fsdp_config_chooses_the_sharding(env, expected):
    """accelerate passes its config file's fsdp_config as environment variables (FSDP2's
    reshard_after_forward, FSDP1's sharding strategy); train.sharding, when set, wins."""
    from types import SimpleNamespace

    assert sharded.launch_sharding(env) == expected
    assert sharded.sharding_mode(SimpleNamespace(train=SimpleNamespace(sharding="shard_grad_op"))) == (
        "shard_grad_op"
    )


def test_a_sharded_run_stops_and_resumes_on_a_plain_single_process(tmp_path, monkeypatch, capsys):
    """No launcher (a plain ``rlhfkit train ... --resume`` on the one machine left): a process group of one,
    the sharded checkpoint resumed, and the run ends where the uninterrupted one does."""
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "sft").mkdir()
    write_sft_problem(tmp_path / "sft")
    (tmp_path / "run.yaml").write_text("seed: 0\n")

    def sft(out, steps, *extra):
        args = sharded_worker.sft_run(
            tmp_path / "sft", tmp_path / out, f"train.max_steps={steps}", "train.save_steps=1", *extra
        )
        if "--resume" in extra:  # --resume in place of --overwrite, last
            args = [*[a for a in args if a not in ("--resume", "--overwrite")], "--resume"]
        return main(args)

    assert sft("straight", 2, "train.sharding=full_shard") == 0
    assert sft("stopped", 1, "train.sharding=full_shard") == 0
    first = (tmp_path / "stopped" / "checkpoints" / "step-1" / "COMPLETE").stat().st_mtime_ns
    capsys.readouterr()
    assert sft("stopped", 2, "train.sharding=full_shard", "--resume") == 0, capsys.readouterr().err[-2000:]
    err = capsys.readouterr().err
    assert "sft on 1 process (python" in err and "model sharded (full_shard, FSDP2)" in err
    assert (
        tmp_path / "stopped" / "checkpoints" / "step-1" / "COMPLETE"
    ).stat().st_mtime_ns == first  # resumed
    assert not torch.distributed.is_initialized()  # the group ended with the command
    state = json.loads((tmp_path / "stopped" / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["sharded"]["world_size"] == 1
    assert _max_diff(_final(tmp_path / "stopped"), _final(tmp_path / "straight")) == 0.0


def test_sharding_with_deepspeed_or_lora_online_is_refused_naming_the_alternative(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    (tmp_path / "sft").mkdir()
    write_sft_problem(tmp_path / "sft")
    (tmp_path / "run.yaml").write_text("seed: 0\n")

    def sft(*extra):
        return main(sharded_worker.sft_run(tmp_path / "sft", tmp_path / "run", "train.max_steps=1", *extra))

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert sft() == 2
    err = capsys.readouterr().err
    assert "sharded training (DeepSpeed)" in err and "fsdp_full_shard.yaml" in err
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")

    from rlhfkit.config import load_config
    from rlhfkit.errors import ConfigError

    base = ["output_dir=x", "model.name_or_path=m", "data.train_file=t", "train.sharding=full_shard"]
    for kind in ("ppo", "grpo", "rloo", "dpo"):  # accepted; the frozen models sharded unless told otherwise
        extra = ["online.reward_model=r"] if kind != "dpo" else []
        cfg = load_config(None, [*base, *extra], kind)
        assert (cfg.train.sharding, cfg.train.frozen_models) == ("full_shard", "shard")
        with pytest.raises(ConfigError, match=r"model.lora_rank.*: 8 with train.sharding=full_shard.*FSDP2"):
            load_config(None, [*base, *extra, "model.lora_rank=8"], kind)
    online = [*base, "online.reward_model=r"]
    assert load_config(None, [*online, "train.frozen_models=replicate"], "ppo").train.frozen_models == (
        "replicate"
    )
    with pytest.raises(ConfigError, match="train.frozen_models.*: must be one of shard, replicate"):
        load_config(None, [*online, "train.frozen_models=offload"], "ppo")
    with pytest.raises(ConfigError, match="refresh.every.*: 2 with train.sharding=full_shard"):
        load_config(None, [*online, "refresh.every=2"], "ppo")
    with pytest.raises(ConfigError, match="data.eval_file.*: held-out sampling is not supported"):
        load_config(None, [*online, "data.eval_file=e"], "grpo")
    assert load_config(None, [*base, "model.lora_rank=8"], "sft").model.lora_rank == 8  # refused later


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("data.eval_file=e", "data.eval_file"),
        ("refresh.every=2", "refresh.every"),
        ("model.lora_rank=8", "model.lora_rank"),
    ],
)
def test_the_sharding_rules_apply_to_an_accelerate_fsdp_launch(monkeypatch, setting, key):
    """The run shards under ACCELERATE_USE_FSDP without train.sharding (sharding_mode), so the checks that
    refuse what sharding cannot run read the same: each combination is a named error at load time."""
    from rlhfkit.config import load_config
    from rlhfkit.errors import ConfigError

    online = ["output_dir=x", "model.name_or_path=m", "data.train_file=t", "online.reward_model=r"]
    assert load_config(None, [*online, setting], "grpo").train.sharding == "none"  # accepted unsharded
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match=rf"{key}.*sharding=full_shard from the accelerate FSDP launch"):
        load_config(None, [*online, setting], "grpo")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    with pytest.raises(ConfigError, match=rf"{key}.*sharding=shard_grad_op from the accelerate FSDP launch"):
        load_config(None, [*online, setting], "grpo")
    assert load_config(None, online, "grpo").train.sharding == "none"  # the rest is accepted


@pytest.mark.parametrize("kind", ["ppo", "grpo", "rloo"])
@pytest.mark.parametrize("sharding", ["full_shard", "shard_grad_op"])
def test_vllm_with_sharding_is_accepted_with_rollout_correction(kind, sharding):
    """vLLM beside a sharded actor (one engine per process, the weights streamed shard by shard:
    tests/distributed/test_sharded_vllm.py) is a valid run, with truncated importance sampling on the engine's
    log-probs, set in the config or by an accelerate FSDP launch."""
    from rlhfkit.config import load_config

    online = ["output_dir=x", "model.name_or_path=m", "data.train_file=t", "online.reward_model=r"]
    engine = ["online.generation_backend=vllm", "online.rollout_correction=tis"]
    cfg = load_config(None, [*online, *engine, f"train.sharding={sharding}"], kind)
    assert (cfg.train.sharding, cfg.online.generation_backend, cfg.online.rollout_correction) == (
        sharding,
        "vllm",
        "tis",
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ACCELERATE_USE_FSDP", "true")
        assert load_config(None, [*online, *engine], kind).online.generation_backend == "vllm"


def test_under_an_accelerate_fsdp_config_every_process_loads_the_weights_and_accelerate_does_not_wrap(
    monkeypatch,
):
    """transformers loads real weights on the first process only when FSDP_CPU_RAM_EFFICIENT_LOADING is set
    (the others would wait for a broadcast that rlhfkit's own sharding never makes)."""
    from rlhfkit.engine.accel import make_accelerator

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    accelerator = make_accelerator(sharding=True)
    assert str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)) != "FSDP"
    assert os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"  # still read by sharding_mode
