"""Benchmark: per-process peak memory of the weight sync into the vLLM engine beside a sharded actor
(``train.sharding=full_shard`` + ``online.generation_backend=vllm``), on 2 processes, against a gathered copy.

Every process shards the same random Llama (FSDP2) and starts its own engine (vLLM's external-launcher mode);
then, each measured from the resident set size just before it to the peak during it (Linux: the peak is reset
by writing 5 to ``/proc/self/clear_refs``; glibc's mmap threshold fixed, as in benchmarks/memory.py, so that
freed tensors leave the resident set):

- ``streamed``: :meth:`rlhfkit.rollout.vllm_engine.VLLMEngine.load_weights` on the sharded actor, what a run
  does every rollout: each parameter all-gathered on its own (``DTensor.full_tensor``) as the engine's loader
  takes it (:func:`rlhfkit.rollout.engine_weights.streamed_weights`);
- ``gathered_copy``: the whole weights gathered into a plain copy of the model
  (:func:`rlhfkit.engine.sharded.unshard`), what a sharded run samples from with ``generation_backend=hf``
  (:func:`rlhfkit.trainers.online.sharding.generation_model`);
- ``gathered_copy_then_sync``: that copy, then loaded into the engine: a sync that gathers the model first.

The three alternate ``--repeats`` times (streamed first, so that any memory the allocator kept would favour
the others); the largest of each over the repeats and the processes is printed, with the model's own size.

``--lora R``: one process instead, no sharding, the same model with LoRA adapters of rank R on every linear
layer (a non-zero update), comparing the sync that merges on the fly
(:func:`rlhfkit.models.lora.merged_weights`: each layer's W + s B A when its weight is taken) with one that
loads a merged copy of the model (:func:`rlhfkit.models.lora.merged_copy`, what the sync loaded before).

Run (with the vLLM environment; figures depend on the machine: say so when you quote them)::

    .venv-vllm/bin/python benchmarks/sharded_weight_sync.py
    .venv-vllm/bin/python benchmarks/sharded_weight_sync.py --hidden 768 --layers 12 --vocab 49152
    .venv-vllm/bin/python benchmarks/sharded_weight_sync.py --lora 16
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


def random_llama(args):
    """A random float32 Llama of the benchmark's shape (head size 64, untied embeddings)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

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
    return LlamaForCausalLM(config).float()


def lora_child(args) -> int:
    """One process, no sharding: the LoRA sync merged on the fly against a merged copy loaded."""
    import torch

    torch.set_num_threads(1)
    from rlhfkit.config.sections import ModelConfig
    from rlhfkit.models.lora import merged_copy, prepare_trained
    from rlhfkit.rollout.vllm_engine import EngineSettings, VLLMEngine

    model = prepare_trained(random_llama(args), ModelConfig(lora_rank=args.lora, lora_alpha=2 * args.lora))
    with torch.no_grad():  # lora_B starts at zero: a non-zero update, as after training
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.01)
    whole_bytes = sum(p.numel() * p.element_size() for p in model.get_base_model().parameters())
    engine = VLLMEngine(model, EngineSettings("float32", 1, "auto", 128, seed=0))

    def merged_copy_sync():
        copy = merged_copy(model)
        weights = ((n, t.detach()) for n, t in copy.state_dict().items())
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        del copy, weights

    ways = {"merged_on_the_fly": lambda: engine.load_weights(model), "merged_copy": merged_copy_sync}
    peaks: dict[str, list[int]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            peaks[name].append(peak_of(fn))
    engine.close()
    result = {
        "model_parameters_mib": round(whole_bytes / MIB, 1),
        "lora_rank": args.lora,
        "processes": 1,
        **{f"{name}_peak_mib": round(max(values) / MIB, 1) for name, values in peaks.items()},
    }
    Path(args.out).write_text(json.dumps(result))
    return 0


def child(args) -> int:
    import torch

    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    from rlhfkit.engine import sharded
    from rlhfkit.rollout.vllm_engine import EngineSettings, VLLMEngine

    model = random_llama(args)
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
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank: one unsharded process (0: sharded)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return lora_child(args) if args.lora else child(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        if args.lora:
            command = [sys.executable]
        settings = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
        settings += ["--repeats", str(args.repeats), "--lora", str(args.lora), "--child", "--out", str(out)]
        env = {**child_env(), "RLHFKIT_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run([*command, __file__, *settings], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        print(json.dumps(json.loads(out.read_text()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
