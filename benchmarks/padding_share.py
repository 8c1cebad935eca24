"""Share of the computed positions that are padding in a rollout's forwards, before and after length-sorted
micro-batches (rlhfkit.trainers.online.layout).

Lengths: the prompts of the built-in tasks (``reviews`` and ``arithmetic``, tokenized with the task's own
trained tokenizer, as the quickstart does) and responses of two kinds: forced to the response length (what the
issue-27 benchmark runs: no response padding), and the task's own reference completions (its SFT writer) cut at
the response length. Each row is prompt + response; a forward over a group of rows computes rows x (longest
prompt + longest response) positions (model_inputs trims the columns no row uses). Rollout: 32 prompts x 4
responses (GRPO groups of 4), 1 minibatch, micro-batches of 8; unsorted = the shuffled minibatch order that the
update used before, sorted = the same minibatch sorted by length (the order of layout.micro_batches).

    PYTHONPATH=src python benchmarks/padding_share.py
"""

from __future__ import annotations

import random

from rlhfkit.tasks import get_task
from rlhfkit.tasks.tokenizer import train_tokenizer

PROMPTS, GROUP, MICRO = 32, 4, 8


def area(rows: list[tuple[int, int]]) -> int:
    """Positions computed by one forward over ``rows`` of (prompt, response) lengths."""
    return len(rows) * (max(p for p, _ in rows) + max(r for _, r in rows))


def padding_share(rows: list[tuple[int, int]], order: list[int]) -> float:
    groups = [[rows[i] for i in order[k : k + MICRO]] for k in range(0, len(order), MICRO)]
    real = sum(p + r for p, r in rows)
    return 1 - real / sum(area(g) for g in groups)


def main() -> None:
    print("| task | responses | response length | one forward | micro-batches, shuffled | length-sorted |")
    print("|---|---|---|---|---|---|")
    for name in ("reviews", "arithmetic"):
        task = get_task(name)
        tokenizer = train_tokenizer(task.tokenizer_texts())
        rng = random.Random(0)
        prompts = rng.sample(task.prompts("train"), PROMPTS)
        for length in (48, 512):
            for kind in ("forced", "task completions"):
                rows = []
                for prompt in prompts:
                    p = len(tokenizer(prompt)["input_ids"])
                    for _ in range(GROUP):
                        if kind == "forced":
                            r = length
                        else:
                            r = min(
                                length, len(tokenizer(task.sample_completion(prompt, rng))["input_ids"]) + 1
                            )
                        rows.append((p, r))
                shuffled = list(range(len(rows)))
                random.Random(1).shuffle(shuffled)
                ordered = sorted(shuffled, key=lambda i: rows[i][0] + rows[i][1])
                whole = 1 - sum(p + r for p, r in rows) / area(rows)
                print(
                    f"| {name} | {kind} | {length} | {whole:.1%} | {padding_share(rows, shuffled):.1%} "
                    f"| {padding_share(rows, ordered):.1%} |"
                )


if __name__ == "__main__":
    main()
