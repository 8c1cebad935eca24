"""Peak memory of the token log-prob + entropy read-out against vocabulary size and response length: the plain
path (whole (B, R, V) logits from the model, then rlhfkit's log-prob and entropy read-outs) against the chunked
one (rlhfkit.models.head_chunks.response_readout), without grad (stage 1's forwards) and with a backward (the
update). Each case runs in a fresh process; the figure is its peak RSS above the RSS after the model and the
inputs are built (ru_maxrss), so it is what the read-out and the forward add. Two allocator settings: glibc's
default, whose dynamic mmap threshold keeps freed multi-MiB blocks on the heap (so many freed chunks still show
in the RSS), and ``MALLOC_MMAP_THRESHOLD_=65536``, under which every large block is returned when freed and the
peak RSS is the peak of live tensors.

    PYTHONPATH=src python benchmarks/logprob_memory.py            # the table of docs/performance.md
    PYTHONPATH=src python benchmarks/logprob_memory.py --one 49152 512 grad chunked

The model is a random 2-layer Llama (hidden 64) with the given vocabulary; B = 2 responses after 16 prompt
tokens; sampling at temperature 0.7 (the default of rlhfkit's online trainers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VOCABS = (4096, 16384, 49152, 151936)
LENGTHS = (48, 512)
ROWS, PROMPT = 2, 16


def one(vocab: int, length: int, mode: str, path: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhfkit.algos import entropy_from_logits
    from rlhfkit.models import (
        Sampling,
        processed_logits,
        response_forward,
        response_readout,
        sampled_logprobs,
    )

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, vocab, (ROWS, PROMPT + length))
    mask = torch.ones_like(ids)
    sampling = Sampling(temperature=0.7)

    def run(ids, mask):
        with torch.set_grad_enabled(mode == "grad"):
            if path == "plain":
                logits, _ = response_forward(model, ids, mask, PROMPT)  # (B, R, V)
                labels = ids[:, PROMPT:]
                logprobs = sampled_logprobs(logits, labels, sampling)
                entropy = entropy_from_logits(processed_logits(logits, sampling, labels))
            else:
                out = response_readout(model, ids, mask, PROMPT, sampling, entropy=True)
                logprobs, entropy = out.logprobs, out.entropy
            if mode == "grad":
                (logprobs.sum() + 0.01 * entropy.sum()).backward()

    run(ids[:1, : PROMPT + 2], mask[:1, : PROMPT + 2])  # warm-up: kernels, thread pools, the weights' grads
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    run(ids, mask)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": (peak - before) / 1024, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=4, metavar=("VOCAB", "LENGTH", "MODE", "PATH"))
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="V:LENGTH:MODE",
        help="only these cases, e.g. 49152:512:grad (default: every vocabulary x length x mode)",
    )
    parser.add_argument("--plot", help="also draw peak live memory against the vocabulary into this PNG")
    args = parser.parse_args()
    if args.one:
        vocab, length, mode, path = args.one
        print(json.dumps(one(int(vocab), int(length), mode, path)))
        return
    print(
        "| V | response tokens | mode | plain, live MiB | chunked, live MiB | plain, glibc default MiB "
        "| chunked, glibc default MiB | one (B, R, V) float32 MiB | seconds plain / chunked |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    cases = [(v, n, m) for n in LENGTHS for v in VOCABS for m in ("no-grad", "grad")]
    if args.cases:
        cases = [(int(v), int(n), m) for v, n, m in (c.split(":") for c in args.cases)]
    rows = []
    for vocab, length, mode in cases:
        cells = {}
        for allocator in ("live", "default"):
            env = dict(os.environ)
            if allocator == "live":
                env["MALLOC_MMAP_THRESHOLD_"] = "65536"
            for path in ("plain", "chunked"):
                proc = subprocess.run(
                    [sys.executable, __file__, "--one", str(vocab), str(length), mode, path],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                )
                cells[allocator, path] = json.loads(proc.stdout.strip().splitlines()[-1])
        full = ROWS * length * vocab * 4 / 2**20
        mib = [cells[a, p]["peak_mib"] for a in ("live", "default") for p in ("plain", "chunked")]
        secs = [cells["default", p]["seconds"] for p in ("plain", "chunked")]
        print(
            f"| {vocab} | {length} | {mode} | "
            + " | ".join(f"{m:.0f}" for m in mib)
            + f" | {full:.0f} | {secs[0]:.2f} / {secs[1]:.2f} |",
            flush=True,
        )
        rows.append({"vocab": vocab, "length": length, "mode": mode, "mib": mib, "full": full})
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: str) -> None:
    """Peak live memory of the read-out against the vocabulary, plain and chunked, one line per (length, mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (length, mode), color in zip(
        sorted({(r["length"], r["mode"]) for r in rows}), ("C0", "C1", "C2", "C3"), strict=False
    ):
        mine = sorted(
            (r for r in rows if (r["length"], r["mode"]) == (length, mode)), key=lambda r: r["vocab"]
        )
        vocabs = [r["vocab"] for r in mine]
        ax.plot(
            vocabs, [r["mib"][0] for r in mine], "s--", color=color, label=f"plain, {length} tokens, {mode}"
        )
        ax.plot(
            vocabs, [r["mib"][1] for r in mine], "o-", color=color, label=f"chunked, {length} tokens, {mode}"
        )
    ax.set_xscale("log")
    ax.set_xticks(vocabs, [f"{v:,}" for v in vocabs])
    ax.set_xlabel("vocabulary size V (tokens)")
    ax.set_ylabel("peak live memory of the read-out (MiB)")
    ax.set_title(f"Token log-probs + entropy: (B, R, V) logits against chunks (B = {ROWS} responses)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
