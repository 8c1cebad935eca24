"""Peak memory of a frozen teacher's full-vocabulary JSD from the student over B x R response positions, forward
and backward: rlhfkit.models.teacher_divergence (both heads applied a chunk of positions at a time, checkpointed)
against the whole-logits computation (both models' (B, R, V) logits, processed, then token_divergence). Each case
runs in a fresh process under ``MALLOC_MMAP_THRESHOLD_=65536`` (every large block is returned when freed, so the
peak RSS is the peak of live tensors); the figure is the peak RSS above the RSS after the models, the inputs and
a warm-up on one position (ru_maxrss).

    PYTHONPATH=src python benchmarks/distill_memory.py                        # B = 4, 8, 16; both paths
    PYTHONPATH=src python benchmarks/distill_memory.py --rows 8 --chunk-tokens 32

The student is a random 2-layer Llama of hidden size 32, the teacher one of hidden size 48, V = 32000; R = 128
response tokens after 8 prompt tokens; temperature 0.8.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys

VOCAB, PROMPT, RESPONSE = 32000, 8, 128


def one(path: str, rows: int, chunk_tokens: int | None) -> float:
    """MiB of peak RSS that one forward and backward of ``path`` (chunked or plain) adds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhfkit.algos import token_divergence
    from rlhfkit.models import Sampling, processed_logits, response_logits, teacher_divergence

    torch.set_num_threads(1)
    student, teacher = (
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=width,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
            )
        ).eval()
        for width in (32, 48)
    )
    ids = torch.randint(5, VOCAB, (rows, PROMPT + RESPONSE))
    mask, sampling = torch.ones_like(ids), Sampling(temperature=0.8)
    teacher_divergence(
        student, teacher, ids[:1, : PROMPT + 1], mask[:1, : PROMPT + 1], PROMPT, sampling, "jsd"
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if path == "chunked":
        out = teacher_divergence(student, teacher, ids, mask, PROMPT, sampling, "jsd", 0.5, chunk_tokens)
    else:
        labels = ids[:, PROMPT:]
        s = processed_logits(response_logits(student, ids, mask, PROMPT), sampling, labels)  # (B, R, V)
        with torch.no_grad():
            t = processed_logits(response_logits(teacher, ids, mask, PROMPT), sampling, labels)
        out = token_divergence(s.flatten(0, 1), t.flatten(0, 1), "jsd", 0.5)
    out.sum().backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16], help="batch sizes B")
    parser.add_argument("--paths", nargs="+", default=["chunked", "plain"], choices=["chunked", "plain"])
    parser.add_argument(
        "--chunk-tokens", type=int, default=None, help="positions per chunk (default: rlhfkit's)"
    )
    parser.add_argument("--one", nargs=2, metavar=("PATH", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(f"{one(args.one[0], int(args.one[1]), args.chunk_tokens):.0f}")
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    chunk = ["--chunk-tokens", str(args.chunk_tokens)] if args.chunk_tokens else []
    print(
        f"V = {VOCAB}, R = {RESPONSE}, chunk_tokens = {args.chunk_tokens or 'default'}; peak RSS added, MiB"
    )
    for rows in args.rows:
        for path in args.paths:
            command = [sys.executable, __file__, "--one", path, str(rows), *chunk]
            mib = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout.strip()
            print(f"B = {rows:3d} ({rows * RESPONSE:5d} positions)  {path:8s} {mib:>6s}")


if __name__ == "__main__":
    main()
