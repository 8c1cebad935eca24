"""Point-to-point transfers between the processes of one launch, over gloo (:func:`open_transfers`: the default
process group on CPU, a gloo group of the launch beside NCCL on GPUs):
a small object (a dict of CPU tensors and numbers) from one process to another (:func:`send_object`,
:func:`recv_object`), and a model's trained parameters streamed one tensor at a time
(:class:`WeightSender`, :func:`recv_weights`; under LoRA only the adapters are trained, so only they travel).

Every receive waits at most the process group's timeout (``train.collective_timeout``); a peer that ended
closes its sockets, and the waiting side raises the error that :func:`rlhfkit.engine.accel.lost_process`
turns into one line.
"""

from __future__ import annotations

import io
from datetime import timedelta

import torch

from rlhfkit.errors import ConfigError

WEIGHTS_TAG = 7
OBJECT_TAG = 11
_group = None  # the process group of the transfers (:func:`open_transfers`); None: the default group


def open_transfers(timeout_seconds: float | None = None) -> None:
    """Make this launch's transfers travel over gloo, which carries CPU tensors: with a default process group of
    another backend (NCCL on GPUs, which carries only device tensors) a gloo group of every process, whose
    receives wait at most ``timeout_seconds`` (``train.collective_timeout``), else the default group. Every
    process calls it once, in the same order, before any transfer (a collective)."""
    global _group
    if torch.distributed.get_backend() == "gloo":
        _group = None
        return
    timeout = None if timeout_seconds is None else timedelta(seconds=timeout_seconds)
    _group = torch.distributed.new_group(backend="gloo", timeout=timeout)


def transfer_group():
    """The process group the transfers use (:func:`open_transfers`; None: the default group)."""
    return _group


def send_object(obj: object, dst: int, tag: int = OBJECT_TAG) -> None:
    """Send ``obj`` (tensors, numbers, strings, in dicts / lists: what ``torch.load(weights_only=True)``
    reads back) to process ``dst``: its byte length, then its bytes. Blocks until they are sent."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    torch.distributed.send(torch.tensor([data.numel()], dtype=torch.int64), dst, group=_group, tag=tag)
    torch.distributed.send(data, dst, group=_group, tag=tag)


def recv_object(src: int, tag: int = OBJECT_TAG) -> object:
    """What process ``src`` sent with :func:`send_object`."""
    size = torch.zeros(1, dtype=torch.int64)
    torch.distributed.recv(size, src, group=_group, tag=tag)
    data = torch.empty(int(size), dtype=torch.uint8)
    torch.distributed.recv(data, src, group=_group, tag=tag)
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def trained_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that training moves (``requires_grad``), in the model's order: what a weight transfer
    streams (LoRA: the adapters only)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


@torch.no_grad()
def weights_digest(model: torch.nn.Module) -> float:
    """A fingerprint of the trained parameters (float64 sums of each tensor and of its squares, in order): equal
    on two processes that hold the same bits, so a receiver can show which weights it samples with."""
    return tensors_digest([p for _, p in trained_parameters(model)])


@torch.no_grad()
def tensors_digest(tensors: list[torch.Tensor]) -> float:
    """:func:`weights_digest` of a list of tensors (a :func:`snapshot` of the trained parameters)."""
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(tensors):
        x = p.detach().to("cpu", torch.float64)
        total += x.sum() + (i + 1) * x.square().sum()
    return float(total)


@torch.no_grad()
def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """CPU copies of the trained parameters, in :func:`trained_parameters`' order: one version of the weights
    that a :class:`WeightSender` can send (and a checkpoint keep) while the model moves on."""
    return [p.detach().to("cpu", copy=True).contiguous() for _, p in trained_parameters(model)]


class WeightSender:
    """Streams snapshots of a model's trained parameters to other processes without waiting for them: each send
    holds its tensors until it completes (a :func:`snapshot` is a copy, so the model may move meanwhile), and
    the sends to one process arrive in the order they were posted. :meth:`send` never waits for an earlier
    send: a generator k rollouts ahead takes a version only before the rollout that needs it, and meanwhile
    blocks sending the trainer its rollouts, so a sender that waited for the previous version to arrive before
    posting the next deadlocked both sides (k >= 2). :meth:`wait` (at the end) waits for every send."""

    def __init__(self) -> None:
        self.pending: list = []

    def send(self, tensors: list[torch.Tensor], version: int, dst: int) -> None:
        """Post ``version`` and the number of tensors, then each tensor of a :func:`snapshot` of the trained
        parameters in turn, to ``dst``; returns at once (the sends that completed are let go)."""
        self.pending = [(work, t) for work, t in self.pending if not work.is_completed()]
        header = torch.tensor([version, len(tensors)], dtype=torch.int64)
        self.pending.append((torch.distributed.isend(header, dst, group=_group, tag=WEIGHTS_TAG), header))
        for t in tensors:
            self.pending.append((torch.distributed.isend(t, dst, group=_group, tag=WEIGHTS_TAG), t))

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []


@torch.no_grad()
def recv_weights(model: torch.nn.Module, src: int) -> int:
    """Receive what a :class:`WeightSender` sent from ``src`` into ``model``'s trained parameters, in place,
    one tensor at a time; returns the version. The parameter count must match (the same configuration on
    both sides), else a named error."""
    header = torch.zeros(2, dtype=torch.int64)
    torch.distributed.recv(header, src, group=_group, tag=WEIGHTS_TAG)
    version, count = (int(x) for x in header)
    params = trained_parameters(model)
    if count != len(params):
        raise ConfigError(
            f"weight transfer from process {src}: it sends {count} trained tensors, this process's model has "
            f"{len(params)}; every process of the launch must run the same configuration"
        )
    for _, p in params:
        buffer = torch.empty(p.shape, dtype=p.dtype)
        torch.distributed.recv(buffer, src, group=_group, tag=WEIGHTS_TAG)
        p.copy_(buffer.to(p.device))
    return version
