"""Benchmark: per-process peak memory of the weight sync into the vLLM engine beside a sharded actor
(``train.sharding=full_shard`` + ``online.generation_backend=vllm``), on 2 processes, against a gathered copy.

Every process shards the same random Llama (FSDP2) and starts its own engine (vLLM's external-launcher mode);
then, each measured from the resident set size just before it to the peak during it (Linux: the peak is reset
by writing 5 to ``/proc/self/clear_refs``; glibc's mmap threshold fixed, as in benchmarks/memory.py, so that
freed tensors leave the resident set):

- ``streamed``: :meth:`rlhfkit.rollout.vllm_engine.VLLMEngine.load_weights` on the sharded actor, what a run
  does every rollout: each parameter all-gathered on its own (``DTensor.full_tensor``) as the engine's loader
  takes it (:func:`rlhfkit.rollout.vllm_engine.streamed_weights`);
- ``gathered_copy``: the whole weights gathered into a plain copy of the model
  (:func:`rlhfkit.engine.sharded.unshard`), what a sharded run samples from with ``generation_backend=hf``
  (:func:`rlhfkit.trainers.online.sharding.generation_model`);
- ``gathered_copy_then_sync``: that copy, then loaded into the engine: a sync that gathers the model first.

The three alternate ``--repeats`` times (streamed first, so that any memory the allocator kept would favour
the others); the largest of each over the repeats and the processes is printed, with the model's own size.

Run (with the vLLM environment; figures depend on the machine: say so when you quote them)::

    .venv-vllm/bin/python benchmarks/sharded_weight_sync.py
    .venv-vllm/bin/python benchmarks/sharded_weight_sync.py --hidden 768 --layers 12 --vocab 49152
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import child_env  # noqa: E402

MIB = 2**20


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_of(fn) -> int:
    """Bytes by which the resident set's peak during ``fn()`` exceeds the resident set before it."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current size
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def child(args) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    from rlhfkit.engine import sharded
    from rlhfkit.rollout.vllm_engine import EngineSettings, VLLMEngine

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    actor = sharded.shard_model(model, "full_shard")
    engine = VLLMEngine(actor, EngineSettings("float32", 1, "auto", 128, seed=0))

    def gathered_copy():
        copy = sharded.unshard(actor)
        del copy

    def gathered_copy_then_sync():
        copy = sharded.unshard(actor)
        engine.load_weights(copy)
        del copy

    ways = {"streamed": lambda: engine.load_weights(actor), "gathered_copy": gathered_copy}
    ways["gathered_copy_then_sync"] = gathered_copy_then_sync
    peaks: dict[str, list[int]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            peaks[name].append(peak_of(fn))
    engine.close()
    mine = {name: max(values) for name, values in peaks.items()}
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    if torch.distributed.get_rank() == 0:
        result = {
            "model_parameters_mib": round(whole_bytes / MIB, 1),
            "largest_parameter_mib": round(max(p.numel() * 4 for p in actor.parameters()) / MIB, 1),
            "processes": len(everyone),
            **{f"{name}_peak_mib": round(max(p[name] for p in everyone) / MIB, 1) for name in ways},
        }
        Path(args.out).write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (head size 64)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        settings = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
        settings += ["--repeats", str(args.repeats), "--child", "--out", str(out)]
        env = {**child_env(), "RLHFKIT_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run([*command, __file__, *settings], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        print(json.dumps(json.loads(out.read_text()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
