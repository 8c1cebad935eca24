"""Rollouts that overlap training (``online.max_staleness`` k >= 1 on ``online.generation_processes`` g).

Under ``torchrun --nproc_per_node N`` with N = g + 1, process 0 trains and processes 1..g only sample. The
schedule is fixed, as in verl's one-step-off-policy mode: rollout ``s`` (1-based) is sampled by generator
``(s - 1) % g`` with the weights of version ``max(0, s - 1 - k)``, where version ``u`` is the trainer's weights
after its ``u``-th update (one per rollout: its count of rollouts trained). So while the trainer trains rollout
``s`` the generators sample up to rollout ``s + k``, and a rollout is trained at most k versions after the
weights that drew it. Prompts stay a function of (seed, step) (:func:`rlhfkit.trainers.online.collect.prompt_batch`),
so the trainer knows a rollout's prompts and checks that the generator answered those.

A generator sends the rollout's tokens, masks, its own log-probs of them (the behaviour policy's, at the
sampling temperature), the reference's (and a distillation teacher's), the entropy, the version of its weights and the seconds it waited for
them, with a fingerprint of those weights that the trainer checks against the version it sent (a transfer
that did not arrive is an error, not a silently stale generator: verl#7495) (:func:`generate_rollouts`). The trainer (:class:`AsyncTrainer`, stage 1 of
:func:`rlhfkit.trainers.online.train_online`) keeps only samples at most k versions old: an older sample's mask
is cleared, so it trains nothing (``async/dropped``); the PPO ratio of the others is taken against the
behaviour log-probs they carry, never recomputed with the trainer's weights
(:func:`rlhfkit.trainers.online.layout.old_logprobs_from_update` is off). After each update the trainer streams
its trained parameters (LoRA: the adapters) to the generator that samples with them next
(:class:`rlhfkit.engine.transfer.WeightSender`); the version of every trained sample is logged as
``async/staleness_mean`` / ``async/staleness_max``, with each side's idle seconds, the generator's seconds
sampling the rollout (``async/generation_seconds``) and the trainer's seconds sending the update's weights
(``async/weight_transfer_seconds``): the phase times of the model in docs/distributed.md.

Each side builds its context with a one-process view of the accelerator (:class:`ProcessView`): the trainer's
update runs alone (no data-parallel wrapper), and nothing of either side is a collective of the whole launch,
so the only communication between them is this module's. A side that dies closes its sockets and the other
side's next transfer raises; the command names that in one line (:func:`rlhfkit.engine.accel.lost_process`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch

from rlhfkit.algos.masked import fill_masked
from rlhfkit.engine.transfer import (
    WeightSender,
    recv_object,
    recv_weights,
    send_object,
    snapshot,
    tensors_digest,
    weights_digest,
)
from rlhfkit.errors import ConfigError
from rlhfkit.trainers.online.collect import critic_read, prompt_batch, sample_rollout
from rlhfkit.trainers.online.context import OnlineContext, StageClock, derived_seed
from rlhfkit.types import Rollout

TRAINER = 0
SENT = (
    "query_ids",
    "query_mask",
    "response_ids",
    "mask",
    "response_mask",
    "ended",
    "logprobs",
    "ref_logprobs",
)


class ProcessView:
    """The launch's accelerator as one side of an asynchronous run sees it: a single process (index 0, no
    data-parallel wrapping, every reduction the identity), on the launch's device; ``is_main_process`` only on
    the trainer, which writes the run folder."""

    num_processes = 1
    process_index = 0
    local_process_index = 0
    distributed_type = "NO"

    def __init__(self, accelerator, main: bool) -> None:
        self.device = accelerator.device
        self.is_main_process = self.is_local_main_process = main

    def prepare(self, *objects):
        return objects[0] if len(objects) == 1 else objects

    def reduce(self, values, reduction: str = "sum"):
        return values

    def gather(self, values):
        return values

    def wait_for_everyone(self) -> None:
        pass

    def main_process_first(self):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def unwrap_model(self, model):
        return model


def generator_index(cfg, accelerator) -> int | None:
    """This process's generator number (0..g-1: the last g processes of the launch), None on the trainer."""
    g = cfg.online.generation_processes
    first = accelerator.num_processes - g
    return accelerator.process_index - first if accelerator.process_index >= first else None


