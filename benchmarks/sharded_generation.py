"""Benchmark: sampling a rollout from a sharded actor (FSDP2, ``train.sharding=full_shard``) on 2 processes, two
ways, with Hugging Face ``generate`` (what ``online.generation_backend=hf`` calls):

- ``sharded``: ``generate`` on the sharded actor itself. Every decoding step runs every layer's forward, and
  each forward all-gathers that layer's weights (full_shard reshards them after it): one all-gather per layer
  per token. The processes must take the same number of decoding steps, or their all-gathers stop pairing up
  and the run hangs (``synced_gpus=True``: a process whose responses have all ended keeps stepping until every
  process is done).
- ``gathered`` (rlhfkit's way, :func:`rlhfkit.trainers.online.sharding.generation_model`): the actor's whole
  weights gathered once into a plain copy (one all-gather of the model), each process samples alone, the copy
  is freed. The gather is inside the timing.

Each process samples its own prompts of the built-in task (``--batch-size`` prompts in all, split between the
processes) with the run's sampling (temperature 0.7, the pad suppressed) and the stop token; the figures are
the median over ``--repeats`` rollouts of the slowest process's seconds, after one warm-up rollout of each.

Run (one launch, 2 processes; figures depend on the machine and its load: say so when you quote them)::

    python benchmarks/sharded_generation.py --preset tiny
    python benchmarks/sharded_generation.py --preset small --batch-size 8 --response-length 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import child_env, prepare  # noqa: E402


def child(args) -> int:
    """One process: time both ways on this process's prompts; the main process writes ``OUT``."""
    import torch

    torch.set_num_threads(args.threads)
    from rlhfkit.engine import sharded
    from rlhfkit.engine.accel import end_processes, make_accelerator
    from rlhfkit.models import load_causal_lm, load_tokenizer, sampling_for
    from rlhfkit.rollout.generation import generate_responses

    paths = json.loads(args.paths)
    accelerator = make_accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer = load_tokenizer(paths["policy"])
    actor = sharded.shard_model(load_causal_lm(paths["policy"], tokenizer=tokenizer), "full_shard")
    prompts = [json.loads(line)["prompt"] for line in Path(paths["prompts"]).read_text().splitlines()]
    mine = prompts[rank * args.batch_size // world : (rank + 1) * args.batch_size // world]
    tokenizer.padding_side = "left"
    batch = tokenizer(mine, return_tensors="pt", padding=True)
    stop = [tokenizer.eos_token_id]
    sampling = sampling_for(tokenizer.pad_token_id, stop, temperature=0.7)

    def sample(model, sync: bool):
        if sync:  # the all-gathers of every step pair up only if every process takes every step
            generate = model.generate
            model.generate = lambda **kw: generate(**kw, synced_gpus=True)
        try:
            return generate_responses(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                max_new_tokens=args.response_length,
                stop_token_ids=stop,
                pad_token_id=tokenizer.pad_token_id,
                sampling=sampling,
            )
        finally:
            if sync:
                del model.generate

    def way(name: str) -> tuple[float, int]:
        torch.distributed.barrier()
        start = time.perf_counter()
        if name == "sharded":
            out = sample(actor, sync=True)
        else:
            copy = sharded.unshard(actor)
            out = sample(copy, sync=False)
            del copy
        seconds = time.perf_counter() - start
        slowest = torch.tensor([seconds])
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        return float(slowest), int(out.mask.sum())

    figures: dict[str, list[float]] = {"sharded": [], "gathered": []}
    tokens: dict[str, list[int]] = {"sharded": [], "gathered": []}
    for i in range(args.repeats + 1):
        for name in figures:
            torch.manual_seed(1000 * i + rank)
            seconds, n = way(name)
            if i:  # the first round warms up
                figures[name].append(seconds)
                tokens[name].append(n)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"seconds": figures, "tokens_rank0": tokens}))
    end_processes()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="model preset of the built-in task (tiny, small)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per rollout (all processes)")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        paths = prepare(Path(tmp), args.preset)
        out = Path(tmp) / "figures.json"
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__),
            *("--child", f"--paths={json.dumps(paths)}", f"--out={out}", f"--threads={args.threads}"),
            *(f"--batch-size={args.batch_size}", f"--response-length={args.response_length}"),
            f"--repeats={args.repeats}",
        ]
        proc = subprocess.run(command, env=child_env(), capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        found = json.loads(out.read_text())
    medians = {name: statistics.median(s) for name, s in found["seconds"].items()}
    print(
        json.dumps(
            {
                "preset": args.preset,
                "processes": 2,
                "batch_size": args.batch_size,
                "response_length": args.response_length,
                "threads_per_process": args.threads,
                "median_seconds_per_rollout": {k: round(v, 3) for k, v in medians.items()},
                "all_seconds": {k: [round(x, 3) for x in v] for k, v in found["seconds"].items()},
                "response_tokens_rank0": found["tokens_rank0"],
                "sharded_over_gathered": round(medians["sharded"] / medians["gathered"], 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
