"""A prepared GPU check: the CUDA paths of rlhfkit in one command, figures in one JSON file.

On one CUDA device (an H100 or H200 takes a few minutes; nothing is downloaded) it builds a Llama model of
Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads and 2 key-value heads, vocabulary 151,936, tied
embeddings: 494M parameters; random weights) with a word-level tokenizer of the same vocabulary (a Llama
folder: transformers loads a qwen2 folder's tokenizer as Qwen2's BPE whatever the folder holds), a reward
model of the same backbone with a scalar head, prompts and preference pairs of random words, and runs these
parts, each in its own process:

- ``cuda_tests``: the suite's tests marked ``cuda`` (``pytest -m cuda`` on the files that carry the marker),
  with their pass / fail / skip counts;
- ``ppo``, ``grpo``, ``dpo``: ``rlhfkit train KIND`` (the command's own function, :func:`rlhfkit.cli.main`)
  in bfloat16 (``model.dtype=bfloat16``) for a few steps: tokens per second, seconds per step (the first step,
  warm-up, left out), the process's peak ``torch.cuda.max_memory_allocated`` and the MFU;
- ``fsdp_nccl``: PPO under ``torchrun --nproc_per_node 1`` with ``train.sharding=full_shard`` (FSDP2; the
  process group's backend, NCCL on a GPU, is read from the run's own start-up line);
- ``lora``: PPO with ``model.lora_rank=16``;
- ``async``: rollouts that overlap training: GRPO with LoRA r16 under ``torchrun --nproc_per_node 2`` on the one
  device, process 0 training and process 1 sampling (``online.max_staleness=1 online.generation_processes=1``;
  the backend, NCCL on a GPU, read from the run's start-up line), with the largest staleness and the drops
  over the run and, over the timed steps (medians), each side's idle seconds, the generator's seconds sampling
  a rollout and the trainer's seconds sending an update's weights (over the updates that send any);
- ``distill``: on-policy distillation (``rlhfkit train distill``) of a LoRA r16 student from a bf16 teacher (the
  policy's own folder: the path's cost, not its learning) with ``distill.loss=full_reverse_kl``, the two heads
  read a chunk of positions at a time (:mod:`rlhfkit.models.distill_readout`);
- ``vllm``: GRPO with ``online.generation_backend=vllm``, where vLLM is installed;
- ``sampler``: rlhfkit's exact draw (``online.sampler=exact``, :mod:`rlhfkit.algos.draw`) on the device, in
  this process: its total variation from the probabilities (from its own float64 interval boundaries, against
  sums exact in float64) at 151,936 entries, masked tokens drawn over ~10^6 draws (must be 0), the tokens it
  draws on the device against the CPU's for the same probabilities and uniforms, and its milliseconds per
  step beside ``torch.multinomial``'s at (32, 49,152) and (32, 151,936) float32 probabilities (on a CPU: one
  thread).

Every part is timed and guarded: a part that fails is recorded with its error line (and the end of its
stderr) and the check goes on; the JSON is rewritten after every part, and once ``--budget-s`` seconds have
passed the remaining parts are skipped with that reason.

MFU = the step's model FLOPs / (seconds per step x the card's dense bf16 peak, from a table of known cards
by device name; an unknown card gives null and its name). Model FLOPs count every matrix product with a
weight (the output head included, tied or not; attention scores left out: under 1 % at these lengths), with
T = prompt + mean response tokens per sequence and N the policy's (N_s the reward model's and critic's)
matrix-product parameters: an online rollout counts generation 2*N*T, the reference 2*N*T, the reward model
and the critic's values 2*N_s*T, and per PPO epoch the actor's and the critic's training 6*N*T (4*N*T under
LoRA: no weight gradients for the frozen base); the actor's recomputed old log-probs are not counted, as in
benchmarks/ppo_vs_trl.py. A DPO step counts 6*N*T for the policy and 2*N*T for the reference.

``--smoke`` runs the same parts on the CPU with a tiny Llama and a couple of steps (the FSDP2 and async parts
over gloo, started at once beside the others, which run one after another in this process; the cuda tests
skip without a device), in about a minute; tests/examples/test_gpu_check.py runs it, so the check cannot rot.

    python benchmarks/gpu_check.py                         # on a GPU machine: gpu_check.json
    python benchmarks/gpu_check.py --out /tmp/check.json --budget-s 420 --parts ppo,dpo
    python benchmarks/gpu_check.py --smoke --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("cuda_tests", "ppo", "grpo", "dpo", "fsdp_nccl", "lora", "async", "distill", "vllm", "sampler")

# Dense bfloat16 peaks (TFLOPS, without sparsity) from NVIDIA's data sheets, matched against
# torch.cuda.get_device_name() in this order (an SXM H100 reports "NVIDIA H100 80GB HBM3").
BF16_PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 80GB HBM3", 989.0),
    ("H100 SXM", 989.0),
    ("A100", 312.0),
)

# Qwen2.5-0.5B's shape (its config.json; no q/k/v biases), random weights; the smoke model is a tiny one.
MODEL_SHAPES = {
    "full": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "smoke": dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    ),
}

# Work per part: prompt and response tokens, prompts (online) or pairs (dpo) per step, steps.
SIZES = {
    "full": dict(
        prompt=64, response=128, batch=32, group=4, micro=8, steps=3, fsdp_steps=2, async_steps=4, pairs=16
    ),
    "smoke": dict(
        prompt=6, response=4, batch=2, group=2, micro=2, steps=2, fsdp_steps=2, async_steps=3, pairs=2
    ),
}

# A part is not started with less of the budget left than this (a 0.5B part takes about a minute on a GPU).
MIN_PART_SECONDS = {"full": 60.0, "smoke": 5.0}

SPECIALS = ["<unk>", "<pad>", "<bos>", "<eos>"]
REWARDS_PY = '''
def length(prompts, completions, **kwargs):
    """The number of words of each response (any objective will do: the check times the machinery)."""
    return [float(len(c.split())) for c in completions]
'''


# --------------------------------------------------------------------------------------------------------
# inputs: tokenizer, models, data


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``vocab_size`` ids (4 special tokens, then words ``w4`` ...), BOS in front."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def matmul_parameters(model) -> int:
    """Weights that take part in a matrix product per token: every Linear (a tied output head included)."""
    import torch

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def build_inputs(work: Path, mode: str) -> dict:
    """The policy and reward-model folders, prompts, preference pairs and a reward function under ``work``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from rlhfkit.models import load_tokenizer

    shape = MODEL_SHAPES[mode]
    sizes = SIZES[mode]
    tokenizer = word_tokenizer(shape["vocab_size"])
    ids = dict(bos_token_id=2, eos_token_id=3, pad_token_id=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {}
    for name, cls, extra in (
        ("policy", LlamaForCausalLM, {}),
        ("reward", LlamaForSequenceClassification, {"num_labels": 1}),
    ):
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it will run: seconds, not minutes, for 0.5B on a GPU
            model = cls(LlamaConfig(**shape, **ids, **extra))
        model.save_pretrained(work / name)
        tokenizer.save_pretrained(work / name)
        info[name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "matmul_parameters": matmul_parameters(model),
        }
        del model
    if device == "cuda":  # the parts' processes get the whole device
        torch.cuda.empty_cache()
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(len(SPECIALS), shape['vocab_size'])}" for _ in range(n))

    prompt_words = sizes["prompt"] - 1  # + BOS
    with open(work / "prompts.jsonl", "w") as f:
        for _ in range(max(64, sizes["batch"])):
            f.write(json.dumps({"prompt": words(prompt_words)}) + "\n")
    with open(work / "pairs.jsonl", "w") as f:
        for _ in range(max(64, sizes["pairs"])):
            pair = {"prompt": words(prompt_words)}
            # plain-text pairs are joined as prompt + completion: the space keeps the words apart
            pair.update(chosen=" " + words(sizes["response"]), rejected=" " + words(sizes["response"]))
            f.write(json.dumps(pair) + "\n")
    (work / "rewards.py").write_text(REWARDS_PY)
    (work / "config.yaml").write_text("seed: 0\n")
    # the tokenizer as the trainers load it must see the words (a model type's own tokenizer class would not)
    loaded = load_tokenizer(str(work / "policy"))
    if len(loaded("w4 w5", add_special_tokens=False)["input_ids"]) != 2:
        raise RuntimeError(
            f"the saved tokenizer loads as {type(loaded).__name__}, which does not read its words"
        )
    info["architecture"] = "Llama"
    info["shape"] = shape
    return info


