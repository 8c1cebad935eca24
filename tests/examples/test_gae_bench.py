"""benchmarks/gae_bench.py: its two reference loops are right, so that its agreement check means something.

The loops are checked on a hand-computed case and against each other; then one small benchmark cell runs
end to end (compute_gae must agree with them before anything is timed).
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from tests.examples.loader import ROOT, load_example

gb = load_example("gae_bench", ROOT / "benchmarks")


def test_reference_loops_on_a_hand_computed_case():
    # One row, valid at t = 0, 2, 3 (a hole at 1), done after t = 2; gamma 0.5, lam 0.5 (c = 0.25).
    r = torch.tensor([[1.0, 99.0, 2.0, 3.0]])
    v = torch.tensor([[0.5, 99.0, 1.0, 2.0]])
    mask = torch.tensor([[True, False, True, True]])
    dones = torch.tensor([[0.0, 1.0, 1.0, 0.0]])  # the done at the hole must be ignored
    # t=3: delta = 3 - 2 = 1, A = 1 (row ends). t=2: done, delta = 2 - 1 = 1, A = 1.
    # t=0: next valid is 2: delta = 1 + 0.5 * 1.0 - 0.5 = 1, A = 1 + 0.25 * 1 = 1.25.
    expected = np.array([[1.25, 0.0, 1.0, 1.0]])
    got_np = gb.gae_numpy_per_sequence(r.numpy(), v.numpy(), mask.numpy(), 0.5, 0.5, dones=dones.numpy())
    np.testing.assert_allclose(got_np, expected)
    got_loop = gb.gae_torch_loop(r, v, mask, 0.5, 0.5, dones=dones)
    torch.testing.assert_close(got_loop, torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize("general", [False, True])
def test_loops_agree_on_random_inputs(general):
    gen = torch.Generator().manual_seed(0)
    r, v, mask, dones = gb.make_inputs(16, 40, general, gen)
    np_dones = None if dones is None else dones.numpy()
    ref = gb.gae_numpy_per_sequence(r.numpy(), v.numpy(), mask.numpy(), 0.99, 0.9, dones=np_dones)
    gb.check_agreement(gb.gae_torch_loop(r, v, mask, 0.99, 0.9, dones=dones), ref, mask, "carry loop")
    if not general:
        gb.check_agreement(gb.gae_torch_loop_right_padded(r, v, mask, 0.99, 0.9), ref, mask, "TRL loop")


def test_agreement_check_rejects_a_wrong_result():
    mask = torch.tensor([[True, False]])
    ref = np.array([[1.0, 0.0]])
    with pytest.raises(SystemExit, match="disagrees"):
        gb.check_agreement(torch.tensor([[1.01, 0.0]]), ref, mask, "x")
    with pytest.raises(SystemExit, match="masked positions"):
        gb.check_agreement(torch.tensor([[1.0, 5.0]]), ref, mask, "x")


def test_one_benchmark_cell_runs():
    args = argparse.Namespace(gamma=1.0, lam=0.95, repeats=1, numpy_max_elements=10_000)
    for general in (False, True):
        row = gb.bench_case(8, 64, general, args, torch.Generator().manual_seed(1))
        assert row["err_ours"] <= 1e-4 and row["err_loop"] <= 1e-4
        assert min(row["ours"], row["loop"], row["numpy"]) > 0
