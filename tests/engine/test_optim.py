"""Learning-rate schedules and optimizer parameter groups, by hand."""

import math

import pytest
import torch

from rlhfkit.engine.optim import build_optimizer, build_scheduler, lr_lambda


def test_linear_schedule_with_warmup_by_hand():
    f = lr_lambda("linear", warmup_steps=2, max_steps=6)
    assert [f(s) for s in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_cosine_and_constant_by_hand():
    f = lr_lambda("cosine", warmup_steps=0, max_steps=4)
    assert [f(s) for s in range(5)] == pytest.approx(
        [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 + 0.5 * math.cos(3 * math.pi / 4), 0.0]
    )
    assert lr_lambda("constant", 0, 10)(7) == 1.0


def test_scheduler_drives_optimizer_lr():
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer(model.named_parameters(), lr=0.1, weight_decay=0.01)
    sched = build_scheduler(opt, "linear", warmup_steps=0, max_steps=4)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.075, 0.05, 0.025])


def test_no_weight_decay_on_biases_and_frozen_params_skipped():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    model[1].weight.requires_grad_(False)
    opt = build_optimizer(model.named_parameters(), lr=1.0, weight_decay=0.5)
    by_decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in opt.param_groups}
    assert by_decay[0.5] == {id(model[0].weight)}
    assert by_decay[0.0] == {id(model[0].bias), id(model[1].bias)}


def test_adamw_takes_the_fused_kernel_and_matches_the_loop():
    """On CPU float32 the fused kernel is used; its steps equal the per-tensor loop's (each element is
    updated from itself alone)."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    fused = build_optimizer(model.named_parameters(), lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] is True
    loop = torch.optim.AdamW(
        [
            {"params": [p for n, p in twin.named_parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for n, p in twin.named_parameters() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        foreach=False,
    )
    x = torch.randn(16, 8)
    for _ in range(5):
        for m, opt in ((model, fused), (twin, loop)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