# --------------------------------------------------------------------------------------------------------
# the parts


def device_info() -> dict:
    """The device, its bf16 peak (null when the card is not in the table) and the software."""
    import torch

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()})"
    peak = peak_tflops(name) if cuda else None
    info = {
        "name": name,
        "cuda": cuda,
        "bf16_peak_tflops": peak,
        "torch": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python": platform.python_version(),
    }
    if cuda:
        info["memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    if peak is None:
        info["bf16_peak_note"] = f"no known dense bf16 peak for {name!r}: MFU is null"
    return info


def commit() -> str | None:
    """The checkout's commit (None outside a git checkout)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def peak_tflops(name: str) -> float | None:
    """The dense bf16 peak of the card ``name`` (torch.cuda.get_device_name), or None if unknown."""
    for pattern, tflops in BF16_PEAK_TFLOPS:
        if pattern in name:
            return tflops
    return None


def online_overrides(mode: str, paths: dict, kind: str) -> list[str]:
    """dotted.key=value settings of a PPO (``ppo``), GRPO (``grpo``), distillation (``distill``) or DPO (``dpo``)
    run on the inputs."""
    s = SIZES[mode]
    common = [
        f"model.name_or_path={paths['policy']}",
        "model.dtype=bfloat16",
        "model.save_dtype=bfloat16",
        f"train.max_steps={s['steps']}",
        "train.save_steps=1000",
        "train.lr_schedule=constant",
        "train.learning_rate=1e-6",
        f"train.micro_batch_size={s['micro']}",
        "logging.progress_bar=false",
        f"data.max_prompt_length={s['prompt']}",
    ]
    if kind == "dpo":
        return [
            *common,
            f"data.train_file={paths['pairs']}",
            f"train.batch_size={s['pairs']}",
            f"data.max_length={s['prompt'] + s['response'] + 1}",
        ]
    common += [f"data.train_file={paths['prompts']}", f"online.response_length={s['response']}"]
    if kind == "distill":  # a LoRA student of a bf16 teacher (the policy's folder), the full-vocabulary loss
        return [
            *common,
            f"online.teacher_model={paths['policy']}",
            "distill.loss=full_reverse_kl",
            f"train.batch_size={s['batch']}",
            "model.lora_rank=16",
            "model.lora_alpha=32",
        ]
    if kind == "grpo":
        return [
            *common,
            f"online.reward_functions=[{paths['rewards']}:length]",
            f"train.batch_size={s['batch'] // s['group'] if mode == 'full' else s['batch']}",
            f"online.group_size={s['group']}",
            "online.ppo_epochs=1",
        ]
    return [
        *common,
        f"online.reward_model={paths['reward']}",
        f"train.batch_size={s['batch']}",
        "online.ppo_epochs=2",
        "online.num_minibatches=2" if mode == "full" else "online.num_minibatches=1",
    ]


def part_runs(mode: str, paths: dict) -> dict[str, tuple[str, list[str], int]]:
    """Each training part: (command kind, overrides, processes under torchrun (0 = plain python))."""
    s = SIZES[mode]
    return {
        "ppo": ("ppo", online_overrides(mode, paths, "ppo"), 0),
        "grpo": ("grpo", online_overrides(mode, paths, "grpo"), 0),
        "dpo": ("dpo", online_overrides(mode, paths, "dpo"), 0),
        "fsdp_nccl": (
            "ppo",
            [
                *online_overrides(mode, paths, "ppo"),
                "train.sharding=full_shard",
                f"train.max_steps={s['fsdp_steps']}",
            ],
            1,
        ),
        "lora": (
            "ppo",
            [*online_overrides(mode, paths, "ppo"), "model.lora_rank=16", "model.lora_alpha=32"],
            0,
        ),
        "async": (
            "grpo",
            [
                *online_overrides(mode, paths, "grpo"),
                "online.max_staleness=1",
                "online.generation_processes=1",
                "model.lora_rank=16",
                "model.lora_alpha=32",
                f"train.max_steps={s['async_steps']}",
            ],
            2,
        ),
        "distill": ("distill", online_overrides(mode, paths, "distill"), 0),
        "vllm": ("grpo", [*online_overrides(mode, paths, "grpo"), "online.generation_backend=vllm"], 0),
    }


def child(args) -> int:
    """One training part's process: ``rlhfkit train KIND`` through its command function, then this process's
    peak memory, written to ``--result`` (by the first process)."""
    import resource

    import torch

    from rlhfkit import cli

    code = cli.main(["train", args.child, "--config", args.config, *json.loads(args.overrides)])
    result = {"exit_code": code}
    if torch.cuda.is_available():
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        result["peak_memory_kind"] = "torch.cuda.max_memory_allocated"
    else:
        result["peak_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result["peak_memory_kind"] = "peak resident set (CPU)"
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps(result))
    return code


def error_line(stderr: str, code: int) -> str:
    """The line that says why a process failed: rlhfkit's own one-line error, else the traceback's last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("rlhfkit: error:") or line.startswith("rlhfkit: stopped:"):
            return line
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line):
            return line
    return lines[-1] if lines else f"exit code {code} and nothing on stderr"


