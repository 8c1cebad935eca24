"""Point-to-point transfers (:mod:`rlhfkit.engine.transfer`) between two spawned gloo processes: an object
arrives whole, and a weight stream carries the trained parameters (a LoRA-like adapter) and nothing else."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from rlhfkit.engine.transfer import (
    WeightSender,
    open_transfers,
    recv_object,
    recv_weights,
    send_object,
    snapshot,
    trained_parameters,
    transfer_group,
    weights_digest,
)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)  # a frozen base; model[1] is the "adapter"
    return model


def _beside_nccl() -> list:
    """Make the default group look like NCCL to :func:`open_transfers` (it is gloo here, on a CPU) and record the
    group of every point-to-point call after it: each must be the transfers' own gloo group."""
    groups = []
    torch.distributed.get_backend = lambda group=None: "nccl" if group is None else "gloo"
    for name in ("send", "recv", "isend"):
        call = getattr(torch.distributed, name)

        def spy(*args, call=call, **kwargs):
            groups.append(kwargs.get("group"))
            return call(*args, **kwargs)

        setattr(torch.distributed, name, spy)
    open_transfers(30)
    return groups


def _worker(rank: int, init: str, folder: str, beside_nccl: bool = False) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    groups = _beside_nccl() if beside_nccl else None
    try:
        if rank == 0:
            send_object({"step": 3, "ids": torch.arange(6).view(2, 3), "note": "x"}, 1)
            model, sender = _model(0), WeightSender()
            sender.send(snapshot(model), 1, dst=1)
            with torch.no_grad():  # the sender moves on before the receiver has read: the copies travel
                model[1].weight.add_(1.0)
            sender.send(snapshot(model), 2, dst=1)
            sender.wait()
            torch.save(("sender", dict(model.state_dict())), f"{folder}/0.pt")
            _check_groups(groups)
        else:
            message = recv_object(0)
            model = _model(1)
            frozen = model[0].weight.clone()
            first = recv_weights(model, 0)
            once = model[1].weight.clone()
            second = recv_weights(model, 0)
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            torch.save(("receiver", message, first, second, once, frozen, weights), f"{folder}/1.pt")
            _check_groups(groups)
    finally:
        torch.distributed.destroy_process_group()


def _check_groups(groups: list | None) -> None:
    if groups is not None:  # every transfer went over the gloo group of its own, none over the default group
        assert groups and all(g is not None and g is transfer_group() for g in groups), groups


def test_an_object_and_two_weight_versions_travel_and_frozen_weights_stay(tmp_path):
    """Over a gloo group of their own, as beside an NCCL default group (the default gloo group they take on a
    CPU carries every torchrun test of tests/trainers/online/test_async_launch.py)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    mp.spawn(_worker, args=(f"file://{tmp_path / 'store'}", str(tmp_path), True), nprocs=2, join=True)
    found = [torch.load(tmp_path / f"{rank}.pt", weights_only=True) for rank in (0, 1)]
    got = {r[0]: r[1:] for r in found}
    (sent,) = got["sender"]
    message, first, second, once, frozen, received = got["receiver"]
    assert (
        message["step"] == 3
        and message["note"] == "x"
        and torch.equal(message["ids"], torch.arange(6).view(2, 3))
    )
    assert (first, second) == (1, 2)
    torch.testing.assert_close(once + 1.0, sent["1.weight"], rtol=0, atol=0)  # version 1, then version 2
    for key in ("1.weight", "1.bias"):
        assert torch.equal(received[key], sent[key])
    assert torch.equal(received["0.weight"], frozen) and not torch.equal(frozen, sent["0.weight"])


def test_trained_parameters_are_the_ones_that_require_grad():
    assert [name for name, _ in trained_parameters(_model(0))] == ["1.weight", "1.bias"]


def test_the_digest_follows_the_trained_weights_only():
    model = _model(0)
    digest = weights_digest(model)
    assert weights_digest(_model(0)) == digest
    with torch.no_grad():
        model[0].weight[0, 0] += 1.0  # frozen: not what travels
    assert weights_digest(model) == digest
    with torch.no_grad():
        model[1].weight[0, 0] += 1e-3
    assert weights_digest(model) != digest
    swapped = _model(0)
    with torch.no_grad():  # the same values in other tensors: another digest
        w, b = swapped[1].weight, swapped[1].bias
        w[0, 0], b[0] = b[0].item(), w[0, 0].item()
    assert weights_digest(swapped) != digest
