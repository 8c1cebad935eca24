"""rlhfkit against TRL 1.12, side by side: PPO (tokens/s) and reward-model training (pairs/s).

TRL 1.12 is the last release with a PPO trainer (``trl.experimental.ppo.PPOTrainer``); it installs beside
transformers 5. It lives in its own virtual environment (``setup``), which sees this environment's torch and
transformers (``--system-site-packages``), so both systems run the same kernels.

Both systems train the same local models (a Llama policy, and a Llama sequence classifier as reward model and
critic initialisation, built by ``prepare``) on the same prompts, with the same work per rollout: B prompts,
exactly R response tokens each (forced: generation never stops early, in either system), 4 PPO epochs of one
optimizer step each over the whole batch, fp32, the same torch thread count, no gradient checkpointing (TRL
turns it on by default; ``BENCH_TRL_CHECKPOINTING=1`` measures that default). Each measurement is its own
process; the two systems alternate (A B A B ...), and the table gives the median over repeats.

Per rollout seconds come from inside the process: the time between the start of rollout 2 and the start of
rollout N (start-up, the first rollout and the final save are outside the window). The phases are timed by
wrapping the same functions in both systems: ``generate`` (generation), the outermost Llama forward under
``no_grad`` (no-grad forwards: reference, values, reward, old log-probs) or with grad (training forward),
``torch.autograd.backward`` (backward) and the optimizer step hooks (optimizer); "other" is the rest of the
window (losses, advantages, masks, logging, Python).

MFU = useful FLOPs / (window seconds x the fp32 peak of a 2048^3 matmul measured in the same process), with
the useful work of a rollout counted the same for both systems (N = non-embedding parameters; T = prompt +
response tokens): generation 2*N_policy*T per sequence, forward-only 2*N*T for the reference, critic and reward
model, training 6*N*T per epoch for the actor and the critic. (rlhfkit also recomputes the actor's log-probs
after sampling instead of taking them from generate; that work is not counted.)

    python benchmarks/ppo_vs_trl.py setup                      # once: TRL 1.12 in .bench/trl-1.12
    python benchmarks/ppo_vs_trl.py ppo --preset tiny --repeats 3
    python benchmarks/ppo_vs_trl.py reward --preset tiny --repeats 3
    python benchmarks/ppo_vs_trl.py scaling --repeats 1        # response length and prompts per rollout

Run it on an otherwise idle machine: every figure is a wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / ".bench" / "trl-1.12"
TRL_VERSION = "1.12.0"
PHASES = ("generation", "no-grad forwards", "training forward", "backward", "optimizer", "other")


# --------------------------------------------------------------------------------------------------------
# set-up and shared inputs


def setup(venv: Path, version: str = TRL_VERSION) -> Path:
    """Create the virtual environment of TRL ``version`` (idempotent); return its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    found = subprocess.run(
        [str(python), "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
    )
    if found.stdout.strip() != version:
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={version}"], check=True)
    return python


def prepare(work: Path, preset: str, num_pairs: int = 2048, seed: int = 0) -> dict:
    """Tokenizer, policy, reward model (also the critic's start), prompts and preference pairs in ``work``."""
    import torch
    from transformers import LlamaForSequenceClassification

    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import write_jsonl
    from rlhfkit.tasks.presets import build_causal_lm

    info_path = work / "inputs.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    work.mkdir(parents=True, exist_ok=True)
    task = get_task("reviews", seed=seed)
    tokenizer = task.build_tokenizer(work / "policy")
    config = task.model_config(preset, tokenizer)
    config.max_position_embeddings = (
        1024  # room for the scaling grid's 512-token responses (RoPE: no weights)
    )
    build_causal_lm(config, seed).save_pretrained(work / "policy")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        scalar = copy.deepcopy(config)
        scalar.num_labels = 1  # also resets id2label
        reward = LlamaForSequenceClassification(scalar)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(work / "reward")
    tokenizer.save_pretrained(work / "reward")
    prompts = task.prompts("train")
    write_jsonl(work / "prompts.jsonl", [{"prompt": p} for p in prompts])
    # preference pairs of the task's shape: a prompt and two reviews of two or three sentences each
    rng = random.Random(seed)
    records = task.sft_records(3 * num_pairs)
    by_prompt: dict[str, list[str]] = {}
    for r in records:
        by_prompt.setdefault(r["prompt"], []).append(r["completion"])
    sentences = [r["completion"] for r in records]

    def review() -> str:
        return "".join(rng.choice(sentences) for _ in range(rng.choice((2, 3))))

    pair_prompts = [rng.choice(prompts) for _ in range(num_pairs)]
    pairs = [{"prompt": p, "chosen": review(), "rejected": review()} for p in pair_prompts]
    write_jsonl(work / "pairs.jsonl", pairs)
    info = {
        "preset": preset,
        "policy_parameters": sum(p.numel() for p in build_causal_lm(config, seed).parameters()),
        "vocabulary": len(tokenizer),
        "prompts": len(prompts),
        "pairs": len(pairs),
    }
    info_path.write_text(json.dumps(info, indent=1))
    return info


# --------------------------------------------------------------------------------------------------------
# phase timing, the same wrappers in both systems


class PhaseTimer:
    """Wall seconds per phase, from wrappers around the functions both systems call."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES[:-1], 0.0)
        self.depth = 0  # nesting of wrapped model forwards (only the outermost one is timed)
        self.in_generate = False
        self.marks: list[tuple[float, dict[str, float]]] = []
        self.phase = "other"  # the phase running now (for the RSS sampler)

    def mark(self) -> None:
        self.marks.append((time.perf_counter(), dict(self.seconds)))

    def window(self, first: int, last: int) -> dict:
        """Per-interval means between marks ``first`` and ``last`` (0-based, ``last`` exclusive of its work)."""
        (t0, s0), (t1, s1) = self.marks[first], self.marks[last]
        n = last - first
        phases = {k: (s1[k] - s0[k]) / n for k in s0}
        wall = (t1 - t0) / n
        phases["other"] = wall - sum(phases.values())
        return {"seconds": wall, "phases": phases}

    @contextlib.contextmanager
    def timed(self, phase: str):
        start, outer = time.perf_counter(), self.phase
        self.phase = phase
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start
            self.phase = outer

    def install(self, mark_on: str) -> None:
        """Wrap generate, the Llama forwards, backward and the optimizer step; ``mark_on`` is "generate"
        (a PPO rollout starts with one generate call) or "step" (a reward-model step ends with one
        optimizer step). :meth:`uninstall` puts everything back."""
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from transformers.generation.utils import GenerationMixin
        from transformers.models.llama import modeling_llama as llama

        timer = self
        generate = GenerationMixin.generate
        self.undo = [lambda: setattr(GenerationMixin, "generate", generate)]
        GenerationMixin.generate = self.wrap_generate(generate, mark=mark_on == "generate")
        for cls in (llama.LlamaModel, llama.LlamaForCausalLM, llama.LlamaForSequenceClassification):
            own = cls.__dict__.get("forward")  # None: inherited (a generic sequence classifier)
            cls.forward = self.wrap_forward(cls.forward)
            self.undo.append(
                lambda cls=cls, own=own: setattr(cls, "forward", own) if own else delattr(cls, "forward")
            )

        backward = torch.autograd.backward
        self.undo.append(lambda: setattr(torch.autograd, "backward", backward))

        @functools.wraps(backward)
        def timed_backward(*args, **kwargs):
            with timer.timed("backward"):
                return backward(*args, **kwargs)

        torch.autograd.backward = timed_backward
        starts: list[float] = []

        def pre_step(optimizer, args, kwargs):
            starts.append(time.perf_counter())

        def post_step(optimizer, args, kwargs):
            timer.seconds["optimizer"] += time.perf_counter() - starts.pop()
            if mark_on == "step":
                timer.mark()

        self.undo.append(register_optimizer_step_pre_hook(pre_step).remove)
        self.undo.append(register_optimizer_step_post_hook(post_step).remove)

    def wrap_generate(self, generate, mark: bool):
        """``generate`` (Hugging Face's, or an engine's) timed as the generation phase; ``mark``: each call
        starts a rollout."""
        timer = self

        @functools.wraps(generate)
        def timed_generate(model, *args, **kwargs):
            if mark:
                timer.mark()
            timer.in_generate = True
            try:
                with timer.timed("generation"):
                    return generate(model, *args, **kwargs)
            finally:
                timer.in_generate = False

        return timed_generate

    def uninstall(self) -> None:
        for undo in reversed(getattr(self, "undo", [])):
            undo()
        self.undo = []

    def wrap_forward(self, forward):
        """``forward`` (a model's forward, or a read-out that runs outside it) timed as a no-grad or a training
        forward by the grad mode; not inside ``generate`` or inside another timed forward."""
        import torch

        timer = self

        @functools.wraps(forward)
        def timed_forward(module, *args, **kwargs):
            if timer.in_generate or timer.depth:
                return forward(module, *args, **kwargs)
            timer.depth += 1
            phase = "training forward" if torch.is_grad_enabled() else "no-grad forwards"
            try:
                with timer.timed(phase):
                    return forward(module, *args, **kwargs)
            finally:
                timer.depth -= 1

        return timed_forward


def matmul_peak(threads: int, precision: str = "fp32", size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large matmul in the run's precision (fp32, or bf16 as autocast computes its matmuls), best
    of ``repeats``, at the process's thread count."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def non_embedding_parameters(folder: Path) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    h, f, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * f + 2 * h
    return layers * per_layer + h


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------------------------------------
# workers: one measurement, one process; print one JSON line


def run_rlhfkit(kind: str, overrides: dict, out: Path) -> None:
    """``rlhfkit train KIND --config FILE`` in this process: the command a user runs (it sets the thread
    count and the allocator itself)."""
    import yaml

    from rlhfkit.cli import main

    config = out / f"{kind}.yaml"
    config.write_text(yaml.safe_dump(overrides))
    code = main(["train", kind, "--config", str(config)])
    if code:
        raise SystemExit(f"rlhfkit train {kind} exited with {code}")


def nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = str(value) if isinstance(value, Path) else value
    return out


@contextlib.contextmanager
def forced_length():
    """While open, rlhfkit's online runs sample exactly ``online.response_length`` tokens a response: the stop
    token is the pad token (EOS in these models), which the sampler never emits (suppressed), so no response
    ends early, with either generation backend."""
    import dataclasses

    from rlhfkit.trainers.online import loop

    build_context = loop.build_context

    def forced(*args, **kwargs):
        ctx = build_context(*args, **kwargs)
        pad = ctx.tokenizer.pad_token_id
        sampling = dataclasses.replace(ctx.sampling, suppress_ids=(pad,))
        return dataclasses.replace(ctx, stop_token_ids=[pad], sampling=sampling)

    loop.build_context = forced
    try:
        yield
    finally:
        loop.build_context = build_context


def worker_ppo_rlhfkit(a, out: Path) -> None:
    with forced_length():
        _train_ppo(a, out)


def _train_ppo(a, out: Path) -> None:
    work = Path(a.work)
    overrides = {
        "output_dir": out / "run",
        "seed": 0,
        "model.name_or_path": work / "policy",
        "data.train_file": work / "prompts.jsonl",
        "data.max_prompt_length": 64,
        "train.max_steps": a.rollouts,
        "train.batch_size": a.batch,
        "train.learning_rate": 1e-5,
        "train.save_steps": 10**6,
        "train.eval_steps": 10**6,
        "online.reward_model": work / "reward",
        "online.response_length": a.response_length,
        "online.missing_eos": "none",
        "online.kl_coef": 0.05,
        "online.ppo_epochs": 4,
        "online.num_minibatches": 1,
        "logging.samples_per_step": 0,
        "model.dtype": DTYPES[a.precision],
    }
    run_rlhfkit("ppo", nested(overrides), out)


# --precision: rlhfkit's model.dtype; TRL's bf16 flag (accelerate's bf16 mixed precision). In both, bf16 means
# float32 weights and optimizer state for the trained models with their forwards under bf16 autocast.
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def trl_common(a, out: Path) -> dict:
    """The TrainingArguments both TRL trainers get: no saving, logging or bars; CPU; bf16 mixed precision only
    with --precision bf16; no gradient checkpointing unless BENCH_TRL_CHECKPOINTING=1 (TRL's own default is
    on: it recomputes every forward)."""
    return dict(
        output_dir=str(out / "run"),
        save_strategy="no",
        report_to=[],
        logging_steps=10**6,
        use_cpu=True,
        bf16=a.precision == "bf16",
        seed=0,
        disable_tqdm=True,
        gradient_checkpointing=os.environ.get("BENCH_TRL_CHECKPOINTING") == "1",
    )


def worker_ppo_trl(a, out: Path) -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if a.precision == "bf16":
        # TRL 1.12's PPOTrainer builds its own Accelerator without a mixed-precision argument, and under
        # transformers 5 the bf16 flag no longer reaches it: without this (what `accelerate launch
        # --mixed_precision bf16` sets) its PPO would run in float32.
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    work = Path(a.work)
    tokenizer = AutoTokenizer.from_pretrained(work / "policy", padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(work / "policy")
    reference = AutoModelForCausalLM.from_pretrained(work / "policy")
    value = AutoModelForSequenceClassification.from_pretrained(work / "reward", num_labels=1)
    reward = AutoModelForSequenceClassification.from_pretrained(work / "reward", num_labels=1)
    policy.generation_config.eos_token_id = None  # forced length: generation never stops early
    prompts = [json.loads(line)["prompt"] for line in open(work / "prompts.jsonl")]
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in prompts]})
    args = PPOConfig(
        **trl_common(a, out),
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=4,
        local_rollout_forward_batch_size=a.batch,
        total_episodes=a.batch * a.rollouts,
        response_length=a.response_length,
        stop_token=None,
        missing_eos_penalty=None,
        kl_coef=0.05,
        learning_rate=1e-5,
        num_sample_generations=0,
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=reference,
        reward_model=reward,
        value_model=value,
        train_dataset=dataset,
    )
    trainer.train()


def worker_reward_rlhfkit(a, out: Path) -> None:
    work = Path(a.work)
    overrides = {
        "output_dir": out / "run",
        "seed": 0,
        "model.name_or_path": work / "reward",
        "data.train_file": work / "pairs.jsonl",
        "data.max_prompt_length": 64,
        "data.max_length": a.max_length,
        "train.max_steps": a.steps,
        "train.batch_size": a.batch,
        "train.learning_rate": 1e-4,
        "train.save_steps": 10**6,
        "train.eval_steps": 10**6,
        "train.log_steps": 10**6,
        "model.dtype": DTYPES[a.precision],
    }
    run_rlhfkit("reward", nested(overrides), out)


def worker_reward_trl(a, out: Path) -> None:
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    work = Path(a.work)
    tokenizer = AutoTokenizer.from_pretrained(work / "reward")
    model = AutoModelForSequenceClassification.from_pretrained(work / "reward", num_labels=1)
    rows = [json.loads(line) for line in open(work / "pairs.jsonl")]
    dataset = Dataset.from_dict(
        {
            "chosen": [r["prompt"] + r["chosen"] for r in rows],
            "rejected": [r["prompt"] + r["rejected"] for r in rows],
        }
    )
    args = RewardConfig(
        **trl_common(a, out),
        per_device_train_batch_size=a.batch,
        max_steps=a.steps,
        max_length=a.max_length,
        learning_rate=1e-4,
        dataloader_num_workers=0,
    )
    RewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train()


WORKERS = {
    ("ppo", "rlhfkit"): worker_ppo_rlhfkit,
    ("ppo", "trl"): worker_ppo_trl,
    ("reward", "rlhfkit"): worker_reward_rlhfkit,
    ("reward", "trl"): worker_reward_trl,
}


def run_worker(a) -> None:
    import torch

    torch.set_num_threads(a.threads)  # rlhfkit sets it again from RLHFKIT_NUM_THREADS, to the same value
    timer = PhaseTimer()
    timer.install("generate" if a.kind == "ppo" else "step")
    try:
        result = _measure(a, timer)
    finally:
        timer.uninstall()
    print("RESULT " + json.dumps(result), flush=True)


class RSSSampler:
    """``BENCH_RSS=1``: a thread reads the resident set every 5 ms and keeps each phase's largest value, to
    show in which phase the peak falls."""

    def __init__(self, timer: PhaseTimer) -> None:
        import threading

        self.timer, self.peaks, self.stop = timer, {}, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.page = os.sysconf("SC_PAGE_SIZE")

    def run(self) -> None:
        while not self.stop.wait(0.005):
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * self.page / 2**20
            phase = self.timer.phase
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), rss)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _measure(a, timer: PhaseTimer) -> dict:

    if os.environ.get("BENCH_RSS"):
        with RSSSampler(timer) as sampler:
            result = _measure_once(a, timer)
        result["rss_peak_by_phase_mib"] = {k: round(v) for k, v in sampler.peaks.items()}
        return result
    return _measure_once(a, timer)


def _measure_once(a, timer: PhaseTimer) -> dict:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        if os.environ.get("BENCH_PROFILE"):  # the operators, for finding where the time goes
            from torch.profiler import profile

            with profile() as prof:
                WORKERS[a.kind, a.system](a, Path(tmp))
            print(
                prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=int(os.environ["BENCH_PROFILE"])
                )
            )
        else:
            WORKERS[a.kind, a.system](a, Path(tmp))
        total = time.perf_counter() - start
    if a.kind == "ppo":
        result = timer.window(1, len(timer.marks) - 1)  # rollout 2 .. the start of the last one
    else:
        result = timer.window(a.warmup_steps, len(timer.marks) - 1)
    result.update(
        system=a.system,
        kind=a.kind,
        marks=len(timer.marks),
        total_seconds=total,
        peak_rss_mib=peak_rss_mib(),
        threads=torch.get_num_threads(),
        matmul_flops=matmul_peak(a.threads, a.precision),
    )
    return result


# --------------------------------------------------------------------------------------------------------
# the comparison: alternate the systems, median over repeats


def measure(system: str, kind: str, a, work: Path, **sizes) -> dict:
    """One run of one system in its own process. ``system`` is "trl", "rlhfkit", or "rlhfkit-before" (the
    checkout given with --before)."""
    python = a.python_trl if system == "trl" else sys.executable
    worker_system = "trl" if system == "trl" else "rlhfkit"
    args = [python, str(Path(__file__).resolve()), "worker", "--system", worker_system, "--kind", kind]
    args += ["--work", str(work), "--threads", str(a.threads), "--precision", a.precision]
    for k, v in sizes.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "RLHFKIT_NUM_THREADS": str(a.threads)}
    env["PYTHONPATH"] = str((Path(a.before) if system == "rlhfkit-before" else ROOT) / "src")
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(
            f"{system} {kind} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def useful_flops_ppo(
    work: Path, batch: int, response_length: int, prompt_tokens: float, epochs: int = 4
) -> float:
    n_policy = non_embedding_parameters(work / "policy")
    n_scalar = non_embedding_parameters(work / "reward")
    tokens = batch * (prompt_tokens + response_length)
    generation = 2 * n_policy * tokens
    forward_only = 2 * (n_policy + n_scalar + n_scalar) * tokens  # reference, critic values, reward
    training = 6 * (n_policy + n_scalar) * tokens * epochs
    return generation + forward_only + training


def mean_tokens(work: Path, folder: str, texts: list[str]) -> float:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / folder)
    return statistics.mean(len(tokenizer(t)["input_ids"]) for t in texts)


def systems(a) -> list[str]:
    return ["rlhfkit", "trl"] + (["rlhfkit-before"] if a.before else [])


def alternate(kind: str, a, work: Path, **sizes) -> dict[str, list[dict]]:
    """``a.repeats`` rounds; each round runs every system once, the order rotating between rounds."""
    names = systems(a)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(a.repeats):
        for system in names[i % len(names) :] + names[: i % len(names)]:
            r = measure(system, kind, a, work, **sizes)
            runs[system].append(r)
            print(
                f"  {kind} {system:15s} round {i + 1}: {r['seconds']:.3f} s, peak RSS {r['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    return runs


def median_run(runs: list[dict]) -> dict:
    """Medians of the per-run figures (each phase on its own)."""
    out = {"seconds": statistics.median(r["seconds"] for r in runs)}
    out["phases"] = {p: statistics.median(r["phases"][p] for r in runs) for p in PHASES}
    out["peak_rss_mib"] = statistics.median(r["peak_rss_mib"] for r in runs)
    out["matmul_flops"] = statistics.median(r["matmul_flops"] for r in runs)
    out["all_seconds"] = [round(r["seconds"], 4) for r in runs]
    return out


def phase_table(rows: dict[str, dict]) -> str:
    lines = ["| phase | " + " | ".join(rows) + " |", "|---|" + "---:|" * len(rows)]
    for p in PHASES:
        cells = [
            f"{r['phases'][p]:.3f} s ({100 * r['phases'][p] / r['seconds']:.0f}%)" for r in rows.values()
        ]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines.append(
        "| **total (median)** | " + " | ".join(f"**{r['seconds']:.3f} s**" for r in rows.values()) + " |"
    )
    return "\n".join(lines)


def compare_ppo(a, batch: int, response_length: int) -> dict:
    work = Path(a.work) / a.preset
    info = prepare(work, a.preset)
    print(
        f"PPO, preset {a.preset} ({info['policy_parameters']:,} parameters), {batch} prompts x "
        f"{response_length} tokens, 4 epochs, {a.threads} threads, {a.precision}, {a.repeats} rounds",
        flush=True,
    )
    runs = alternate("ppo", a, work, rollouts=a.rollouts, batch=batch, response_length=response_length)
    prompts = [json.loads(line)["prompt"] for line in open(work / "prompts.jsonl")]
    flops = useful_flops_ppo(work, batch, response_length, mean_tokens(work, "policy", prompts))
    result = {"kind": "ppo", "preset": a.preset, "batch": batch, "response_length": response_length}
    result.update(threads=a.threads, parameters=info["policy_parameters"], rounds=a.repeats)
    result["precision"] = a.precision
    peak = statistics.median(r["matmul_flops"] for rs in runs.values() for r in rs)
    result.update(useful_flops=flops, peak_flops=peak)
    for system, rs in runs.items():
        m = median_run(rs)
        m["tokens_per_second"] = batch * response_length / m["seconds"]
        m["mfu"] = flops / (m["seconds"] * peak)
        result[system] = m
    result["speedup"] = result["trl"]["seconds"] / result["rlhfkit"]["seconds"]
    return result


def compare_reward(a) -> dict:
    work = Path(a.work) / a.preset
    info = prepare(work, a.preset)
    print(
        f"Reward model, preset {a.preset} ({info['policy_parameters']:,} parameters), batch {a.batch_rm} pairs, "
        f"max length {a.max_length}, {a.threads} threads, {a.precision}, {a.repeats} rounds",
        flush=True,
    )
    runs = alternate("reward", a, work, steps=a.steps, batch=a.batch_rm, max_length=a.max_length)
    rows = [json.loads(line) for line in open(work / "pairs.jsonl")]
    texts = [r["prompt"] + r[side] for r in rows for side in ("chosen", "rejected")]
    tokens_per_pair = 2 * mean_tokens(work, "reward", texts)
    n = non_embedding_parameters(work / "reward")
    result = {"kind": "reward", "preset": a.preset, "batch": a.batch_rm, "threads": a.threads}
    result.update(parameters=info["policy_parameters"], rounds=a.repeats, precision=a.precision)
    flops = 6 * n * tokens_per_pair * a.batch_rm
    peak = statistics.median(r["matmul_flops"] for rs in runs.values() for r in rs)
    result.update(useful_flops=flops, peak_flops=peak)
    for system, rs in runs.items():
        m = median_run(rs)
        m["pairs_per_second"] = a.batch_rm / m["seconds"]
        m["mfu"] = flops / (m["seconds"] * peak)
        result[system] = m
    result["speedup"] = result["trl"]["seconds"] / result["rlhfkit"]["seconds"]
    return result


def label(system: str) -> str:
    return {"trl": "TRL 1.12", "rlhfkit": "rlhfkit", "rlhfkit-before": "rlhfkit (before)"}[system]


def report(r: dict) -> str:
    names = [n for n in ("rlhfkit", "rlhfkit-before", "trl") if n in r]
    unit = "tokens_per_second" if r["kind"] == "ppo" else "pairs_per_second"
    what = (
        f"PPO, {r['preset']} preset, {r['batch']} prompts x {r['response_length']} tokens"
        if r["kind"] == "ppo"
        else f"reward model, {r['preset']} preset, {r['batch']} pairs a step"
    )
    precision = r.get("precision", "fp32")
    lines = [
        f"### {what} ({r['threads']} threads, {precision}, median of {r['rounds']} alternating rounds)",
        "",
    ]
    lines.append(
        "| system | s / "
        + ("rollout" if r["kind"] == "ppo" else "step")
        + f" | {unit.replace('_', ' ')} | MFU | peak RSS | runs (s) |"
    )
    lines.append("|---|---:|---:|---:|---:|---|")
    for n in names:
        m = r[n]
        lines.append(
            f"| {label(n)} | {m['seconds']:.3f} | {m[unit]:.0f} | {100 * m['mfu']:.1f}% | {m['peak_rss_mib']:.0f} MiB "
            f"| {', '.join(f'{x:.3f}' for x in m['all_seconds'])} |"
        )
    lines += [
        "",
        f"rlhfkit / TRL: **{r['speedup']:.2f}x**",
        "",
        phase_table({label(n): r[n] for n in names}),
        "",
    ]
    return "\n".join(lines)


def scaling(a) -> list[dict]:
    results = []
    for batch, length in [(32, 48), (32, 128), (32, 256), (32, 512), (64, 48), (128, 48), (256, 48)]:
        r = compare_ppo(a, batch, length)
        print(report(r), flush=True)
        results.append(r)
    return results


def plot_scaling(results: list[dict], path: Path) -> None:
    """Top: seconds per rollout of both systems against response length and against prompts per rollout
    (log-log). Bottom: where each system's time goes at each size (shares of the rollout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), gridspec_kw={"height_ratios": [1.2, 1]})
    colors = dict(
        zip(PHASES, ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"], strict=True)
    )
    for col, (fixed, x_key, x_label) in enumerate(
        (
            (("batch", 32), "response_length", "response tokens (32 prompts)"),
            (("response_length", 48), "batch", "prompts per rollout (48 response tokens)"),
        )
    ):
        rows = sorted((r for r in results if r[fixed[0]] == fixed[1]), key=lambda r: r[x_key])
        xs = [r[x_key] for r in rows]
        top, bottom = axes[0, col], axes[1, col]
        for system, style in (("rlhfkit", "o-"), ("trl", "s--")):
            top.plot(xs, [r[system]["seconds"] for r in rows], style, label=label(system))
        for x, r in zip(xs, rows, strict=True):
            top.annotate(
                f"{r['speedup']:.2f}x",
                (x, r["rlhfkit"]["seconds"]),
                textcoords="offset points",
                xytext=(0, -14),
                ha="center",
                fontsize=8,
            )
        top.set_xscale("log", base=2)
        top.set_yscale("log")
        top.set_xticks(xs, [str(x) for x in xs])
        top.set_ylabel("seconds per rollout")
        top.grid(alpha=0.3)
        top.legend(fontsize=8)
        positions = range(len(rows))
        for offset, system in ((-0.2, "rlhfkit"), (0.2, "trl")):
            base = [0.0] * len(rows)
            for phase in PHASES:
                share = [100 * r[system]["phases"][phase] / r[system]["seconds"] for r in rows]
                bottom.bar(
                    [i + offset for i in positions],
                    share,
                    width=0.38,
                    bottom=base,
                    color=colors[phase],
                    label=phase if system == "rlhfkit" else None,
                    edgecolor="white",
                    linewidth=0.5,
                )
                base = [b + s for b, s in zip(base, share, strict=True)]
        bottom.set_xticks(list(positions), [f"{x}\nrlhfkit | TRL" for x in xs], fontsize=8)
        bottom.set_ylabel("share of the rollout (%)")
        bottom.set_xlabel(x_label)
    axes[1, 0].legend(fontsize=7, ncol=3, loc="upper left")
    rounds = results[0]["rounds"]
    fig.suptitle(
        f"PPO, tiny preset: rlhfkit and TRL 1.12 side by side, {results[0]['threads']} threads "
        f"({'median of ' + str(rounds) if rounds > 1 else 'one round'} per point)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["setup", "ppo", "reward", "scaling", "plot", "worker"])
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--work", default=str(ROOT / ".bench" / "inputs"))
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--precision",
        choices=list(DTYPES),
        default="fp32",
        help="fp32, or bf16 mixed precision in both systems (float32 weights, bf16 autocast)",
    )
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds; the table gives the medians")
    p.add_argument("--rollouts", type=int, default=6, help="rollouts per run; the window is rollouts 2..N-1")
    p.add_argument("--batch", type=int, default=32, help="prompts per rollout")
    p.add_argument("--response-length", type=int, default=48)
    p.add_argument("--batch-rm", type=int, default=32, help="pairs per reward-model step")
    p.add_argument("--steps", type=int, default=24, help="reward-model steps per run")
    p.add_argument("--warmup-steps", type=int, default=4, help="reward-model steps before the window")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--before", help="also measure the rlhfkit checkout in this folder (e.g. a git worktree)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "figures" / "ppo_vs_trl_scaling.png")
    # worker-only
    p.add_argument("--system", choices=["rlhfkit", "trl"])
    p.add_argument("--kind", choices=["ppo", "reward"])
    a = p.parse_args()
    if a.command == "worker":
        run_worker(a)
        return
    if a.command == "setup":
        print(setup(a.venv))
        return
    if a.command == "plot":  # redraw the scaling plot from a --json of the scaling command
        plot_scaling(json.loads(a.json.read_text()), a.plot)
        print(f"wrote {a.plot}")
        return
    a.python_trl = str(setup(a.venv))
    if a.command == "ppo":
        results = [compare_ppo(a, a.batch, a.response_length)]
    elif a.command == "reward":
        a.batch = a.batch_rm
        results = [compare_reward(a)]
    else:
        results = scaling(a)
        plot_scaling(results, a.plot)
        print(f"wrote {a.plot}")
    if a.command != "scaling":
        print(report(results[0]))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