def run_line(output_dir: Path) -> dict | None:
    """How the run was launched, as its config.yaml's run line says (processes, launcher, backend, device)."""
    path = output_dir / "config.yaml"
    lines = path.read_text().splitlines() if path.is_file() else []
    run = [line[len("# run: ") :] for line in lines if line.startswith("# run: ")]
    return json.loads(run[0]) if run else None


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )


def step_flops(part: str, mode: str, model: dict, response_mean: float) -> float:
    """Model FLOPs of one step of ``part`` (module docstring)."""
    s = SIZES[mode]
    n, n_s = model["policy"]["matmul_parameters"], model["reward"]["matmul_parameters"]
    if part == "dpo":
        tokens = s["pairs"] * 2 * (s["prompt"] + s["response"] + 1)
        return 6 * n * tokens + 2 * n * tokens
    kind, overrides = part_runs(mode, {k: "" for k in ("policy", "reward", "prompts", "rewards", "pairs")})[
        part
    ][:2]
    settings = dict(o.split("=", 1) for o in overrides)
    sequences = int(settings["train.batch_size"]) * int(settings.get("online.group_size", "1"))
    tokens = sequences * (s["prompt"] + response_mean)
    epochs = int(settings.get("online.ppo_epochs", "1"))
    train_factor = 4 if "model.lora_rank" in settings else 6
    flops = 2 * n * tokens + 2 * n * tokens  # generation, reference
    if kind == "ppo":  # reward model, critic values; the critic's training
        flops += 2 * 2 * n_s * tokens + train_factor * n_s * tokens * epochs
    if (
        kind == "distill"
    ):  # the teacher's log-probs; the full-vocabulary loss: the teacher and the student again
        flops += 2 * n * tokens + (2 + train_factor) * n * tokens * epochs
    return flops + train_factor * n * tokens * epochs


