"""Peak memory and time of the update's forward + backward on SmolLM2-135M-Instruct with LoRA r16, one
configuration per process (the peak resident set is the process's own).

The probe behind docs/performance.md's "the update's temporaries": ``--passes`` forward + backward passes of
the chunked read-out (log-probs and entropies) over 8 rows (2 prompts x 4 responses, the group's prompt read
once) of ``--prompt`` + ``--response`` tokens, as one micro-batch of the GRPO update. ``--heap`` prints glibc's
``mallinfo2`` (bytes in use, free inside the heap, mmapped) and the resident set at some decoder layers and
around the read-out, which shows the heap keeping freed holes.

    python benchmarks/smollm2.py                      # once: .bench/smollm2-135m-instruct
    python benchmarks/update_memory.py                # main's update: fused LoRA, entropy as a value
    python benchmarks/update_memory.py --peft-forward --entropy-grad   # as before both changes
    python benchmarks/update_memory.py --heap --passes 1
    MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/update_memory.py  # glibc's settings come from the environment
    python benchmarks/update_memory.py --trim-every 5  # malloc_trim(0) after every 5th decoder layer (not adopted)

Run it on an otherwise idle machine, alternating the configurations: every figure is a wall time or a peak.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / ".bench" / "smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--response", type=int, default=48)
    p.add_argument("--peft-forward", action="store_true", help="keep peft's LoRA forward (not fused)")
    p.add_argument("--entropy-grad", action="store_true", help="read the entropies with a graph")
    p.add_argument("--heap", action="store_true", help="print glibc's heap figures at some layers")
    p.add_argument("--trim-every", type=int, default=0, help="malloc_trim(0) after every N-th decoder layer")
    a = p.parse_args(argv)

    import torch

    from rlhfkit.models.head_chunks import response_readout
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.lora import add_lora, fuse_lora_forward

    torch.set_num_threads(a.threads)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    page = os.sysconf("SC_PAGE_SIZE")

    def heap(tag: str) -> None:
        if a.heap:
            m = libc.mallinfo2()
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * page / 2**20
            print(
                f"  {tag:22s} in use {(m.uordblks + m.hblkhd) / 2**20:6.0f} MiB, free in heap "
                f"{m.fordblks / 2**20:6.0f} MiB, mmapped {m.hblkhd / 2**20:5.0f} MiB, resident {rss:6.0f} MiB"
            )

    model = add_lora(load_causal_lm(str(a.model), dtype="float32"), rank=16, alpha=32)
    fused = 0 if a.peft_forward else fuse_lora_forward(model)
    layers = model.get_base_model().model.layers

    def trim(*_) -> None:
        if torch.is_grad_enabled():  # the training forward only
            libc.malloc_trim(0)

    for i, layer in enumerate(layers):
        if a.heap and i in (0, len(layers) // 2, len(layers) - 1):
            layer.register_forward_hook(lambda *_, i=i: heap(f"after layer {i}"))
        if a.trim_every and i % a.trim_every == 0:
            layer.register_forward_hook(trim)
    g, vocab = torch.Generator().manual_seed(0), model.config.vocab_size
    prompts = torch.randint(0, vocab, (2, a.prompt), generator=g).repeat_interleave(4, 0)
    ids = torch.cat([prompts, torch.randint(0, vocab, (8, a.response), generator=g)], 1)
    mask = torch.ones_like(ids)
    heap("start")
    start = time.perf_counter()
    for _ in range(a.passes):
        out = response_readout(
            model, ids, mask, a.prompt, entropy=True, share_prompts=True, entropy_grad=a.entropy_grad
        )
        heap("forward done")
        out.logprobs.sum().backward()
        del out
        heap("backward done")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{a.passes} forward + backward passes of 8 x {a.prompt + a.response} tokens, {a.threads} threads, "
        f"LoRA {'fused' if fused else 'peft forward'}, entropy {'with grad' if a.entropy_grad else 'a value'}"
        f"{f', malloc_trim every {a.trim_every} layers' if a.trim_every else ''}: "
        f"{seconds:.2f} s, peak RSS {peak:.0f} MiB"
    )


if __name__ == "__main__":
    main()