def sampling_version(step: int, k: int) -> int:
    """The version of the weights that sample rollout ``step``: ``max(0, step - 1 - k)``."""
    return max(0, step - 1 - k)


def sampler_of(step: int, g: int) -> int:
    """The generator (0..g-1) that samples rollout ``step``; it is process ``1 + sampler_of(step, g)``."""
    return (step - 1) % g


def first_rollout(generator: int, resumed: int, g: int) -> int:
    """The first rollout after ``resumed`` (0: a fresh run) that generator ``generator`` samples."""
    return resumed + 1 + (generator - resumed) % g


def generate_rollouts(ctx: OnlineContext, examples: list[dict], resumed: int = 0) -> dict[str, Any]:
    """A generator's whole run: sample its rollouts after rollout ``resumed`` (a resumed run's checkpoint; 0
    fresh) in order, each with the weights of its :func:`sampling_version` (received from the trainer before it
    is needed, in order), and send each to the trainer. Returns the generator's totals (rollouts, seconds
    waiting for weights, seconds sampling)."""
    cfg = ctx.cfg
    g, k = cfg.online.generation_processes, cfg.online.max_staleness
    # the critic is the trainer's (it reads the values when a rollout arrives): never read here
    ctx = dataclasses.replace(ctx, roles=dataclasses.replace(ctx.roles, critic=None))
    index = torch.distributed.get_rank() - (torch.distributed.get_world_size() - g)
    waited = time.perf_counter()
    version = recv_weights(ctx.roles.actor, TRAINER)  # the weights of its first rollout (fresh: version 0)
    totals = {"rollouts": 0, "idle_seconds": 0.0, "sample_seconds": 0.0}
    for step in range(first_rollout(index, resumed, g), cfg.train.max_steps + 1, g):
        while version < sampling_version(step, k):
            version = recv_weights(ctx.roles.actor, TRAINER)
        idle = time.perf_counter() - waited
        start = time.perf_counter()
        torch.manual_seed(derived_seed("sampling", cfg.seed, step, 0))  # as one synchronous process would
        batch = prompt_batch(ctx, examples, step)
        rollout = sample_rollout(ctx, batch, StageClock(ctx.device), step)
        message = rollout_message(rollout)
        sampled = time.perf_counter() - start
        message.update(
            step=step,
            version=version,
            idle_seconds=idle,
            sample_seconds=sampled,
            digest=weights_digest(ctx.roles.actor),
        )
        totals["sample_seconds"] += sampled
        totals["idle_seconds"] += idle
        totals["rollouts"] += 1
        waited = time.perf_counter()
        send_object(message, TRAINER)
    return totals


def rollout_message(rollout: Rollout) -> dict[str, torch.Tensor]:
    """What a generator sends of a rollout it sampled, as CPU tensors: the :data:`SENT` fields, the entropy and,
    under distillation, the teacher's log-probs (the teacher reads the rows here, as the reference does)."""
    message = {name: getattr(rollout, name).cpu() for name in SENT}
    message["entropy"] = rollout.entropy.cpu()
    if rollout.teacher_logprobs is not None:
        message["teacher_logprobs"] = rollout.teacher_logprobs.cpu()
    return message


