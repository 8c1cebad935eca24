"""Rollouts that overlap training against the synchronous loop on two processes, and the phase-time model of
docs/distributed.md ("When overlapping pays") checked against the same runs.

Three configurations, each ``torchrun --standalone --nproc_per_node 2`` of ``rlhfkit train grpo`` with one torch
thread per process (``RLHFKIT_NUM_THREADS=1 OMP_NUM_THREADS=1``):

- ``sync``: ``online.max_staleness=0``, the two processes data parallel (each samples and trains half);
- ``k1``, ``k2``: ``online.max_staleness`` 1 or 2 with ``online.generation_processes=1``: process 0 trains,
  process 1 only samples.

The model is SmolLM2-135M-Instruct (``benchmarks/smollm2.py`` builds it; 96 chat prompts of
``benchmarks/grpo_vs_trl.py`` and its length reward) with LoRA r16 / alpha 32, or ``--model tiny``: the
quickstart's tiny preset (the built-in reviews task's prompts, a fresh tiny Llama), also with LoRA r16. Every
response is exactly ``--response-length`` tokens (the stop token suppressed, as in ``benchmarks/ppo_vs_trl.py``),
so every configuration does the same work. One epoch of one minibatch per rollout, AdamW at 1e-5, the KL in the
loss (k3, 0.04).

Each run is ``--rollouts`` rollouts; its figures come from the trainer's metrics.jsonl over rollouts 2..N (the
first, warm-up, left out): seconds per rollout (mean ``time/step_seconds``), rollouts per hour, response tokens
per second, the stage times (``time/*``) and the overlap's (``async/*``), and each process's peak RSS. The
configurations alternate in ``--repeats`` rounds (the order rotating) and the table gives medians over rounds.
Each (configuration, round) is cached as JSON in ``--out``: an interrupted measurement continues where it
stopped (delete the folder, or change a setting, to measure again).

The model's prediction from the same runs (:func:`predicted_async_seconds`): t_sync is the ``sync`` run's
measured seconds per rollout; for ``k1`` / ``k2``, G(B) is the generator's ``async/generation_seconds``, U(B)+A_1
the trainer's seconds per rollout less its ``async/trainer_idle_seconds`` and ``async/weight_transfer_seconds``,
W the ``async/weight_transfer_seconds`` of the updates that sent weights, and R (the generator's receive of
them, not logged on its own) is taken equal to W. Predicted gain = t_sync / t_async(predicted), measured gain =
t_sync / t_async(measured); their ratio says how far the model is from the runs.

    python benchmarks/smollm2.py                       # once: the SmolLM2 folder in .bench/
    python benchmarks/async_rollouts.py --precision bf16 --repeats 3 --json .bench/async_rollouts.json
    python benchmarks/async_rollouts.py --model tiny --response-length 64 --rollouts 6
    python benchmarks/async_rollouts.py --smoke --out /tmp/async-smoke    # tiny, 2 rollouts, 1 round, 8 tokens

Run it on an otherwise idle machine with at least two free cores: every figure is a wall time, and the two
processes of a launch must not share a core, or nothing overlaps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_vs_trl  # noqa: E402  (the chat prompts and the length reward)
import ppo_vs_trl as common  # noqa: E402  (forced length, RSS, dtypes)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"sync": (0, 0), "k1": (1, 1), "k2": (2, 1)}  # name -> (online.max_staleness k, generators g)
KL_COEF, LEARNING_RATE = 0.04, 1e-5


# --------------------------------------------------------------------------------------------------------
# the phase-time model (docs/distributed.md, "When overlapping pays")


def sync_seconds(generate_share: float, update_share: float, fixed: float) -> float:
    """t_sync = G(B/p) + U(B/p) + A_p: every process samples its share, then all train it."""
    return generate_share + update_share + fixed


def predicted_async_seconds(
    update: float, fixed: float, send: float, generate: float, g: int, k: int, receive: float | None = None
) -> float:
    """Steady-state seconds per rollout of ``g`` generators and one trainer at staleness ``k`` >= 1:
    max(tau, (G + R) / g, (G + R + tau) / (k + 1)) with tau = U(B) + A_1 + W.

    The trainer's step (tau) is its update, its fixed cost and its send of the new weights (W). A generator's
    rollout is its receive of the weights (R, default W) and its sampling (G), and it samples every g-th rollout
    (throughput: G + R <= g t). Rollout s needs the weights of update s - 1 - k, sent at the end of that step,
    and the trainer trains it right after step s - 1 ends: the chain from one end of step to the next k + 1
    holds the sampling and one trainer step (latency: G + R + tau <= (k + 1) t).
    """
    if k < 1 or g < 1:
        raise ValueError(f"overlap needs k >= 1 and g >= 1, got k={k}, g={g}")
    receive = send if receive is None else receive
    step = update + fixed + send
    return max(step, (generate + receive) / g, (generate + receive + step) / (k + 1))


def simulated_async_seconds(
    update: float, fixed: float, send: float, generate: float, g: int, k: int, receive: float | None = None,
    rollouts: int = 400,
) -> float:  # fmt: skip
    """The same steady state from the schedule that :mod:`rlhfkit.trainers.online.async_loop` runs, event by
    event: rollout s is sampled by generator ``sampler_of(s, g)`` once it is free and has received version
    ``sampling_version(s, k)`` (sent at the end of the trainer's step of that version; each new version takes R
    to receive, then the sampling G); the trainer takes rollout s when it is ready and step s - 1 has ended
    (the generator's send blocks until then), then updates (U + A) and sends (W; no send for the last k
    rollouts, which nothing samples with). Returns the trainer's mean seconds per rollout over the second half
    of ``rollouts`` (the last k left out)."""
    from rlhfkit.trainers.online.async_loop import sampler_of, sampling_version

    receive = send if receive is None else receive
    sent = {0: 0.0}  # version -> when the trainer has sent it (version 0: at the start)
    free = [0.0] * g  # when each generator's previous rollout has been taken
    held = [0] * g  # the version each generator holds
    trainer, ends = 0.0, []
    for s in range(1, rollouts + 1):
        j, v = sampler_of(s, g), sampling_version(s, k)
        start = max(free[j], sent[v])
        if v != held[j]:  # a generator receives only the versions it samples with
            start += receive
            held[j] = v
        taken = max(trainer, start + generate)  # AsyncTrainer.collect
        free[j] = taken
        trainer = taken + update + fixed
        if s + 1 + k <= rollouts:  # AsyncTrainer.publish
            trainer += send
            sent[s] = trainer
        ends.append(trainer)
    half = rollouts // 2
    return (ends[-1 - k] - ends[half]) / (rollouts - 1 - k - half)


# --------------------------------------------------------------------------------------------------------
# one run: torchrun of this script's worker, figures from the trainer's metrics.jsonl


def worker(config: str, rss: str) -> int:
    """One process of a launch: ``rlhfkit train grpo`` with every response forced to full length; its peak RSS
    to ``rss`` (``{rank}`` filled in)."""
    from rlhfkit.cli import main

    with common.forced_length():
        code = main(["train", "grpo", "--config", config])
    Path(rss.format(rank=os.environ.get("RANK", "0"))).write_text(json.dumps(common.peak_rss_mib()))
    return code


def run_settings(a, inputs: dict, name: str, out: Path) -> dict:
    """The run's keys: the model with LoRA r16, GRPO of ``a.prompts`` x ``a.group`` responses, one epoch of one
    minibatch, and the configuration's staleness and generators."""
    k, g = CONFIGS[name]
    responses = a.prompts * a.group
    share = responses if g else responses // 2  # a data-parallel process trains half the rollout
    return common.nested(
        {
            "output_dir": str(out),
            "seed": 0,
            "model.name_or_path": inputs["model"],
            "model.dtype": common.DTYPES[a.precision],
            "model.lora_rank": 16,
            "model.lora_alpha": 32,
            "data.train_file": inputs["prompts"],
            "data.max_prompt_length": 64,
            "train.max_steps": a.rollouts,
            "train.batch_size": a.prompts,
            "train.learning_rate": LEARNING_RATE,
            "train.micro_batch_size": min(a.micro_batch, share),
            "train.save_steps": 10**6,
            "train.eval_steps": 10**6,
            "online.group_size": a.group,
            "online.reward_functions": [f"{Path(grpo_vs_trl.__file__).resolve()}:length_reward"],
            "online.response_length": a.response_length,
            "online.missing_eos": "none",
            "online.kl_coef": KL_COEF,
            "online.kl_in_loss": True,
            "online.kl_loss_estimator": "k3",
            "online.ppo_epochs": 1,
            "online.num_minibatches": 1,
            "online.max_staleness": k,
            "online.generation_processes": g,
            "logging.samples_per_step": 0,
            "logging.progress_bar": False,
        }
    )


