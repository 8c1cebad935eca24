"""Sharded (FSDP2, ``train.sharding=full_shard``) PPO and DPO through the command line on 2 CPU processes (gloo).

Three torchrun launches, in float64 (:mod:`tests.distributed.cli_runs`); the first runs beside the in-process
one-process DPO reference (two cores):

    1 process    ppo 1->2 (first rollout)
    1 process    distill 1 rollout (on-policy distillation from a teacher)
    2 processes  ppo 1->2 (resumed), ppo 2 rollouts, ppo stopped after 1 and resumed, dpo 2 steps; grpo with a
                 tool (tests.distributed.tool_turns): 2 rollouts, stopped after 1 and resumed, and 1 rollout
                 data parallel (no sharding); distill 1 rollout data parallel and 1 sharded
    1 process    ppo 2->1 (resumed): the 2-rollout run as it stood after rollout 1 (its folder with only
                 checkpoint step-1, as a run stopped there leaves it; the runs are deterministic, so this is
                 the checkpoint a 1-rollout run writes: the stopped-and-resumed run above is held equal to the
                 uninterrupted one)

PPO's responses are sampled with a seed per (seed, rollout, process), so a run resumed under another process
count continues from the same global prompt and KL controller, not with the same samples: the comparison
across process counts is of positions and restored state; within one process count the resumed run is the
uninterrupted one. The update itself (2 sharded processes = 1 unsharded one) is compared in
test_data_parallel.py (the ``sharded-*`` worker cases). DPO is compared with one unsharded process here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli import main
from rlhfkit.config import read_run_info
from rlhfkit.engine.checkpoint import complete_checkpoints
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.models import loading
from rlhfkit.tasks.calculator import ToolsTask
from rlhfkit.trainers import common
from tests.distributed import recording
from tests.distributed.test_data_parallel import torchrun
from tests.trainers.online.online_fixtures import online_cli_args, write_online_problem
from tests.trainers.online.test_distill import distill_overrides, write_teacher
from tests.trainers.online.test_tools_online import check_rollout_rows, tools_overrides, write_tools_problem
from tests.trainers.test_dpo import dpo_args, write_dpo_problem

SHARD = "train.sharding=full_shard"


def _start(
    tmp: Path,
    nproc: int,
    runs: list[list[str]],
    record: Path | None = None,
    tool_sampler: tuple[int, ...] = (),
) -> subprocess.Popen:
    """A torchrun launch of ``runs`` (:mod:`tests.distributed.cli_runs`), started; :func:`_finish` waits for it.
    ``record``: the folder of what :mod:`tests.distributed.recording` records; ``tool_sampler``: the runs whose
    turns :mod:`tests.distributed.tool_turns` writes."""
    plan = tmp / f"plan-{nproc}-{len(list(tmp.glob('plan-*')))}.json"
    # no test here reads a report
    settings = {"float64": True, "reports": False, "runs": runs, "tool_sampler": list(tool_sampler)}
    plan.write_text(json.dumps({**settings, "record": str(record)} if record else settings))
    return torchrun("-m", "tests.distributed.cli_runs", str(plan), nproc=nproc, wait=False)


def _finish(proc: subprocess.Popen) -> str:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    assert "terminate called" not in err
    return err


def _launch(tmp: Path, nproc: int, runs: list[list[str]], record: Path | None = None, **plan) -> str:
    return _finish(_start(tmp, nproc, runs, record, **plan))


def _stopped_after_one(run: Path, copy: Path) -> None:
    """``copy``: run folder ``run`` as it was when its first rollout was checkpointed (later checkpoints, final
    folders and summary gone; --resume cuts metrics.jsonl and samples.jsonl back to step 1)."""
    shutil.copytree(run, copy)
    for later in [*copy.glob("checkpoints/step-[2-9]*"), copy / "final", copy / "final_critic"]:
        shutil.rmtree(later)
    (copy / "summary.json").unlink()


def _weights(folder: Path, name: str = "final") -> dict[str, torch.Tensor]:
    return load_file(str(folder / name / "model.safetensors"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)


def _tool_args(tmp: Path, paths: dict[str, Path], name: str, steps: int, *extra: str) -> list[str]:
    """``rlhfkit train grpo`` with the calculator tool (tests.trainers.online.test_tools_online), ``steps``
    rollouts, a checkpoint each."""
    config = tmp / f"{name}.yaml"
    config.write_text("seed: 0\n")
    settings = (f"train.max_steps={steps}", "train.save_steps=1", "logging.progress_bar=false", *extra)
    return ["train", "grpo", "--config", str(config), *tools_overrides(paths, tmp / name, *settings)]


def _distill_args(tmp: Path, paths: dict[str, Path], teacher: Path, name: str, *extra: str) -> list[str]:
    """``rlhfkit train distill`` (tests.trainers.online.test_distill), 1 rollout of 8 responses."""
    config = tmp / f"{name}.yaml"
    config.write_text("seed: 0\n")
    settings = ("train.max_steps=1", "logging.progress_bar=false", *extra)
    return [
        "train",
        "distill",
        "--config",
        str(config),
        *distill_overrides(paths, tmp / name, teacher, *settings),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded-online")
    paths = write_online_problem(tmp / "online")
    (tmp / "dpo").mkdir()
    dpo_paths = write_dpo_problem(tmp / "dpo")
    settings = (
        f"online.reward_model={paths['reward']}",
        "online.kl_target=0.5",
        "online.kl_horizon=20",
        "train.save_steps=1",
        "logging.progress_bar=false",
        SHARD,
    )

    def ppo(name: str, steps: int, *extra: str) -> list[str]:
        return online_cli_args(paths, tmp / name, *settings, f"train.max_steps={steps}", *extra)

    dpo = ("train.max_steps=2", "train.save_steps=1")
    tool_paths = write_tools_problem(tmp / "tools-problem")
    teacher = write_teacher(tmp / "online", paths, sharpness=30.0)
    first = _start(tmp, 1, [ppo("one-two", 1), _distill_args(tmp, paths, teacher, "distill-one")])
    with pytest.MonkeyPatch.context() as patch:  # DPO's one-process, unsharded reference, here, meanwhile
        patch.setenv("RLHFKIT_NUM_THREADS", "1")
        patch.setitem(loading.DTYPES, "float32", torch.float64)
        patch.setattr(common, "write_report", lambda run_dir: None)  # as in the launches
        assert main(dpo_args(dpo_paths, tmp / "dpo-one", *dpo)) == 0
    logs = [_finish(first)]
    logs.append(
        _launch(
            tmp,
            2,
            [
                [*ppo("one-two", 2), "--resume"],
                ppo("two", 2),
                ppo("two-two", 1),
                [*ppo("two-two", 2), "--resume"],
                dpo_args(dpo_paths, tmp / "dpo-two", *dpo, SHARD),
                _tool_args(tmp, tool_paths, "tools", 2, SHARD),
                _tool_args(tmp, tool_paths, "tools-part", 1, SHARD),
                [*_tool_args(tmp, tool_paths, "tools-part", 2, SHARD), "--resume"],
                _tool_args(tmp, tool_paths, "tools-dp", 1),
                _distill_args(tmp, paths, teacher, "distill-dp"),
                _distill_args(tmp, paths, teacher, "distill-shard", SHARD, "train.frozen_models=shard"),
            ],
            record=tmp / "records",  # run-1: "two"; run-5: "tools", run-8: "tools-dp"
            tool_sampler=(5, 6, 7, 8),
        )
    )
    _stopped_after_one(tmp / "two", tmp / "two-one")
    logs.append(_launch(tmp, 1, [[*ppo("two-one", 2), "--resume"]]))
    return tmp, logs


@pytest.mark.slow
def test_sharded_ppo_resumes_exactly_and_writes_plain_final_folders(runs):
    tmp, logs = runs
    assert (
        "ppo on 2 processes (torchrun, gloo, cpu), 1 torch thread each, model sharded (full_shard" in logs[1]
    )
    two = tmp / "two"
    assert _max_diff(_weights(tmp / "two-two"), _weights(two)) == 0.0  # stopped and resumed = uninterrupted
    assert _max_diff(_weights(tmp / "two-two", "final_critic"), _weights(two, "final_critic")) == 0.0
    start = _weights(tmp / "online" / "policy", ".")
    final = _weights(two)
    assert sorted(final) == sorted(start) and _max_diff(final, start) > 0  # whole, the model's names, trained
    checkpoints = two / "checkpoints"
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["step-1", "step-2"]
    state = json.loads((checkpoints / "step-2" / "trainer_state.json").read_text())
    assert state["sharded"]["world_size"] == 2 and not list((checkpoints / "step-2").glob("model*"))
    groups = state["sharded"]["param_groups"]
    assert sorted(groups) == ["actor", "critic"]  # both trained roles' optimizer states, in the shards
    assert read_run_info(two / "config.yaml")["sharding"] == "full_shard"


@pytest.mark.slow
def test_each_rollout_samples_from_the_actors_weights_as_they_stand_then(runs):
    """The copy the sharded actor generates from holds the actor's weights of the current rollout: the
    initial ones, then those after the first update (recorded on the model each generate call is given, and
    on the sharded actor after each update: tests.distributed.recording). On two processes the gathered
    weights are a new buffer, so a copy gathered once and kept shows here (on one they are the actor's own
    storage and would follow it)."""
    tmp, _ = runs
    sampled, updated = (recording.read(tmp / "records" / "run-1", name) for name in ("sampled", "updated"))

    distinct = [w for i, w in enumerate(sampled) if i == 0 or not _same(w, sampled[i - 1])]
    assert len(updated) == 2 and len(distinct) == 2, (len(updated), len(distinct))  # one set per rollout
    start = {k: v.double() for k, v in _weights(tmp / "online" / "policy", ".").items()}
    assert _same(distinct[0], start) and _same(distinct[1], updated[0]) and not _same(updated[0], start)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "worlds"), [("one-two", (1, 2)), ("two-one", (2, 1))])
def test_a_sharded_online_checkpoint_resumes_under_another_process_count(runs, name, worlds):
    tmp, _ = runs
    out = tmp / name
    states = [
        json.loads((out / "checkpoints" / f"step-{n}" / "trainer_state.json").read_text()) for n in (1, 2)
    ]
    assert [s["sharded"]["world_size"] for s in states] == list(worlds)  # shards re-cut for the new count
    assert [s["prompts_seen"] for s in states] == [4, 8]  # the global prompt position
    assert read_run_info(out / "config.yaml")["world_size"] == worlds[1]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    uninterrupted = read_metrics(tmp / "two" / "metrics.jsonl")
    # the KL controller restored: its coefficient after rollout 1 is the one the 2-process run had then (the
    # first rollouts of one-two (1 process) and two differ in samples, so only two-one shares its first)
    if name == "two-one":
        assert rows[1]["kl_coef"] == pytest.approx(uninterrupted[1]["kl_coef"], rel=1e-12)
    assert (out / "final_critic" / "model.safetensors").is_file()


@pytest.mark.slow
def test_two_sharded_dpo_processes_train_the_model_one_process_trains(runs):
    tmp, logs = runs
    assert (
        "dpo on 2 processes (torchrun, gloo, cpu), 1 torch thread each, model sharded (full_shard" in logs[1]
    )
    # the trained policy keeps float32 weights whatever model.dtype says (rlhfkit.models.precision), so this
    # end-to-end comparison is at float32 rounding; the float64 one (1e-10) is the worker's sharded-dpo case
    two, one = _weights(tmp / "dpo-two"), _weights(tmp / "dpo-one")
    assert _max_diff(two, one) <= 1e-4 and _max_diff(one, _weights(tmp / "dpo" / "model", ".")) > 1e-3
    rows_two, rows_one = (read_metrics(tmp / n / "metrics.jsonl") for n in ("dpo-two", "dpo-one"))
    last_two, last_one = rows_two[-1], rows_one[-1]
    for key in ("loss", "eval/loss", "eval/accuracy"):
        assert last_two[key] == pytest.approx(last_one[key], rel=1e-5), key


@pytest.mark.slow
def test_tool_episodes_on_two_processes_sharded_and_data_parallel(runs):
    """GRPO with the calculator tool on 2 processes, sharded (full_shard) and data parallel. Process 0's
    episodes take two turns (a call, then an answer), process 1's one (tests.distributed.tool_turns): the
    processes make different numbers of generate calls a rollout, each turn from the copy gathered for the
    rollout, and the runs finish. The tool metrics are sums over both processes; the rows each process trained
    hold the sampled tokens in the mask and the tool results outside it; a sharded run stopped after rollout 1
    and resumed ends as the uninterrupted one."""
    tmp, logs = runs
    assert (
        "grpo on 2 processes (torchrun, gloo, cpu), 1 torch thread each, model sharded (full_shard" in logs[1]
    )
    tok = ToolsTask(seed=0).build_tokenizer()
    for name, run, rollouts in (("tools", 5, 2), ("tools-dp", 8, 1)):
        metrics = read_metrics(tmp / name / "metrics.jsonl")
        assert [row["step"] for row in metrics] == list(range(1, rollouts + 1))
        for row in metrics:  # process 0: one call in two turns per episode; process 1: no call, one turn
            assert row["tools/calls_per_episode"] == 0.5 and row["tools/calls/calculator"] == 0.5, row
            assert row["turns/mean"] == 1.5 and row["tools/errors"] == 0, row
        for rank, calls in ((0, 4), (1, 0)):  # 4 episodes a process
            trained = recording.read(tmp / "records" / f"run-{run}", f"rollout{rank}")
            assert len(trained) == rollouts
            for rows in trained:
                rows = SimpleNamespace(batch_size=rows["mask"].shape[0], **rows)
                assert check_rollout_rows(tok, rows) == calls, (name, rank)
    # process 0's generate calls (two a rollout) read the actor's weights of their rollout, gathered
    folder = tmp / "records" / "run-5"
    sampled, updated = recording.read(folder, "sampled"), recording.read(folder, "updated")
    start = {k: v.double() for k, v in _weights(tmp / "tools-problem" / "policy", ".").items()}
    assert len(sampled) == 4 and len(updated) == 2
    assert all(_same(w, start) for w in sampled[:2]) and all(_same(w, updated[0]) for w in sampled[2:])
    assert not _same(updated[0], start)
    # stopped after rollout 1 and resumed = uninterrupted
    assert _max_diff(_weights(tmp / "tools-part"), _weights(tmp / "tools")) == 0.0
    drop = ("time/", "tokens_per_second", "wall")
    part, whole = (
        [
            {k: v for k, v in row.items() if not k.startswith(drop)}
            for row in read_metrics(tmp / n / "metrics.jsonl")
        ]
        for n in ("tools-part", "tools")
    )
    assert part == whole


@pytest.mark.slow
def test_distill_on_two_processes_grades_as_one_process_does(runs):
    """On-policy distillation data parallel and sharded (the teacher sharded like the reference): the
    exact sampler draws the same responses on 1 and 2 processes, so the first rollout's KL to the teacher,
    averaged over both processes' tokens, is the one-process figure (float64 models)."""
    tmp, logs = runs
    assert "distill on 1 process" in logs[0]
    assert (
        "distill on 2 processes (torchrun, gloo, cpu), 1 torch thread each, model sharded (full_shard"
        in logs[1]
    )
    (one,) = read_metrics(tmp / "distill-one" / "metrics.jsonl")
    assert one["distill/teacher_kl"] > 0
    for name, sharding in (("distill-dp", "none"), ("distill-shard", "full_shard")):
        (row,) = read_metrics(tmp / name / "metrics.jsonl")
        assert row["distill/teacher_kl"] == pytest.approx(one["distill/teacher_kl"], rel=1e-9, abs=1e-12), (
            name
        )
        assert row["response_length/mean"] == one["response_length/mean"], name  # the same samples
        info = read_run_info(tmp / name / "config.yaml")
        assert info["world_size"] == 2 and info["sharding"] == sharding, info