class AsyncTrainer:
    """The trainer's side: stage 1 of each rollout is :meth:`collect` (receive it, keep what is fresh enough),
    and :meth:`publish` after each update sends the new weights where they are sampled with next.

    A checkpoint after update ``c`` keeps, besides the actor (version ``c``), the versions the rollouts
    ``c + 1 .. c + k`` are sampled with (:meth:`checkpoint_state`): what the generators held or were sent
    when the run stopped is lost with them, so a resumed run sends those versions again (:meth:`start`) and
    samples every rollout with the weights the uninterrupted run sampled it with. The trainer holds them as CPU
    copies, k versions of the trained parameters (LoRA: the adapters)."""

    def __init__(self, ctx: OnlineContext) -> None:
        self.ctx = ctx
        self.k = ctx.cfg.online.max_staleness
        self.g = ctx.cfg.online.generation_processes
        self.sender = WeightSender()
        self.metrics: dict[str, float] = {}
        self.digests: dict[int, float] = {}  # version -> weights_digest of the weights sent as that version
        self.kept: dict[int, list[torch.Tensor]] = {}  # version -> its snapshot, while a checkpoint needs it
        self.sent: dict[int, int] = {}  # generator process -> the newest version sent to it

    def needed(self, done: int) -> list[int]:
        """The versions, older than ``done``, that the rollouts after update ``done`` are sampled with."""
        last = min(done + self.k, self.ctx.cfg.train.max_steps)
        return sorted({sampling_version(s, self.k) for s in range(done + 1, last + 1)} - {done})

    def checkpoint_state(self, done: int) -> dict[str, Any]:
        """The trainer state a checkpoint after update ``done`` adds: ``async_versions``, each needed older
        version's snapshot (:meth:`needed`)."""
        return {"async_versions": {str(v): self.kept[v] for v in self.needed(done)}}

    def start(self, resumed: int = 0, state: dict[str, Any] | None = None) -> None:
        """Send each generator the weights of its first rollout after ``resumed`` (a fresh run: version 0 to
        every generator), then, in order, the versions that rollouts ``resumed + 1 .. resumed + 1 + k`` are
        sampled with; later versions go out from :meth:`publish`. ``state``: the resumed checkpoint's trainer
        state, with the older versions (:meth:`checkpoint_state`); one missing is a named error."""
        saved = (state or {}).get("async_versions", {})
        missing = [v for v in self.needed(resumed) if str(v) not in saved]
        if missing:
            raise ConfigError(
                f"--resume: the checkpoint of rollout {resumed} holds no weights of version(s) "
                f"{', '.join(map(str, missing))}, which online.max_staleness={self.k} samples the next rollouts "
                "with (it was written by a run with another online.max_staleness, or a synchronous one); resume "
                "with that run's settings"
            )
        self.kept = {int(v): list(tensors) for v, tensors in saved.items()}
        self.kept[resumed] = snapshot(self.ctx.roles.actor)
        shapes = [tuple(t.shape) for t in self.kept[resumed]]
        for v, tensors in self.kept.items():
            if [tuple(t.shape) for t in tensors] != shapes:
                raise ConfigError(
                    f"--resume: the checkpoint's weights of version {v} are not the shape of the actor's trained "
                    "parameters (another model or LoRA configuration); resume with that run's settings"
                )
        self.digests = {v: tensors_digest(t) for v, t in self.kept.items()}
        last = self.ctx.cfg.train.max_steps
        for j in range(self.g):
            first = first_rollout(j, resumed, self.g)  # past the last: it only waits for this one message
            self._send(min(sampling_version(first, self.k), resumed) if first <= last else resumed, j)
        for s in range(resumed + 1, min(resumed + 1 + self.k, last) + 1):
            if sampling_version(s, self.k) > self.sent[sampler_of(s, self.g)]:
                self._send(sampling_version(s, self.k), sampler_of(s, self.g))

    def _send(self, version: int, generator: int) -> None:
        self.sender.send(self.kept[version], version, 1 + generator)
        self.sent[generator] = version

    def collect(self, ctx: OnlineContext, batch: dict[str, Any], clock: StageClock, step: int) -> Rollout:
        """Rollout ``step`` as its generator sampled it, its stale samples masked out; the staleness and idle
        time go to :attr:`metrics`."""
        start = time.perf_counter()
        with clock("wait_samples"):
            message = recv_object(1 + sampler_of(step, self.g))
        if message["step"] != step or not torch.equal(message["query_ids"], batch["query_ids"].cpu()):
            raise RuntimeError(
                f"rollout {step}: the generator sent rollout {message['step']} or other prompts than "
                "(seed, step) give; every process must run the same configuration"
            )
        if message["digest"] != self.digests.get(int(message["version"])):
            raise RuntimeError(
                f"rollout {step}: the generator sampled with other weights than the trainer's version "
                f"{message['version']} (the weight transfer did not arrive whole)"
            )
        rollout = received_rollout(message, batch["group_ids"], ctx.device)
        versions = torch.full((rollout.mask.shape[0],), int(message["version"]), dtype=torch.long)
        keep, stats = fresh_samples(versions, step - 1, self.k)
        drop_samples(rollout, keep.to(ctx.device))
        if ctx.roles.critic is not None:  # PPO with a critic: its values now, by the trainer's critic
            rollout.values = critic_read(ctx, rollout, step)
        stats["async/trainer_idle_seconds"] = time.perf_counter() - start
        stats["async/generator_idle_seconds"] = float(message["idle_seconds"])
        stats["async/generation_seconds"] = float(message["sample_seconds"])
        self.metrics = stats
        return rollout

    def publish(self, step: int) -> None:
        """After the update of rollout ``step``: the weights are version ``step``; send them to the generator
        that samples rollout ``step + 1 + k`` (none past the last rollout). The seconds this takes the trainer
        (the weights' fingerprint, copying the parameters off the device, posting the sends) go to :attr:`metrics` as ``async/weight_transfer_seconds`` (0 when nothing is sent)."""
        seconds = 0.0
        if step + 1 + self.k <= self.ctx.cfg.train.max_steps:
            start = time.perf_counter()
            self.kept[step] = snapshot(self.ctx.roles.actor)
            self.digests[step] = tensors_digest(self.kept[step])
            self._send(step, sampler_of(step + 1 + self.k, self.g))
            seconds = time.perf_counter() - start
        for v in [v for v in self.kept if v < step - self.k]:  # no checkpoint from here on needs them
            del self.kept[v]
        self.metrics["async/weight_transfer_seconds"] = seconds

    def close(self) -> None:
        self.sender.wait()


