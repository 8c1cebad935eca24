"""Benchmark: preparing conversational preference pairs, the first time (tokenised) and the second (cached).

Writes N pairs in the implicit-prompt shape of trl-lib's UltraFeedback (``chosen`` / ``rejected`` are whole
conversations sharing their user turn), a byte-level BPE tokenizer trained on the same text (vocabulary 8,000)
with a ChatML chat template, and times :func:`rlhfkit.data.prepare_examples` twice: the first call reads,
validates, extracts the prompts and tokenises through ``datasets.map`` into the cache; the second reads,
validates and loads the cached tokens. The cache goes to a fresh folder under the output folder, so the first
run is always cold.

Run (figures depend on the machine's load)::

    python benchmarks/data_prepare_bench.py                       # 20,000 pairs, one process
    python benchmarks/data_prepare_bench.py --pairs 20000 --num-proc 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "the a cat dog model answer question because therefore however people write code data train reward "
    "policy value good bad better worse explain example first second finally step result number"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def write_pairs(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            question = " ".join(sentence(rng, rng.randint(8, 20)) for _ in range(rng.randint(1, 4)))
            turns = [{"role": "user", "content": question}]
            chosen = " ".join(sentence(rng, rng.randint(8, 20)) for _ in range(rng.randint(2, 8)))
            rejected = " ".join(sentence(rng, rng.randint(8, 20)) for _ in range(rng.randint(2, 8)))
            f.write(
                json.dumps(
                    {
                        "chosen": turns + [{"role": "assistant", "content": chosen}],
                        "rejected": turns + [{"role": "assistant", "content": rejected}],
                    }
                )
                + "\n"
            )


def make_tokenizer(corpus: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend.train([str(corpus)], trainers.BpeTrainer(vocab_size=8000, special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--num-proc", type=int, default=None)
    parser.add_argument("--out", default=None, help="working folder (default: a new temporary one)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="rlhfkit-data-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    os.environ["HF_DATASETS_CACHE"] = str(out / "datasets-cache")  # before datasets is imported: a cold cache

    import torch

    from rlhfkit.data import TokenLimits, prepare_examples

    torch.set_num_threads(1)
    data = out / "pairs.jsonl"
    write_pairs(data, args.pairs)
    tokenizer = make_tokenizer(data)
    limits = TokenLimits(max_prompt_length=512, max_length=1024, truncation="left")
    for attempt in ("first (tokenise)", "second (cached)"):
        start = time.perf_counter()
        examples = prepare_examples(str(data), "preferences", tokenizer, limits, num_proc=args.num_proc)
        seconds = time.perf_counter() - start
        tokens = sum(len(e["prompt_ids"]) + len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in examples)
        print(
            f"{attempt}: {len(examples)} pairs in {seconds:.1f} s ({len(examples) / seconds:.0f} pairs/s, "
            f"{tokens / len(examples):.0f} tokens per pair, from cache: {examples.from_cache})"
        )


if __name__ == "__main__":
    main()