def training_figures(part: str, mode: str, model: dict, metrics: list[dict], peak: float | None) -> dict:
    """Seconds per step, tokens per second and MFU from the run's metrics.jsonl, steps after the first."""
    steps = [m for m in metrics if "time/step_seconds" in m]
    timed = steps[1:] or steps  # the first step compiles kernels and warms the allocator
    if not timed:
        return {"steps_logged": 0}
    seconds = statistics.median(m["time/step_seconds"] for m in timed)
    s = SIZES[mode]
    if part == "dpo":
        response_mean = float(s["response"])
        tokens = s["pairs"] * 2 * (s["prompt"] + s["response"] + 1)
        tokens_per_second, unit = tokens / seconds, "prompt + chosen + rejected tokens / s"
    else:
        response_mean = statistics.mean(m["response_length/mean"] for m in timed)
        tokens_per_second = statistics.median(m["tokens_per_second"] for m in timed)
        unit = "response tokens / s (the trainer's tokens_per_second)"
    flops = step_flops(part, mode, model, response_mean)
    return {
        "steps_logged": len(steps),
        "steps_timed": len(timed),
        "seconds_per_step": seconds,
        "tokens_per_second": tokens_per_second,
        "tokens_per_second_unit": unit,
        "response_length_mean": response_mean,
        "model_flops_per_step": flops,
        "mfu": None if peak is None else flops / (seconds * peak * 1e12),
    }


