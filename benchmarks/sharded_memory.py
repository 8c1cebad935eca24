"""Benchmark: peak per-process memory of PPO rollouts + updates (actor, critic, reference, reward model; two by
default, so that a rollout generates beside AdamW's state as in a real run),
on 1 process, on 2 data-parallel processes and on 2 FSDP2-sharded processes (``train.sharding=full_shard``,
frozen models sharded too: ``train.frozen_models=shard``), in float32 or bfloat16.

The ``*-vllm`` configurations generate with the vLLM engine beside the sharded models
(``online.generation_backend=vllm``, KV cache ``--kv-cache-gib``; run them with the Python that has vLLM, e.g.
``.venv-vllm/bin/python``); ``1-sharded`` and ``1-sharded-vllm`` shard over a world of one.

Each configuration is a fresh ``torchrun --standalone --nproc_per_node N`` launch; every process runs
:func:`benchmarks.memory.measure` (the iteration of ``rlhfkit train ppo``) and reports its peak resident set
size (``getrusage``; glibc's mmap threshold fixed as in benchmarks/memory.py) or, on CUDA, its
``max_memory_allocated``. The figures are per process; the largest is printed. On Linux each process also
reports its resident set after each part is in memory (``stages_mib_per_process``: the four models, the engine,
AdamW's state after the first update) and the peak of each phase of the last rollout
(``last_rollout_phase_peak_mib_per_process``: generate, score, update), from which the bytes per parameter of
each part can be read (docs/performance.md, "Memory at scale").

The models: a built-in preset's freshly initialised policy (``--preset``, ``small`` by default) or any causal LM
folder (``--model``, e.g. a local copy of SmolLM2-135M-Instruct); the reward model is that model with a fresh
scalar head (memory does not depend on the weights' values). The prompts are the built-in task's.

Run (figures depend on the machine and its load; say so when you quote them)::

    python benchmarks/sharded_memory.py --preset tiny --batch-size 8 --response-length 16
    python benchmarks/sharded_memory.py --model /path/to/SmolLM2-135M-Instruct --dtype bfloat16
    .venv-vllm/bin/python benchmarks/sharded_memory.py --model .bench/smollm2-135m-instruct --batch-size 4 \
        --response-length 48 --configs 1-sharded-vllm,2-sharded-vllm
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import child_env, measure, prepare  # noqa: E402

SHARDED = ["train.sharding=full_shard"]
VLLM = ["online.generation_backend=vllm", "online.vllm_kv_cache_gib={kv}"]
CONFIGS = {
    "1": (1, []),
    "2": (2, []),
    "2-sharded": (2, SHARDED),
    "1-sharded": (1, SHARDED),
    "1-sharded-vllm": (1, SHARDED + VLLM),
    "2-sharded-vllm": (2, SHARDED + VLLM),
}


def model_paths(folder: Path, preset: str, model: str | None) -> dict[str, str]:
    """The policy, the reward model (the policy with a scalar head) and the prompts."""
    paths = prepare(folder, preset)
    if model is not None:
        from rlhfkit.models import load_scalar_model, load_tokenizer

        tokenizer = load_tokenizer(model)
        reward = load_scalar_model(model, tokenizer=tokenizer)
        reward.save_pretrained(folder / "model-reward")
        tokenizer.save_pretrained(folder / "model-reward")
        paths.update(policy=model, reward=str(folder / "model-reward"))
    return paths


def child(args) -> int:
    """One process of a launch: measure, write ``OUT/rank-R.json``."""
    rank = int(os.environ.get("RANK", "0"))
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"output_dir={out}",
            f"train.batch_size={args.batch_size}",
            f"online.response_length={args.response_length}",
            f"online.ppo_epochs={args.ppo_epochs}",
            f"model.dtype={args.dtype}",
            "data.max_prompt_length=32",
            *(o.format(kv=args.kv_cache_gib) for o in CONFIGS[args.child][1]),
        ]
        result = measure(json.loads(args.paths), overrides, args.threads, args.rollouts)
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model preset of the built-in task (tiny, small)")
    parser.add_argument("--model", default=None, help="a causal LM folder instead of the preset's model")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per rollout (all processes)")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument(
        "--rollouts",
        type=int,
        default=2,
        help="rollouts + updates (from the second on, generation runs beside AdamW's state, as in a real run)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--kv-cache-gib", type=int, default=1, help="the *-vllm configurations' online.vllm_kv_cache_gib"
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help="from: " + ", ".join(CONFIGS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        paths = model_paths(Path(tmp), args.preset, args.model)
        for name in args.configs.split(","):
            nproc = CONFIGS[name][0]
            out = Path(tmp) / f"out-{name}"
            out.mkdir()
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc}",
                __file__,
                f"--child={name}",
                f"--paths={json.dumps(paths)}",
                f"--out={out}",
                *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("dtype", "batch_size")),
                *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("response_length", "ppo_epochs")),
                f"--rollouts={args.rollouts}",
                f"--threads={args.threads}",
                f"--kv-cache-gib={args.kv_cache_gib}",
            ]
            env = {
                **child_env(),
                "RLHFKIT_NUM_THREADS": str(args.threads),
                "OMP_NUM_THREADS": str(args.threads),
            }
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
            peak = max(r["peak_bytes"] for r in ranks)
            print(
                json.dumps(
                    {
                        "config": name,
                        "processes": nproc,
                        "dtype": args.dtype,
                        "rollouts": args.rollouts,
                        "model": args.model or args.preset,
                        "peak_bytes_per_process_max": peak,
                        "peak_mib_per_process": [round(r["peak_bytes"] / 2**20, 1) for r in ranks],
                        "baseline_mib_per_process": [
                            round(r.get("baseline_bytes", 0) / 2**20, 1) for r in ranks
                        ],
                        "world_size": ranks[0]["world_size"],
                        "kv_cache_gib": args.kv_cache_gib if "vllm" in name else None,
                        "stages_mib_per_process": [
                            {k: round(v / 2**20, 1) for k, v in r.get("stages_bytes", {}).items()}
                            for r in ranks
                        ],
                        "last_rollout_phase_peak_mib_per_process": [
                            {k: round(v / 2**20, 1) for k, v in r.get("phase_peak_bytes", {}).items()}
                            for r in ranks
                        ],
                        "response_tokens_per_process": [r["response_tokens"] for r in ranks],
                        "parameters_held_per_process": ranks[0]["parameters_held"],
                        "parameters_trained_per_process": ranks[0]["parameters_trained"],
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
