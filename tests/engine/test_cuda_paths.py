"""The CUDA paths, on a CUDA device (every test here skips without one; benchmarks/gpu_check.py runs them with
``pytest -m cuda``): bfloat16 autocast read-outs against float32, where the four online roles sit and in which
dtype, and a whole bfloat16 PPO run on the device whose first PPO ratio is exactly 1."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.helpers import tiny_llama
from tests.trainers.online.online_fixtures import online_cli_args, online_config, write_online_problem

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_autocast_readout_matches_float32_on_cuda():
    from rlhfkit.models import autocast_forward, response_logprobs

    model = tiny_llama().to("cuda")
    torch.manual_seed(0)
    ids = torch.randint(4, 48, (4, 12), device="cuda")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        fp32 = response_logprobs(model, ids, mask, response_start=6)  # (B, R)
        bf16 = response_logprobs(autocast_forward(copy.deepcopy(model), torch.bfloat16), ids, mask, 6)
    assert fp32.shape == bf16.shape == (4, 6) and bf16.dtype == torch.float32
    gap = (fp32 - bf16).abs().max().item()
    # bf16 keeps 8 bits of mantissa: the log-probs move by about 1e-2 at most on this model, never by 0
    # (0 would mean autocast did not run in bf16 on the device)
    assert 0 < gap < 5e-2, gap


def test_the_four_online_roles_sit_on_the_device_in_their_dtypes(tmp_path):
    from rlhfkit.engine.accel import make_accelerator
    from rlhfkit.models import load_tokenizer
    from rlhfkit.trainers.online.context import build_context

    paths = write_online_problem(tmp_path)
    cfg = online_config(
        paths, tmp_path / "run", f"online.reward_model={paths['reward']}", "model.dtype=bfloat16"
    )
    ctx = build_context(cfg, make_accelerator(), load_tokenizer(cfg.model.name_or_path))
    assert ctx.accelerator.device.type == "cuda"
    roles = ctx.roles
    dtypes = {
        "actor": torch.float32,  # trained roles keep float32 weights (bf16 = autocast)
        "critic": torch.float32,
        "reference": torch.bfloat16,  # frozen roles hold bf16 weights
        "reward_model": torch.bfloat16,
    }
    for name, dtype in dtypes.items():
        model = getattr(roles, name)
        tensors = [*model.parameters(), *model.buffers()]
        assert tensors and all(t.device.type == "cuda" for t in tensors), name
        assert {p.dtype for p in model.parameters()} == {dtype}, name


def test_a_bf16_ppo_run_on_cuda_keeps_the_first_ratio_at_one(tmp_path):
    from rlhfkit import cli

    paths = write_online_problem(tmp_path)
    out = tmp_path / "run"
    extra = (f"online.reward_model={paths['reward']}", "model.dtype=bfloat16", "train.max_steps=2")
    assert cli.main(online_cli_args(paths, out, *extra)) == 0
    run = [line for line in (out / "config.yaml").read_text().splitlines() if line.startswith("# run: ")]
    assert json.loads(run[0][len("# run: ") :])["device"] == "cuda"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # the old log-probs come from the update's first forward: the ratio is exactly 1 there, bf16 included
    assert all(m["ratio/first_minibatch_max_logprob_diff"] == 0.0 for m in metrics)
    assert all(torch.isfinite(torch.tensor(m["loss/policy"])) for m in metrics)