def async_figures(metrics: list[dict]) -> dict:
    """The overlap's own figures from the trainer's metrics.jsonl: the largest staleness and the drops over the
    run; each side's idle seconds and the generator's seconds per rollout, medians over the steps after the
    first; the trainer's seconds sending an update's weights, median over the updates that sent any (the last
    k send nothing)."""
    steps = [m for m in metrics if "async/staleness_max" in m]
    if not steps:
        return {"async_error": "no async/ metrics in metrics.jsonl"}
    timed = steps[1:] or steps
    sent = [m["async/weight_transfer_seconds"] for m in steps if m["async/weight_transfer_seconds"] > 0]

    def median(name: str) -> float:
        return statistics.median(m[name] for m in timed)

    return {
        "staleness_max": max(m["async/staleness_max"] for m in steps),
        "dropped": sum(m["async/dropped"] for m in steps),
        "trainer_idle_seconds": median("async/trainer_idle_seconds"),
        "generator_idle_seconds": median("async/generator_idle_seconds"),
        "generation_seconds": median("async/generation_seconds"),
        "weight_transfer_seconds": statistics.median(sent) if sent else None,
        "weight_transfers": len(sent),
    }


def run_training(part: str, mode: str, work: Path, paths: dict, model: dict, peak, timeout: float) -> dict:
    """One training part in its own process (under --smoke, torchrun's part only; the others in this one)."""
    kind, overrides, nproc = part_runs(mode, paths)[part]
    out = work / f"run-{part}"
    result_file = work / f"result-{part}.json"
    script = [
        str(Path(__file__).resolve()),
        f"--child={kind}",
        f"--config={paths['config']}",
        f"--overrides={json.dumps([f'output_dir={out}', *overrides])}",
        f"--result={result_file}",
    ]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    try:
        if mode == "smoke" and not nproc:
            # in this process: a fresh process per part costs the imports again (seconds each on a CPU)
            record = finish_training(part, mode, out, result_file, model, peak, in_process(script[1:]), kind)
            if "peak_memory_kind" in record:
                record["peak_memory_kind"] += ", the check's own process (parts run in it under --smoke)"
        else:
            env = dict(os.environ)
            if mode == "smoke":
                env.setdefault("RLHFKIT_NUM_THREADS", "1")
            done = run_command([sys.executable, *launcher, *script], timeout, env=env, cwd=work)
            record = finish_training(part, mode, out, result_file, model, peak, done, kind, nproc)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # checkpoints of 0.5B models and AdamW: GBs per part
    record["overrides"] = overrides
    return record


def run_command(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``command`` in a session of its own; past ``timeout`` seconds the whole session is killed (torchrun's
    workers too, which would otherwise keep the device) and TimeoutError says so with the end of stderr."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise TimeoutError(f"timed out after {timeout:.0f} s; stderr ends: {stderr[-500:]!r}") from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def in_process(child_args: list[str]) -> subprocess.CompletedProcess:
    """:func:`child` with ``child_args`` in this process, its output captured as a subprocess's would be."""
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(child_args)
    return subprocess.CompletedProcess(child_args, code, stdout.getvalue(), stderr.getvalue())


def finish_training(
    part, mode, out: Path, result_file: Path, model: dict, peak, done, kind: str, nproc: int = 0
) -> dict:
    """The record of a finished training part: its launch line, exit, memory and figures (or its error)."""
    record: dict = {
        "command": f"rlhfkit train {kind}" + (f" under torchrun --nproc_per_node {nproc}" if nproc else "")
    }
    record["run"] = run_line(out)
    if done.returncode or not result_file.is_file():
        record.update(
            status="failed", error=error_line(done.stderr, done.returncode), stderr_tail=done.stderr[-2000:]
        )
        return record
    record.update(json.loads(result_file.read_text()))
    metrics = read_metrics(out)
    record.update(training_figures(part, mode, model, metrics, peak))
    for name in ("distill/teacher_kl", "loss/distill"):  # distillation: what it trained, at the last step
        if metrics and name in metrics[-1]:
            record[name.replace("/", "_")] = metrics[-1][name]
    if part == "async":
        record.update(async_figures(metrics))
    record["status"] = "ok" if record.get("steps_logged") else "failed"
    if record["status"] == "failed":
        record["error"] = f"no step in {out / 'metrics.jsonl'}"
    elif part == "async" and not record.get("staleness_max", 2) <= 1:  # online.max_staleness=1
        record["status"] = "failed"
        record["error"] = record.get("async_error") or f"staleness {record['staleness_max']} > 1"
    return record


def cuda_test_files() -> list[str]:
    """The suite's files that mark tests with ``pytest.mark.cuda``."""
    marker = re.compile(r"pytest\.mark\.cuda\b")
    return sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if marker.search(p.read_text())
    )


