"""Two processes (torchrun, gloo, CPU) compute what one process computes on the same global batch.

One torchrun launch runs every case of :mod:`tests.distributed.worker` (SFT, reward, PRM, PPO's update in
each loss aggregation mode, GRPO, REINFORCE++) on two processes; the same cases run here on one. In float64
the gradients agree to 1e-6 and the weights after the first step to 1e-5; the two planted bugs (each process
normalising by its own tokens; each process whitening its own share of the rollout) are shown to miss.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import worker
from tests.helpers import tiny_llama, tiny_tokenizer
from tests.trainers.online.online_fixtures import write_online_problem
from tests.trainers.sft_fixtures import write_sft_problem
from tests.trainers.test_reward import BODY_WORDS, write_reward_problem

GRAD_TOL, WEIGHT_TOL = 1e-6, 1e-5


def torchrun(*args: str, nproc: int = 2, timeout: float = 600, wait: bool = True):
    """``torchrun --standalone --nproc_per_node nproc ARGS`` with this checkout's rlhfkit and tests importable:
    its CompletedProcess, or (``wait=False``) the started Popen, stderr piped, for the caller to wait for."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), os.getcwd()])),
        "RLHFKIT_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("PYTEST_CURRENT_TEST", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]
    if not wait:
        return subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def write_prm_problem(root: Path) -> None:
    tokenizer = tiny_tokenizer()
    tiny_llama(seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id).save_pretrained(
        root / "model"
    )
    tokenizer.save_pretrained(root / "model")
    rng = random.Random(0)
    rows = []
    for _ in range(16):
        steps = [" ".join(rng.choices(BODY_WORDS, k=rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        rows.append(
            {
                "prompt": " ".join(rng.choices(BODY_WORDS, k=2)),
                "steps": steps,
                "labels": [rng.random() < 0.5 for _ in steps],
            }
        )
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_problems(root: Path) -> Path:
    for name in ("sft", "reward", "prm", "online"):
        (root / name).mkdir(parents=True)
    write_sft_problem(root / "sft")
    write_reward_problem(root / "reward", n_train=16, n_eval=0, gold=False)
    write_prm_problem(root / "prm")
    write_online_problem(root / "online")
    return root


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str) -> float:
    keys = sorted(k for k in a if k.startswith(prefix))
    assert keys and keys == sorted(k for k in b if k.startswith(prefix))
    return max(float((a[k] - b[k]).abs().max()) for k in keys)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{world size: {case: (tensors, metrics)}} for one process (here) and two (torchrun)."""
    root = write_problems(tmp_path_factory.mktemp("problems"))
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    worker.run_cases(root, one, tuple(c for c in worker.CASES if c not in worker.TWO_ONLY))
    proc = torchrun("-m", "tests.distributed.worker", str(root), str(two))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr
    out = {}
    for world, folder in ((1, one), (2, two)):
        out[world] = {}
        for case in worker.CASES:
            if (folder / f"{case}.json").exists():
                metrics = json.loads((folder / f"{case}.json").read_text())
                assert metrics.pop("world_size") == world
                out[world][case] = (load_file(str(folder / f"{case}.safetensors")), metrics)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in worker.CASES if c not in worker.TWO_ONLY])
def test_two_processes_give_one_processs_gradients_weights_and_metrics(results, case):
    (one, metrics_one), (two, metrics_two) = results[1][case], results[2][case]
    assert (
        max(float(g.abs().max()) for k, g in one.items() if k.startswith("grad.")) > 1e-3
    )  # a real gradient
    assert _max_diff(one, two, "grad.") <= GRAD_TOL
    assert _max_diff(one, two, "weight.") <= WEIGHT_TOL
    if case not in worker.OFFLINE:  # every minibatch's step, some with a process that holds no row of it
        assert _max_diff(one, two, "final.") <= WEIGHT_TOL
        assert (
            metrics_one["score/unscored"] == metrics_two["score/unscored"] == 1
        )  # a count over all processes
    assert metrics_one.keys() == metrics_two.keys()
    for key, value in metrics_one.items():
        assert metrics_two[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.mark.slow
@pytest.mark.parametrize(
    ("control", "correct"),
    [
        ("control-sft-local-normalizer", "sft"),
        ("control-ppo-local-normalizer", "ppo-token-mean"),
        ("control-ppo-local-whitening", "ppo-token-mean"),
    ],
)
def test_a_planted_data_parallel_bug_fails_the_comparison(results, control, correct):
    one, broken = results[1][correct][0], results[2][control][0]
    scale = max(float(g.abs().max()) for k, g in one.items() if k.startswith("grad."))
    assert _max_diff(one, broken, "grad.") > 1e-2 * scale


SHARDED_TOL = 1e-10  # float64: summation order only


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in worker.SHARDED if not c.startswith("control-")])
def test_two_sharded_processes_give_one_unsharded_processs_update(results, case):
    """FSDP2 (train.sharding) on 2 processes: the gradients each optimizer sees at its first step, the weights
    after it and after the whole update, and the metrics, as one unsharded process computes them on the same
    rollout; the frozen models sharded or whole as train.frozen_models says."""
    (one, metrics_one), (two, metrics_two) = results[1][case.removeprefix("sharded-")], results[2][case]
    assert max(float(g.abs().max()) for k, g in one.items() if k.startswith("grad.")) > 1e-3
    online = case != "sharded-dpo"
    for prefix in ("grad.", "weight.", "final.") if online else ("grad.", "weight."):
        assert _max_diff(one, two, prefix) <= SHARDED_TOL, prefix
    if online:
        placement = {k: metrics_two.pop(k) for k in list(metrics_two) if k.startswith("sharded/")}
        frozen = float(worker.SHARDED[case][1] == "shard")
        assert placement["sharded/actor"] == 1.0 and placement["sharded/reference"] == frozen
        assert placement.get("sharded/critic", 1.0) == 1.0
        assert placement["sharded/reward_model"] == frozen
    assert metrics_one.keys() == metrics_two.keys()
    for key, value in metrics_one.items():
        assert metrics_two[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.slow
@pytest.mark.parametrize(
    ("control", "correct"),
    [
        ("control-sharded-ppo-local-normalizer", "ppo-token-mean"),
        ("control-sharded-dpo-local-normalizer", "dpo"),
    ],
)
def test_a_planted_per_process_normaliser_fails_the_sharded_comparison(results, control, correct):
    one, broken = results[1][correct][0], results[2][control][0]
    scale = max(float(g.abs().max()) for k, g in one.items() if k.startswith("grad."))
    assert _max_diff(one, broken, "grad.") > 1e-2 * scale
