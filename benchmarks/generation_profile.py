"""Where a rollout's generation time goes: rlhfkit's ``generate_responses`` on SmolLM2-135M-Instruct + LoRA.

The generation of one GRPO rollout of the side-by-side benchmark (``grpo_vs_trl.py``): 8 chat prompts x 4
responses x 48 tokens, exactly (the stop token suppressed), temperature 1, LoRA r16 / alpha 32 on all linear
layers (the adapters given a non-zero update, as after training), in fp32 or under bf16 autocast as the trainer
holds the model. Prints the seconds of each of ``--repeats`` generate calls after one warm-up, and with
``--profile`` torch.profiler's table of one more call (operators by self CPU time; ``--shapes`` groups them by
input shape); with ``--split``, how each call's wall time divides between the model's forward calls, the
draw (rlhfkit's logits processor: processing and the exact draw) and the rest, ``generate``'s own loop (input
preparation, cache bookkeeping, stopping criteria), as seconds and shares.

    python benchmarks/smollm2.py                               # once: .bench/smollm2-135m-instruct
    python benchmarks/generation_profile.py --dtype bfloat16 --repeats 3
    python benchmarks/generation_profile.py --dtype float32 --profile --shapes
    python benchmarks/generation_profile.py --dtype float32 --threads 1 --split --response-length 128

Run it on an otherwise idle machine: the figures are wall times.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / ".bench" / "grpo-inputs" / "prompts.jsonl"  # written by grpo_vs_trl.py


def trained_lora(model):
    """``model`` with a LoRA r16 / alpha 32 adapter on all linear layers, given a non-zero update."""
    from rlhfkit.config.sections import ModelConfig
    from rlhfkit.models.lora import prepare_trained

    model = prepare_trained(model, ModelConfig(lora_rank=16, lora_alpha=32))
    with torch.no_grad():  # lora_B starts at zero; a trained adapter is not
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def build(model_dir: str, dtype: str, prompts: Path, n_prompts: int, group: int):
    from rlhfkit.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model = trained_lora(load_causal_lm(model_dir, tokenizer=tokenizer, dtype=dtype))
    if prompts.is_file():
        chats = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()][:n_prompts]
    else:
        chats = [
            [{"role": "user", "content": f"Write one sentence about item {i}."}] for i in range(n_prompts)
        ]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    tokenizer.padding_side = "left"
    batch = tokenizer(
        [t for t in texts for _ in range(group)], return_tensors="pt", padding=True, add_special_tokens=False
    )
    return model, tokenizer, batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / ".bench" / "smollm2-135m-instruct"))
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--response-length", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also torch.profiler's table of one more call")
    p.add_argument("--shapes", action="store_true", help="the profile grouped by input shape")
    p.add_argument("--split", action="store_true", help="forward / draw / generate's own loop, per call")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from rlhfkit.models.sampling import Sampling
    from rlhfkit.rollout.generation import generate_responses

    model, tokenizer, batch = build(a.model, a.dtype, PROMPTS, a.prompts, a.group)
    pad = tokenizer.pad_token_id  # = EOS in SmolLM2: suppressed, so every response has the full length

    def generate():
        return generate_responses(
            model,
            batch.input_ids,
            batch.attention_mask,
            max_new_tokens=a.response_length,
            stop_token_ids=[pad],
            pad_token_id=pad,
            sampling=Sampling(1.0, 0, 1.0, (pad,)),
        )

    torch.manual_seed(0)
    generate()  # warm-up
    if a.split:
        split_calls(model, generate, a.repeats)
    seconds = []
    for _ in range(a.repeats):
        start = time.perf_counter()
        out = generate()
        seconds.append(time.perf_counter() - start)
    print(
        f"{a.dtype}, {tuple(batch.input_ids.shape)} prompt tokens -> {tuple(out.response_ids.shape)} responses, "
        f"{a.threads} threads: generate {', '.join(f'{s:.2f}' for s in seconds)} s",
        flush=True,
    )
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=a.shapes) as prof:
            generate()
        table = prof.key_averages(group_by_input_shape=a.shapes)
        print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))


def split_calls(model, generate, repeats: int) -> None:
    """Print, for ``repeats`` calls of ``generate``, the seconds in the model's forward calls (hooks on the
    causal LM under any adapter wrapper), in the draw (:class:`rlhfkit.models.sampler.ExactDraw` calls) and in neither: the share
    of a step that ``generate``'s own loop costs."""
    from rlhfkit.models.readout import hf_model
    from rlhfkit.models.sampler import ExactDraw

    spent = {"forward": 0.0, "draw": 0.0}
    started: list[float] = []

    def before(*_):
        started.append(time.perf_counter())

    def after(*_):
        spent["forward"] += time.perf_counter() - started.pop()

    inner = hf_model(model)  # the causal LM itself: a LoRA wrapper's generate calls it, not the wrapper
    handles = [inner.register_forward_pre_hook(before), inner.register_forward_hook(after)]
    original = ExactDraw.__call__

    def timed(self, input_ids, scores):
        start = time.perf_counter()
        try:
            return original(self, input_ids, scores)
        finally:
            spent["draw"] += time.perf_counter() - start

    ExactDraw.__call__ = timed
    try:
        for _ in range(repeats):
            spent.update(forward=0.0, draw=0.0)
            start = time.perf_counter()
            generate()
            total = time.perf_counter() - start
            rest = total - spent["forward"] - spent["draw"]
            print(
                f"split: total {total:.3f} s, forward {spent['forward']:.3f} ({spent['forward'] / total:.1%}), "
                f"draw {spent['draw']:.3f} ({spent['draw'] / total:.1%}), generate's loop and the rest "
                f"{rest:.3f} ({rest / total:.1%})",
                flush=True,
            )
    finally:
        ExactDraw.__call__ = original
        for h in handles:
            h.remove()


if __name__ == "__main__":
    main()