def run_cuda_tests(work: Path, timeout: float) -> dict:
    files = cuda_test_files()
    if not files:
        return {"status": "failed", "error": "no test in tests/ is marked pytest.mark.cuda"}
    report = work / "cuda-tests.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
    ]
    done = run_command([*command, *files], timeout, cwd=ROOT)
    record: dict = {"command": "pytest -m cuda " + " ".join(files), "files": files}
    if not report.is_file():
        record.update(status="failed", error=error_line(done.stdout + done.stderr, done.returncode))
        return record
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, reasons = [], set()
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            failures.append(f"{name}: {case.find('failure').get('message', '')[:300]}")
        elif case.find("error") is not None:
            counts["errors"] += 1
            failures.append(f"{name}: {case.find('error').get('message', '')[:300]}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            reasons.add(case.find("skipped").get("message", ""))
        else:
            counts["passed"] += 1
    record.update(counts)
    record["skip_reasons"] = sorted(reasons)
    if failures:
        record.update(status="failed", error=failures[0], failures=failures)
    else:
        record["status"] = "ok"
    return record


def _milliseconds(fn, repeats: int, cuda: bool) -> float:
    """The median milliseconds of ``fn()`` over ``repeats`` calls after one warm-up (synchronised on CUDA)."""
    import torch

    times = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_sampler_check(mode: str) -> dict:
    """The ``sampler`` part (module docstring): exactness, masked draws, device against CPU, time per step."""
    import math

    import torch

    from rlhfkit.algos.draw import draw_intervals, inverse_cdf_draw, stream_uniforms

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        vocab = 151936 if mode == "full" else 49152
        logits = torch.randn(4, vocab, generator=g) * torch.tensor([[1.0], [3.0], [6.0], [12.0]])
        logits[:, ::97] = float("-inf")  # masked entries
        probs = torch.softmax(logits, -1)  # (4, V) float32
        lengths = draw_intervals(probs.to(device)).cpu()
        rows = probs.double().tolist()
        totals = [math.fsum(r) for r in rows]  # exact sums, rounded once
        exact = torch.tensor(
            [[x / t for x in r] for r, t in zip(rows, totals, strict=True)], dtype=torch.float64
        )
        tv = float(0.5 * (lengths - exact).abs().sum(-1).max())
        # masked tokens over ~10^6 draws (fewer under --smoke), on 4096 entries with every 7th masked
        small = torch.randn(256, 4096, generator=g) * 4
        masked = torch.zeros(4096, dtype=torch.bool)
        masked[::7] = True
        small[:, masked] = float("-inf")
        small = torch.softmax(small, -1).to(device)
        index = torch.arange(256, device=device)
        steps, drawn = (4000 if mode == "full" else 40), 0
        disagree = 0
        for step in range(steps):
            u = stream_uniforms(1, index, torch.zeros_like(index), torch.full_like(index, step))
            picked = inverse_cdf_draw(small, u)
            drawn += int(masked.to(device)[picked].sum())
            if step < 8:  # the device's tokens against the CPU's for the same probabilities and uniforms
                disagree += int((picked.cpu() != inverse_cdf_draw(small.cpu(), u.cpu())).sum())
        timing = {}
        repeats = 20 if mode == "full" else 3
        for width in (49152, 151936):
            p = torch.softmax(torch.randn(32, width, generator=g) * 3, -1).to(device)
            u = torch.rand(32, dtype=torch.float64, generator=g).to(device)
            timing[f"32x{width}"] = {
                "exact_ms": _milliseconds(lambda p=p, u=u: inverse_cdf_draw(p, u), repeats, cuda),
                "multinomial_ms": _milliseconds(
                    lambda p=p: torch.multinomial(p, 1), max(2, repeats // 4), cuda
                ),
            }
    finally:
        torch.set_num_threads(threads)
    record = {
        "device": device,
        "threads": 1 if not cuda else None,
        "total_variation_max": tv,
        "total_variation_vocab": vocab,
        "masked_drawn": drawn,
        "draws": steps * 256,
        "device_vs_cpu_disagreements": disagree,
        "ms_per_step": timing,
    }
    ok = tv <= 1e-9 and drawn == 0
    record["status"] = "ok" if ok else "failed"
    if not ok:
        record["error"] = f"total variation {tv:.3g} (limit 1e-9), {drawn} masked tokens drawn"
    return record


def run_part(part: str, mode: str, work: Path, paths: dict, model: dict, peak, limit: float) -> dict:
    """One part's record, with its seconds; a part that raises is recorded as failed, with its error."""
    part_start = time.perf_counter()
    try:
        if part == "cuda_tests":
            record = run_cuda_tests(work, limit)
        elif part == "sampler":
            record = run_sampler_check(mode)
        else:
            record = run_training(part, mode, work, paths, model, peak, limit)
    except Exception as e:  # noqa: BLE001 - one part's failure must not stop the others
        record = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    record["seconds"] = time.perf_counter() - part_start
    return record


def skip_reason(part: str, mode: str, cuda: bool) -> str | None:
    """Why ``part`` does not run here, or None."""
    if part == "vllm":
        if mode == "smoke":
            return "--smoke: the vLLM engine part runs only on a GPU"
        try:
            import vllm  # noqa: F401
        except ImportError:
            return "vllm is not installed (./setup.sh vllm)"
    if mode == "full" and not cuda and part != "cuda_tests":
        return "no CUDA device: run with --smoke on a CPU"
    return None


# --------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="the JSON file written (and printed)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, a couple of steps")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="seconds; later parts are skipped after"
    )
    parser.add_argument(
        "--part-timeout-s", type=float, default=240.0, help="seconds one part may take (within the budget)"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from: " + ", ".join(PARTS))
    parser.add_argument(
        "--work", default=None, help="folder for the models and runs (default: a temporary one)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    start = time.perf_counter()
    mode = "smoke" if args.smoke else "full"
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        device = device_info()
        report: dict = {
            "mode": mode,
            "budget_s": args.budget_s,
            "commit": commit(),
            "device": device,
            "parts": {},
        }
        try:
            report["model"] = build_inputs(work, mode)
        except Exception as e:  # noqa: BLE001 - recorded: every part needs the inputs
            report["model"] = {"error": f"{type(e).__name__}: {e}"}
        report["inputs_seconds"] = time.perf_counter() - start
        paths = {name: str(work / name) for name in ("policy", "reward")}
        paths.update(
            prompts=str(work / "prompts.jsonl"),
            pairs=str(work / "pairs.jsonl"),
            rewards=str(work / "rewards.py"),
            config=str(work / "config.yaml"),
        )
        peak = device["bf16_peak_tflops"]

        def why_not(part: str, left: float) -> str | None:
            reason = skip_reason(part, mode, device["cuda"])
            if reason is None and "error" in report["model"]:
                reason = f"the inputs could not be built: {report['model']['error']}"
            if reason is None and left < MIN_PART_SECONDS[mode]:
                reason = f"time budget: {max(left, 0):.0f} s left of --budget-s {args.budget_s:.0f}"
            return reason

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(PARTS)) as pool:
            # --smoke: the torchrun parts start at once, beside the parts that run in this process (one thread):
            # their processes spend most of their time importing, on a core that would otherwise wait
            torchrun = {name for name, (_, _, nproc) in part_runs(mode, paths).items() if nproc}
            early = {
                part: pool.submit(
                    run_part, part, mode, work, paths, report["model"], peak, args.part_timeout_s
                )
                for part in parts
                if mode == "smoke" and part in torchrun and why_not(part, args.budget_s) is None
            }
            for part in parts:
                left = args.budget_s - (time.perf_counter() - start)
                reason = None if part in early else why_not(part, left)
                if reason is not None:
                    report["parts"][part] = {"status": "skipped", "reason": reason}
                elif part in early:
                    report["parts"][part] = early[part].result()
                else:
                    limit = min(left, args.part_timeout_s)
                    report["parts"][part] = run_part(part, mode, work, paths, report["model"], peak, limit)
                report["wall_seconds"] = time.perf_counter() - start
                Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
                line = report["parts"][part]
                print(
                    f"{part}: {line['status']} {line.get('reason') or line.get('error') or ''}".rstrip(),
                    flush=True,
                )
    text = json.dumps(report, indent=2)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