def received_rollout(message: dict[str, Any], group_ids: torch.Tensor, device) -> Rollout:
    """A :class:`~rlhfkit.types.Rollout` of what a generator sent, on ``device``."""
    fields = {name: message[name].to(device) for name in SENT}
    teacher = message.get("teacher_logprobs")
    return Rollout(
        **fields,
        group_ids=group_ids,
        entropy=message["entropy"].to(device),
        teacher_logprobs=None if teacher is None else teacher.to(device),
    )


def fresh_samples(versions: torch.Tensor, version: int, k: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Which samples the trainer at ``version`` keeps: those drawn at most ``k`` versions before it.

    Args:
        versions: (B,) long, the version of the weights that drew each sample.
    Returns:
        (keep (B,) bool, ``async/staleness_mean`` and ``async/staleness_max`` of the kept samples (0 when none
        is kept), ``async/dropped``: the samples dropped).
    """
    staleness = version - versions  # (B,)
    keep = staleness <= k
    kept = staleness[keep].double()
    return keep, {
        "async/staleness_mean": float(kept.mean()) if kept.numel() else 0.0,
        "async/staleness_max": float(kept.max()) if kept.numel() else 0.0,
        "async/dropped": float((~keep).sum()),
    }


def drop_samples(rollout: Rollout, keep: torch.Tensor) -> None:
    """Clear the loss mask (and the logged entropy) of the rows ``keep`` (B,) leaves out: they train nothing,
    as a response that nothing scored (:func:`rlhfkit.trainers.online.collect.take_scores`)."""
    rollout.mask = rollout.mask & keep[:, None]
    rollout.entropy = fill_masked(rollout.entropy, rollout.mask)
    rollout.logprobs = fill_masked(rollout.logprobs, rollout.mask)
    rollout.ref_logprobs = fill_masked(rollout.ref_logprobs, rollout.mask)
    if rollout.teacher_logprobs is not None:
        rollout.teacher_logprobs = fill_masked(rollout.teacher_logprobs, rollout.mask)
