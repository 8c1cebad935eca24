"""Benchmark: peak memory of one PPO rollout + update, with four full models, with LoRA, and with LoRA and
gradient checkpointing.

Set-up (once, in a temporary folder): the built-in task's tokenizer and prompts, a freshly initialised
policy of a model preset (``small`` by default) and a reward model made from it (the same backbone and a
scalar head), as the quickstart's PPO stage has them. Then, for each configuration, a FRESH Python process
(so that no allocation of an earlier configuration counts) builds the four roles as ``rlhfkit train ppo``
does, samples one rollout, scores it, shapes the rewards, estimates advantages and runs the PPO epochs, and
reports:

- on a CPU: the process's peak resident set size (``getrusage`` ``ru_maxrss``), before the models are loaded
  (the interpreter, torch and transformers) and at the end, with glibc's mmap threshold fixed at 64 KiB
  (:func:`child_env`; set ``MALLOC_MMAP_THRESHOLD_`` yourself to measure otherwise);
- on a CUDA GPU: ``torch.cuda.max_memory_allocated``.

Weights are random: memory does not depend on what a model has learned. The configurations:

- ``full``: actor, critic, reference and reward model, four full copies; AdamW for actor and critic;
- ``lora``: ``model.lora_rank`` adapters; the reference is the actor with its adapter disabled and the critic an
  adapter on the reward model (two base copies);
- ``lora_gc``: the same with ``model.gradient_checkpointing``.

Run (figures depend on the machine; say so when you quote them)::

    python benchmarks/memory.py                          # small preset, the preset's PPO batch
    python benchmarks/memory.py --preset tiny --batch-size 16 --response-length 32
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {
    "full": [],
    "lora": ["model.lora_rank={rank}"],
    "lora_gc": ["model.lora_rank={rank}", "model.gradient_checkpointing=true"],
}


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """This process's resident set size now (Linux ``VmRSS``; 0 where ``/proc`` has no status)."""
    return _status_bytes("VmRSS")