def launch(a, inputs: dict, name: str, folder: Path) -> dict:
    """One torchrun of configuration ``name`` in ``folder``; its figures (:func:`run_figures`)."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "grpo.yaml"
    config.write_text(yaml.safe_dump(run_settings(a, inputs, name, folder / "run")))
    rss = folder / "rss-{rank}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(Path(__file__).resolve()), "worker", "--config", str(config), "--rss", str(rss)]
    threads = str(a.threads)
    env = {**os.environ, "RLHFKIT_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"{name} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}")
    from rlhfkit.engine.metrics_writer import read_metrics

    figures = run_figures(name, read_metrics(folder / "run" / "metrics.jsonl"), a.prompts * a.group)
    figures["peak_rss_mib"] = [json.loads(Path(str(rss).format(rank=r)).read_text()) for r in (0, 1)]
    return figures


def run_figures(name: str, rows: list[dict], responses: int) -> dict:
    """A run's figures over rollouts 2..N of its metrics.jsonl (``responses`` per rollout): seconds per
    rollout, rollouts per hour, response tokens per second, the mean of every ``time/*`` and ``async/*`` key,
    and the phase times of the model (module docstring)."""
    window = [r for r in rows if r["step"] >= 2] or rows
    seconds = [r["time/step_seconds"] for r in window]
    per_rollout = statistics.mean(seconds)
    figures = {
        "config": name,
        "rollouts_timed": len(window),
        "seconds_per_rollout": per_rollout,
        "rollouts_per_hour": 3600.0 / per_rollout,
        "tokens_per_second": sum(r["response_length/mean"] * responses for r in window) / sum(seconds),
        "stages": {
            key: statistics.mean(r.get(key, 0.0) for r in window)
            for key in sorted({key for r in window for key in r if key.startswith(("time/", "async/"))})
        },
    }
    stages = figures["stages"]
    if CONFIGS[name][0] == 0:  # each process: sample its share (with both log-probs), then score and train it
        generate = stages.get("time/generate", 0.0) + stages.get("time/forward", 0.0)
        update = stages.get("time/score", 0.0) + stages.get("time/update", 0.0)
        figures["phases"] = {"G": generate, "U": update, "A": per_rollout - generate - update}
    else:
        sends = [r["async/weight_transfer_seconds"] for r in window if r["async/weight_transfer_seconds"] > 0]
        busy = [
            r["time/step_seconds"] - r["async/trainer_idle_seconds"] - r["async/weight_transfer_seconds"]
            for r in window
        ]
        figures["phases"] = {
            "G": stages["async/generation_seconds"],
            "U+A": statistics.mean(busy),
            "W": statistics.mean(sends) if sends else 0.0,
        }
    return figures


# --------------------------------------------------------------------------------------------------------
# rounds, medians, the model's prediction


def prepare_inputs(a, work: Path) -> dict:
    """The model folder and prompts file: SmolLM2 (``benchmarks/smollm2.py``) and the chat prompts, or the tiny
    preset's fresh model and the reviews task's prompts."""
    if a.model != "tiny":
        folder = None if a.model == "smollm2" else Path(a.model)
        made = grpo_vs_trl.prepare(work, folder)
        return {"model": made["model"], "prompts": str(work / "prompts.jsonl")}
    from rlhfkit.quickstart.pipeline import PRESETS
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files

    files = prepare_task_files(
        get_task("reviews", seed=0), work / "task", PRESETS["tiny"].model, num_sft_eval=16
    )
    return {"model": str(files["init_model"]), "prompts": str(files["prompts_train"])}


def settings_tag(a) -> str:
    """The settings a cached result belongs to: a result is reused only under the same ones."""
    model = Path(a.model).name if a.model not in ("tiny", "smollm2") else a.model
    return (
        f"{model}-{a.precision}-r{a.response_length}-n{a.rollouts}-p{a.prompts}x{a.group}"
        f"-mb{a.micro_batch}-t{a.threads}"
    )


def measure(a) -> dict:
    """``a.repeats`` rounds of every configuration, the order rotating; each (configuration, round) cached."""
    out = Path(a.out)
    inputs = prepare_inputs(a, out / "inputs")
    cache = out / settings_tag(a)
    cache.mkdir(parents=True, exist_ok=True)
    names = list(CONFIGS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(a.repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            path = cache / f"{name}-round{i + 1}.json"
            if path.is_file():
                result = json.loads(path.read_text())
                note = "cached"
            else:
                result = launch(a, inputs, name, cache / f"{name}-round{i + 1}")
                path.write_text(json.dumps(result, indent=1) + "\n")
                note = "measured"
            runs[name].append(result)
            print(
                f"  {name} round {i + 1}: {result['seconds_per_rollout']:.3f} s / rollout ({note})",
                flush=True,
            )
    return summarise(a, runs)


def summarise(a, runs: dict[str, list[dict]]) -> dict:
    """Medians over rounds of each configuration's figures, and the model's prediction from them."""
    result = {
        "model": a.model,
        "precision": a.precision,
        "response_length": a.response_length,
        "prompts": a.prompts,
        "group": a.group,
        "rollouts": a.rollouts,
        "rounds": a.repeats,
        "threads": a.threads,
        "configs": {},
    }
    for name, rs in runs.items():
        m = {
            key: statistics.median(r[key] for r in rs)
            for key in ("seconds_per_rollout", "rollouts_per_hour", "tokens_per_second")
        }
        m["all_seconds"] = [round(r["seconds_per_rollout"], 4) for r in rs]
        m["stages"] = {
            key: statistics.median(r["stages"].get(key, 0.0) for r in rs) for key in rs[0]["stages"]
        }
        m["phases"] = {key: statistics.median(r["phases"][key] for r in rs) for key in rs[0]["phases"]}
        m["peak_rss_mib"] = [statistics.median(r["peak_rss_mib"][i] for r in rs) for i in (0, 1)]
        result["configs"][name] = m
    t_sync = result["configs"]["sync"]["seconds_per_rollout"]
    for name, (k, g) in CONFIGS.items():
        if k == 0:
            continue
        m = result["configs"][name]
        p = m["phases"]
        predicted = predicted_async_seconds(p["U+A"], 0.0, p["W"], p["G"], g, k)
        m["predicted_seconds_per_rollout"] = predicted
        m["measured_gain"] = t_sync / m["seconds_per_rollout"]
        m["predicted_gain"] = t_sync / predicted
        m["measured_over_predicted"] = m["measured_gain"] / m["predicted_gain"]
    return result


def report(r: dict) -> str:
    """The markdown table of :func:`summarise`'s result."""
    lines = [
        f"### GRPO, {r['model']}, LoRA r16, {r['prompts']} prompts x {r['group']} responses x "
        f"{r['response_length']} tokens, {r['precision']}, 2 processes x {r['threads']} thread(s), rollouts "
        f"2..{r['rollouts']} of each run, median of {r['rounds']} alternating round(s)",
        "",
        "| config | s / rollout | rollouts / h | response tokens / s | G | U (+A) | W | trainer idle | "
        "generator idle | predicted s / rollout | measured gain | predicted gain | measured / predicted | "
        "peak RSS (MiB) | runs (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, m in r["configs"].items():
        p, s = m["phases"], m["stages"]
        u = p.get("U+A", p.get("U"))
        cells = [
            name,
            f"{m['seconds_per_rollout']:.3f}",
            f"{m['rollouts_per_hour']:.0f}",
            f"{m['tokens_per_second']:.1f}",
            f"{p['G']:.3f}",
            f"{u:.3f}",
            f"{p['W']:.4f}" if "W" in p else "",
            f"{s.get('async/trainer_idle_seconds', 0.0):.3f}" if "W" in p else "",
            f"{s.get('async/generator_idle_seconds', 0.0):.3f}" if "W" in p else "",
        ]
        if "predicted_gain" in m:
            cells += [
                f"{m['predicted_seconds_per_rollout']:.3f}",
                f"{m['measured_gain']:.2f}",
                f"{m['predicted_gain']:.2f}",
                f"{m['measured_over_predicted']:.2f}",
            ]
        else:
            cells += ["", "1", "1", ""]
        cells += [
            " / ".join(f"{x:.0f}" for x in m["peak_rss_mib"]),
            ", ".join(f"{x:.3f}" for x in m["all_seconds"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "G: sync, time/generate + time/forward of one process (its half); k1/k2, async/generation_seconds of "
        "the generator (the whole rollout). U (+A): sync, time/score + time/update; k1/k2, the trainer's seconds "
        "less its idle and send seconds. W: async/weight_transfer_seconds of the updates that sent weights.",
    ]
    return "\n".join(lines)


def main_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--smoke`` sets the tiny model, 2 rollouts, 1 round, 8 tokens, 2 x 2 responses)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", default="measure", choices=("measure", "worker"))
    p.add_argument("--model", default="smollm2", help="smollm2 (benchmarks/smollm2.py), tiny, or a folder")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--response-length", type=int, default=512)
    p.add_argument("--prompts", type=int, default=4, help="prompts per rollout")
    p.add_argument("--group", type=int, default=4, help="responses per prompt")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--rollouts", type=int, default=6, help="per run; the first is left out of the window")
    p.add_argument("--repeats", type=int, default=None, help="alternating rounds (default 3; --smoke 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", default=str(ROOT / ".bench" / "async_rollouts"), help="runs and cached results")
    p.add_argument("--json", default=None, help="write the result here too")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 rollouts, 1 round, 8 tokens")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--rss", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.model, a.rollouts, a.response_length, a.prompts, a.group = "tiny", 2, 8, 2, 2
    if a.repeats is None:
        a.repeats = 1 if a.smoke else 3
    return a


def main(argv: list[str] | None = None) -> int:
    a = main_args(argv)
    if a.mode == "worker":
        return worker(a.config, a.rss)
    result = measure(a)
    print(report(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
