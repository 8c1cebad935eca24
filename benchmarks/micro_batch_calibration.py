"""Peak memory of the online update's forward + backward against the micro-batch, the peaks that
``rlhfkit.trainers.online.layout.update_peak_bytes`` (the default micro-batch's estimate) is fitted to.

Each configuration (model, dtype, LoRA or full fine-tuning, the actor alone or with a critic, rows, prompt and
response length) runs in a FRESH Python process that builds the run's roles as ``rlhfkit train`` does
(``build_context``), makes a rollout of ``rows`` responses of exactly ``prompt`` + ``response`` real tokens
(random ids: memory does not depend on them), runs one warm-up update on one group of rows (AdamW's state, the
allocator's first blocks), then the measured update: :func:`rlhfkit.trainers.online.ppo_update.ppo_update`, one
epoch of one minibatch in micro-batches of ``rows`` (``train.micro_batch_size``), i.e. the real
``micro_batch_loss`` forward and backward and the optimizer step.

The figure is the peak resident set of that update above the resident set just before it. Linux's ``VmHWM``
is restarted there (``/proc/self/clear_refs``, :class:`memory.PhasePeaks`): ``getrusage``'s ``ru_maxrss``
cannot be restarted, and the load of the weights (a float32 read, then the cast) can peak above the update
and hide it. glibc's mmap threshold is fixed at 64 KiB (:func:`memory.child_env`), so a freed large tensor
is returned at once and the peak follows the live tensors, not the heap's holes. tracemalloc does not see
torch's allocations at all.

    python benchmarks/smollm2.py                                   # once: .bench/smollm2-135m-instruct
    python benchmarks/micro_batch_calibration.py --model tiny --grid preset --out tiny.json
    python benchmarks/micro_batch_calibration.py --model .bench/smollm2-135m-instruct --threads 1 --out smollm2.json
    python benchmarks/micro_batch_calibration.py --check tests/trainers/online/micro_batch_peaks.json

``--out`` writes every record (the model's shape, the configuration, the trained parameters, the peak, the
update's seconds) as JSON, after each configuration: the fixture tests/trainers/online/micro_batch_peaks.json
is such files put together. The tables print the estimate beside each peak. Timings are of a shared machine
unless you made it idle: read them as upper bounds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import PhasePeaks, child_env, prepare, rss_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Responses per prompt of the actor-alone runs (grpo); the critic runs are ppo (gae), one response per prompt.
GROUP = 4

# (dtype, lora, critic, rows, prompt, response): the grids (--grid full: SmolLM2's 608 positions; preset: the
# built-in presets' 256; quick: a check that the script runs)
GRIDS = {
    "full": [  # SmolLM2's 2048 positions; float32: a CPU without AVX-512 multiplies bf16 ~40x slower
        ("float32", True, False, 4, 96, 48),
        ("float32", True, False, 16, 96, 48),
        ("float32", False, False, 4, 96, 48),
        ("float32", True, True, 4, 96, 48),
        ("float32", False, True, 4, 96, 48),
        ("float32", True, False, 4, 96, 512),
        ("float32", False, False, 16, 96, 48),
        ("float32", True, True, 16, 96, 48),
        ("float32", True, False, 32, 96, 48),
        ("bfloat16", True, False, 4, 96, 48),
    ],
    "preset": [  # the presets hold 256 positions
        *[("bfloat16", True, False, b, 96, 48) for b in (4, 16, 64)],
        *[("bfloat16", True, False, b, 64, 192) for b in (4, 16)],
        *[("float32", True, False, b, 96, 48) for b in (4, 64)],
        *[("bfloat16", False, False, b, 96, 48) for b in (4, 64)],
        *[("float32", False, False, b, 96, 48) for b in (4, 64)],
        *[("float32", False, False, b, 64, 192) for b in (4, 16)],
        *[("bfloat16", True, True, b, 96, 48) for b in (4, 64)],
        *[("float32", False, True, b, 96, 48) for b in (4, 64)],
    ],
    "preset-short": [  # the preset grid's corners, for a larger preset
        *[("bfloat16", True, False, b, 96, 48) for b in (4, 16)],
        ("float32", True, False, 16, 64, 192),
        *[("float32", False, False, b, 96, 48) for b in (4, 16)],
        ("bfloat16", True, True, 16, 96, 48),
        ("float32", False, True, 4, 96, 48),
    ],
    "quick": [("bfloat16", True, False, 4, 32, 16), ("float32", False, True, 4, 32, 16)],
}


def make_rollout(total: int, group: int, prompt: int, response: int, vocab: int, critic: bool):
    """A scored rollout of ``total`` rows (groups of ``group`` share a prompt), every position real."""
    import torch

    from rlhfkit.types import Rollout

    g = torch.Generator().manual_seed(0)
    query = torch.randint(0, vocab, (total // group, prompt), generator=g).repeat_interleave(group, 0)
    full = torch.ones(total, response, dtype=torch.bool)
    return Rollout(
        query_ids=query,
        query_mask=torch.ones_like(query),
        response_ids=torch.randint(0, vocab, (total, response), generator=g),
        mask=full,
        logprobs=-torch.rand(total, response, generator=g),
        ref_logprobs=-torch.rand(total, response, generator=g),
        values=torch.randn(total, response, generator=g) if critic else None,
        advantages=torch.randn(total, response, generator=g),
        returns=torch.randn(total, response, generator=g),
        group_ids=torch.arange(total // group).repeat_interleave(group),
        ended=torch.ones(total, dtype=torch.bool),
        response_mask=full,
        entropy=torch.zeros(total, response),
    )


def measure(model: str, dtype: str, lora: bool, critic: bool, rows: int, prompt: int, response: int) -> dict:
    """One configuration, in this process: the update's peak above the resident set before it."""
    import dataclasses

    from rlhfkit.config import load_config
    from rlhfkit.engine.accel import make_accelerator
    from rlhfkit.models import load_tokenizer
    from rlhfkit.models.readout import hf_model
    from rlhfkit.trainers.online.context import build_context
    from rlhfkit.trainers.online.ppo_update import ppo_update

    group = 1 if critic else GROUP
    total = max(rows, group)
    with tempfile.TemporaryDirectory() as out:
        prompts = Path(out) / "prompts.jsonl"  # read by the config's checks only: the rollout is made here
        prompts.write_text(json.dumps({"prompt": "Say something."}) + "\n")
        overrides = [
            f"output_dir={out}/run",
            f"data.train_file={prompts}",
            f"online.reward_functions=[{ROOT / 'benchmarks' / 'grpo_vs_trl.py'}:length_reward]",
            f"model.name_or_path={model}",
            f"model.dtype={dtype}",
            f"train.batch_size={total // group}",
            f"train.micro_batch_size={rows}",
            f"online.group_size={group}",
            f"data.max_prompt_length={prompt}",
            f"online.response_length={response}",
            "online.ppo_epochs=1",
            "online.num_minibatches=1",
            "online.reward_model=null",
            *(["model.lora_rank=16", "model.lora_alpha=32"] if lora else []),
        ]
        cfg = load_config(None, overrides, "ppo" if critic else "grpo")
        ctx = build_context(cfg, make_accelerator(), load_tokenizer(model))
    config = hf_model(ctx.roles.actor).config
    vocab = int(config.vocab_size)
    rollout = make_rollout(total, group, prompt, response, vocab, critic)
    # Warm-up: one group of rows of one prompt and one response token, so that AdamW's moments (and the
    # allocator's first blocks) exist before the measured update.
    small = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=1))
    ppo_update(dataclasses.replace(ctx, cfg=small), make_rollout(group, group, 1, 1, vocab, critic), 1)
    phases = PhasePeaks()
    before = rss_bytes()
    start = time.perf_counter()
    with phases.phase("update"):
        ppo_update(ctx, rollout, 2)
    seconds = time.perf_counter() - start
    peak = phases.peaks.get("update", 0)
    trained = sum(p.numel() for m in ctx.trained.values() for p in m.parameters() if p.requires_grad)
    return {
        "hidden_size": int(config.hidden_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "num_attention_heads": int(config.num_attention_heads),
        "vocab_size": vocab,
        "dtype": dtype,
        "lora": lora,
        "critic": critic,
        "rows": rows,
        "prompt": prompt,
        "response": response,
        "trained_parameters": trained,
        "peak_bytes": peak - before,
        "seconds": round(seconds, 3),
        "response_tokens_per_s": round(total * response / seconds, 1),
    }


def estimate(record: dict) -> int:
    """The update's peak that the default micro-batch predicts for ``record``'s configuration (bytes)."""
    from types import SimpleNamespace

    from rlhfkit.trainers.online.layout import update_peak_bytes

    config = SimpleNamespace(**{k: record[k] for k in SHAPE})
    return update_peak_bytes(
        config,
        record["rows"],
        record["prompt"],
        record["response"],
        record["trained_parameters"],
        lora=record["lora"],
        critic_config=config if record["critic"] else None,
        group=1 if record["critic"] else GROUP,
        half=record["dtype"] != "float32",
    )


def check(records: list[dict]) -> int:
    """Print each record's peak beside its estimate; 1 when an estimate is below its peak."""
    print(
        f"{'model':22} {'dtype':9} {'lora':5} {'critic':6} {'rows':>4} {'P+T':>8} {'peak':>6} {'estimate':>8}"
    )
    worst = float("inf")
    for r in records:
        worst = min(worst, estimate(r) / r["peak_bytes"])
        length = f"{r['prompt']}+{r['response']}"
        print(
            f"{r['model']:22} {r['dtype']:9} {str(r['lora']):5} {str(r['critic']):6} {r['rows']:>4} "
            f"{length:>8} {r['peak_bytes'] / 2**20:>6.0f} {estimate(r) / 2**20:>8.0f}"
        )
    print(f"the smallest estimate / peak: {worst:.2f}")
    return 0 if worst >= 1 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="tiny", help="a model folder, or a preset of the built-in task (tiny, small)"
    )
    p.add_argument("--grid", default="full", choices=sorted(GRIDS))
    p.add_argument("--skip", type=int, default=0, help="leave out the grid's first N configurations")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="write the records here (JSON)")
    p.add_argument(
        "--check", type=Path, help="measure nothing: the records of this file against the estimate"
    )
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: one configuration (JSON), one record out
    a = p.parse_args(argv)
    if a.child:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(measure(a.model, **json.loads(a.child))))
        return 0
    if a.check:
        return check(json.loads(a.check.read_text()))
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model if Path(a.model).is_dir() else prepare(Path(tmp), a.model)["policy"]
        name = Path(a.model).name
        print(f"{name}, {a.threads} threads: peak of the update above the resident set before it (MiB)")
        print(
            f"{'dtype':9} {'lora':5} {'critic':6} {'rows':>4} {'P+T':>8} {'peak':>7} {'estimate':>8} {'tok/s':>7}"
        )
        for dtype, lora, critic, rows, prompt, response in GRIDS[a.grid][a.skip :]:
            spec = dict(dtype=dtype, lora=lora, critic=critic, rows=rows, prompt=prompt, response=response)
            command = [sys.executable, __file__, "--model", model, "--threads", str(a.threads)]
            env = child_env()
            env.setdefault("RLHFKIT_NUM_THREADS", str(a.threads))
            done = subprocess.run(
                [*command, "--child", json.dumps(spec)], capture_output=True, text=True, env=env
            )
            if done.returncode != 0:
                print(f"{spec}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                return 1
            r = {"model": name, **json.loads(done.stdout.strip().splitlines()[-1])}
            records.append(r)
            if a.out:  # after every configuration: a run stopped early keeps what it measured
                a.out.write_text(json.dumps(records, indent=1) + "\n")
            print(
                f"{dtype:9} {str(lora):5} {str(critic):6} {rows:>4} {f'{prompt}+{response}':>8} "
                f"{r['peak_bytes'] / 2**20:>7.0f} {estimate(r) / 2**20:>8.0f} "
                f"{r['response_tokens_per_s']:>7.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