class PhasePeaks:
    """The peak resident set of each phase of a run (``with peaks.phase(name):``), from Linux's ``VmHWM``
    restarted at the phase's start (``/proc/self/clear_refs``). That restart also lowers what ``getrusage``
    reports afterwards, so ``highest`` keeps the largest peak seen, before and within the phases."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.highest = 0
        self._linux = Path("/proc/self/clear_refs").exists()

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self._linux:
            yield
            return
        self.highest = max(self.highest, _status_bytes("VmHWM"))
        Path("/proc/self/clear_refs").write_text("5")
        try:
            yield
        finally:
            self.peaks[name] = _status_bytes("VmHWM")
            self.highest = max(self.highest, self.peaks[name])


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in bytes, 0 where there is none."""
    status = Path("/proc/self/status")
    if not status.exists():
        return 0
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def local(p):
    """A parameter's tensor on this process: a sharded (DTensor) parameter's own shard, else itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def child_env() -> dict[str, str]:
    """The environment of a measuring process. glibc adapts its mmap threshold upwards as large blocks are
    freed, after which big tensors come from the heap, whose freed space is reused or not depending on the
    order of allocations: the same run then peaks up to ~1.5 GB apart (measured here on the small preset).
    A fixed threshold returns every large block when it is freed, so the peak follows the live tensors."""
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    return env


def prepare(folder: Path, preset: str) -> dict[str, str]:
    """The policy, the reward model and the prompts under ``folder``."""
    from rlhfkit.models import load_scalar_model, load_tokenizer
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files

    files = prepare_task_files(
        get_task("reviews", seed=0), folder / "task", preset, num_sft=64, num_sft_eval=16
    )
    tokenizer = load_tokenizer(str(files["init_model"]))
    reward = load_scalar_model(str(files["init_model"]), tokenizer=tokenizer)
    reward.save_pretrained(folder / "reward")
    tokenizer.save_pretrained(folder / "reward")
    return {
        "policy": str(files["init_model"]),
        "reward": str(folder / "reward"),
        "prompts": str(files["prompts_train"]),
    }


def measure(paths: dict[str, str], overrides: list[str], threads: int, rollouts: int = 1) -> dict:
    """``rollouts`` rollouts + updates of ``rlhfkit train ppo`` with ``overrides``; the memory figures and counts.

    The first rollout generates before AdamW's state exists (it is allocated at the first step); from the second
    on, generation (and under sharding the actor's gathered copy) comes on top of it, as in every later rollout.
    With ``online.generation_backend=vllm`` the run's engine is started as ``rlhfkit train ppo`` starts it (vLLM
    imported before the first figure, so that its code does not count as the engine's memory).

    On a CPU, ``stages_bytes`` is the resident set after each part is in memory: ``start`` (interpreter,
    torch, transformers), ``roles`` (the four roles' weights), ``engine`` (vllm: the engine's weights and KV
    cache), ``update_1`` (the first rollout + update: AdamW's moments, and what the allocator kept), ``end``.
    """
    import torch

    torch.set_num_threads(threads)
    from rlhfkit.config import load_config
    from rlhfkit.data import TokenLimits, prepare_examples
    from rlhfkit.engine.accel import make_accelerator
    from rlhfkit.models import load_tokenizer
    from rlhfkit.trainers.online.collect import prompt_batch, sample_rollout, score_rollout, take_scores
    from rlhfkit.trainers.online.context import build_context
    from rlhfkit.trainers.online.ppo_update import ppo_update
    from rlhfkit.trainers.online.shaping import estimate_advantages, shape_rollout

    if any(o == "online.generation_backend=vllm" for o in overrides):
        import vllm  # noqa: F401  (its code in the start figure, not in the engine's)
    from rlhfkit.trainers.online.engine_rollout import start_engine

    before = peak_rss_bytes()
    stages = {"start": rss_bytes()}
    cfg = load_config(
        None,
        [
            f"model.name_or_path={paths['policy']}",
            f"online.reward_model={paths['reward']}",
            f"data.train_file={paths['prompts']}",
            *overrides,
        ],
        "ppo",
    )
    accelerator = make_accelerator()
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    examples = prepare_examples(
        cfg.data.train_file, "prompts", tokenizer, TokenLimits(cfg.data.max_prompt_length, None, "left")
    )
    ctx = build_context(cfg, accelerator, tokenizer)
    stages["roles"] = rss_bytes()
    ctx = dataclasses.replace(ctx, engine=start_engine(cfg, ctx.roles.actor))  # None unless vllm
    stages["engine"] = rss_bytes()
    roles = [ctx.roles.actor, ctx.roles.reference, ctx.roles.critic, ctx.roles.reward_model]
    # A sharded parameter counts its own shard (its local tensor): a DTensor's data_ptr is not its storage's.
    held = {local(p).data_ptr(): local(p).numel() for role in roles for p in role.parameters()}
    trained = sum(
        local(p).numel()
        for m in (ctx.roles.actor, ctx.roles.critic)
        for p in m.parameters()
        if p.requires_grad
    )
    cuda = accelerator.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # One iteration of rlhfkit.trainers.online.train_online: generate, score, shape, advantages, PPO epochs.
    # The last rollout's phases each get their own peak (Linux: VmHWM restarted from the current size).
    phases = PhasePeaks()
    for step in range(1, rollouts + 1):
        phase = phases.phase if step == rollouts else contextlib.nullcontext
        batch = prompt_batch(ctx, examples, step)
        with phase("generate"):
            rollout = sample_rollout(ctx, batch)
        with phase("score"):
            take_scores(rollout, score_rollout(ctx, rollout, batch["records"]))
            shape_rollout(ctx, rollout, ctx.kl_ctl.value)
            rollout.advantages, rollout.returns = estimate_advantages(ctx, rollout)
        with phase("update"):
            ppo_update(ctx, rollout, step)
        if step == 1:
            stages["update_1"] = rss_bytes()
    stages["end"] = rss_bytes()
    if ctx.engine is not None:
        ctx.engine.close()
    out = {
        "parameters_held": sum(held.values()),
        "parameters_trained": trained,
        "response_tokens": int(rollout.mask.sum()),
        "device": accelerator.device.type,
        "world_size": accelerator.num_processes,
    }
    if cuda:
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    else:
        out["baseline_bytes"] = before
        out["peak_bytes"] = max(peak_rss_bytes(), phases.highest)
        out["stages_bytes"] = stages
        out["phase_peak_bytes"] = phases.peaks
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model preset of the built-in task (tiny, small)")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="prompts per rollout (default: the preset's)"
    )
    parser.add_argument(
        "--response-length", type=int, default=None, help="tokens per response (default: the preset's)"
    )
    parser.add_argument("--ppo-epochs", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated, from: " + ", ".join(CONFIGS)
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one configuration, JSON out
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from rlhfkit.quickstart.pipeline import PRESETS

    preset = PRESETS[args.preset]
    batch = args.batch_size or preset.ppo_batch
    length = args.response_length or preset.response_length

    if args.child:
        with tempfile.TemporaryDirectory() as out:
            overrides = [
                f"output_dir={out}",
                f"train.batch_size={batch}",
                f"online.response_length={length}",
                f"online.ppo_epochs={args.ppo_epochs}",
                "data.max_prompt_length=32",
                *(o.format(rank=args.rank) for o in CONFIGS[args.child]),
            ]
            print(json.dumps(measure(json.loads(args.paths), overrides, args.threads)))
        return 0

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    with tempfile.TemporaryDirectory() as tmp:
        paths = prepare(Path(tmp), preset.model)
        print(
            f"preset {args.preset}: {batch} prompts x {length} tokens, {args.ppo_epochs} PPO epochs, LoRA rank "
            f"{args.rank}, {args.threads} threads"
        )
        print(
            f"{'configuration':<14} {'params held':>12} {'trained':>12} {'peak (MB)':>10} {'above start (MB)':>17}"
        )
        for name in names:
            command = [
                sys.executable,
                __file__,
                "--child",
                name,
                "--paths",
                json.dumps(paths),
                "--preset",
                args.preset,
                "--batch-size",
                str(batch),
                "--response-length",
                str(length),
                "--ppo-epochs",
                str(args.ppo_epochs),
                "--rank",
                str(args.rank),
                "--threads",
                str(args.threads),
            ]
            done = subprocess.run(command, capture_output=True, text=True, env=child_env())
            if done.returncode != 0:
                print(f"{name}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                return 1
            r = json.loads(done.stdout.strip().splitlines()[-1])
            above = (r["peak_bytes"] - r["baseline_bytes"]) / 2**20 if "baseline_bytes" in r else float("nan")
            print(
                f"{name:<14} {r['parameters_held']:>12,} {r['parameters_trained']:>12,} "
                f"{r['peak_bytes'] / 2**20:>10.0f} {above:>17.0f}   ({r['device']})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
