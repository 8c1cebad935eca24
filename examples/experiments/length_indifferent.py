"""The length premise with annotators indifferent to length, at 20 seeds (docs/experiments.md, registered claim
``length-indifferent``).

The premise of the length-bias literature (Singhal et al. 2023): a reward model learns to like long answers
from its pairs even where the annotators do not, when the chosen answers happen to be longer more often than
not. The reviews task's own annotators prefer short answers (a penalty per sentence past the third), so there
the premise cannot show (the length-bias section). Here a variant of the task removes that: its annotators judge
by :func:`indifferent_gold`, the task's gold score without its length term (relevance, sentiment, aspects and
enthusiasm only), and its labelled pairs are length-correlated by selection (:func:`length_correlated`).

Shared with ``central_claims.py`` (``OUT/shared``, its shared stage; trained here too when missing): the reviews
task (task seed 0), the SFT policy, and the pool of pairs of SFT samples. Per training seed ``s``
(``OUT/seed-s``):

1. every pool pair relabelled by the indifferent annotators (:func:`relabel`: Bradley-Terry at the task's
   annotator temperature 0.5 on the indifferent gold, its draws seeded by ``s``);
2. the length-correlated selection (:func:`length_correlated`): a pair whose chosen answer has fewer words than
   its rejected one is kept with probability ``KEEP_SHORTER`` = 1/3 (seeded by ``s``), every other pair is kept;
   the first ``PAIRS`` = 1,024 kept pairs are the training pairs;
3. a reward model on them from the SFT policy as ``central_claims.py`` trains its reward models
   (``overoptimization_quality.reward_stage``: 1.5 epochs, at least 150 steps, training seed ``s``);
4. the read: the SFT policy's 4 responses at T = 0.7 to each of the 384 held-out prompts (the 4-sample read's
   sampling, its seed from ``s``), each scored by the reward model and by the indifferent gold; over the
   well-formed responses, the Pearson correlation of each score with the response's length in tokens.

Comparison ``premise`` (b − a, per seed): the reward model's score–length correlation − the indifferent gold's.

    RLHFKIT_NUM_THREADS=1 nice -n 19 python examples/experiments/length_indifferent.py --out runs/central --jobs 2
    python examples/experiments/length_indifferent.py --out runs/central --report-only

A finished seed is cached in ``OUT/seed-s/length-indifferent.json`` and copied to ``--records`` (by default the
committed ``examples/experiments/records/length_indifferent/``), from which a later sitting takes it instead of
running it again. Each record keeps the commit it ran at (``--commit``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import central_claims as cc  # noqa: E402
import overoptimization_quality as oq  # noqa: E402
from orm_prm import (  # noqa: E402
    add_run_arguments,
    resolve_run_arguments,
    restore_record,
    seed_jobs,
    write_record,
)

HERE = Path(__file__).resolve().parent
RECORDS = HERE / "records" / "length_indifferent"
PLAN = cc.PLAN
SEEDS = list(range(20))
PAIRS = {"default": 1024, "smoke": 8}
KEEP_SHORTER = 1 / 3
NAME = "length-indifferent"


def indifferent_gold(prompt: str, response: str) -> float:
    """The reviews task's gold score without its length term; the task's invalid score for an ill-formed one."""
    from rlhfkit.tasks.reviews import INVALID_SCORE, gold_terms

    terms = gold_terms(prompt, response)
    return INVALID_SCORE if terms is None else terms.total - terms.length


class IndifferentTask:
    """The reviews task as the read sees it, its gold replaced by :func:`indifferent_gold`."""

    def __init__(self, task):
        self.task = task

    def gold_score(self, prompt: str, response: str) -> float:
        return indifferent_gold(prompt, response)

    def is_valid(self, response: str) -> bool:
        return self.task.is_valid(response)


def relabel(records: list[dict], seed: int, temperature: float) -> list[dict]:
    """Each pair's two responses labelled again by annotators who prefer the first with probability
    sigmoid((g1 − g2) / temperature) on :func:`indifferent_gold`: ``{"prompt", "chosen", "rejected"}``. The
    order the two are shown in and every draw come from ``seed``."""
    rng = random.Random(f"{NAME}-labels-{seed}")
    out = []
    for r in records:
        first, second = (r["chosen"], r["rejected"]) if rng.random() < 0.5 else (r["rejected"], r["chosen"])
        margin = (indifferent_gold(r["prompt"], first) - indifferent_gold(r["prompt"], second)) / temperature
        p_first = 1.0 / (1.0 + math.exp(-max(min(margin, 60.0), -60.0)))
        chosen, rejected = (first, second) if rng.random() < p_first else (second, first)
        out.append({"prompt": r["prompt"], "chosen": chosen, "rejected": rejected})
    return out


def words(text: str) -> int:
    return len(text.split())


def length_correlated(records: list[dict], seed: int, keep_shorter: float = KEEP_SHORTER) -> list[dict]:
    """The pairs kept: every pair whose chosen answer is at least as long (in words) as its rejected one, and a
    shorter-chosen pair with probability ``keep_shorter`` (draws seeded by ``seed``)."""
    rng = random.Random(f"{NAME}-selection-{seed}")
    kept = []
    for r in records:
        draw = rng.random()  # one draw a pair, kept or not, so a pair's fate is independent of the others'
        if words(r["chosen"]) >= words(r["rejected"]) or draw < keep_shorter:
            kept.append(r)
    return kept


def pearson(x: list[float], y: list[float]) -> float:
    """The sample correlation of ``x`` and ``y`` (NaN when either is constant)."""
    n = len(x)
    if n != len(y) or n < 2:
        raise ValueError(f"need two equally long lists of at least 2 values, got {len(x)} and {len(y)}")
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def length_preference(samples) -> dict[str, float]:
    """Over the well-formed samples of a read: the correlation of the reward model's score (``proxy``) and of
    the gold with the length in tokens (None where undefined: fewer than 2 samples, or a constant), and how many
    samples went in."""
    rows = [
        (float(p), float(g), float(n))
        for p, g, n, ok in zip(samples.proxy, samples.gold, samples.lengths, samples.valid, strict=True)
        if ok
    ]
    if len(rows) < 2:  # nothing to correlate (a barely trained policy at the smoke size): no figure
        proxy = gold = length = None
    else:
        proxy, gold, length = (list(c) for c in zip(*rows, strict=True))

    def correlation(score):
        r = pearson(score, length) if length is not None else float("nan")
        return None if math.isnan(r) else r

    return {
        "rm_length_correlation": correlation(proxy),
        "gold_length_correlation": correlation(gold),
        "samples": len(rows),
        "valid_rate": len(rows) / len(samples.valid),
    }


def run_seed(seed: int, args) -> dict:
    """One seed: the relabelled, selected pairs, the reward model, the read; cached and recorded."""
    root = args.out / f"seed-{seed}"
    done = root / f"{NAME}.json"
    kept = args.records / f"seed-{seed}.json" if args.records else None
    restore_record(done, kept)
    if done.is_file() or args.report_only:
        return json.loads(done.read_text()) if done.is_file() else {}
    from ppo_sweep import Meter

    from rlhfkit.engine.threads import set_num_threads

    set_num_threads()
    s, sa = cc.sizes_of(args, cc.SIZES), cc.shared_args(args)
    shared = cc.shared_view(sa)
    clock = time.process_time()
    pool = [json.loads(line) for line in (shared["pool"] / "pairs_train.jsonl").read_text().splitlines()]
    relabelled = relabel(pool, seed, shared["task"].annotator_temperature)
    selected = length_correlated(relabelled, seed)[: PAIRS[args.size]]
    if len(selected) < PAIRS[args.size]:
        raise SystemExit(f"the selection kept {len(selected)} pairs, fewer than {PAIRS[args.size]}")
    pairs = root / "pairs-length-correlated.jsonl"
    root.mkdir(parents=True, exist_ok=True)
    pairs.write_text("".join(json.dumps(r) + "\n" for r in selected))
    stage, rm = oq.reward_stage(root, "rm-length-correlated", shared, pairs, len(selected), seed, s, sa)
    meter = Meter({**stage, "task": IndifferentTask(shared["task"])}, s, seed)
    samples, prompts, repeats = meter.samples(meter.reference, final=True)
    record = {
        "seed": seed,
        "claim": NAME,
        "commit": args.commit,
        "pairs": len(selected),
        "chosen_longer_share": _longer_share(selected),
        "relabelled_chosen_longer_share": _longer_share(relabelled),
        "reward_model": rm,
        "prompts": len(prompts),
        "repeats": repeats,
        **length_preference(samples),
        "cpu_seconds": time.process_time() - clock,
    }
    return write_record(done, record, kept)


def _longer_share(records: list[dict]) -> float:
    """The share of the pairs of unequal length (in words) whose chosen answer is the longer one."""
    unequal = [r for r in records if words(r["chosen"]) != words(r["rejected"])]
    return sum(words(r["chosen"]) > words(r["rejected"]) for r in unequal) / max(len(unequal), 1)


def report(results: list[dict], plan_path: Path = PLAN) -> str:
    """The registered comparison: per-seed reward model − gold correlation, the exact p after Holm over the
    plan's ``central`` family (members without data at p = 1), and ``decide``'s verdict."""
    from rlhfkit.reporting.paired import Claim, decide, describe, holm, paired
    from rlhfkit.reporting.plan import load_plan

    have = sorted((r for r in results if r), key=lambda r: r["seed"])
    undefined = [
        r["seed"] for r in have if None in (r["rm_length_correlation"], r["gold_length_correlation"])
    ]
    if undefined:
        return f"{NAME}.premise: seeds {undefined}: a correlation is undefined (too few well-formed samples)"
    key, plan = f"{NAME}.premise", load_plan(plan_path)
    planned = plan.comparisons[key]
    if not have:
        return f"{key}: no seed has run"
    a = [r["gold_length_correlation"] for r in have]
    b = [r["rm_length_correlation"] for r in have]
    p = paired(a, b)
    members = plan.family_members()[cc.FAMILY]
    adjusted = dict(zip(members, holm([p.exact_p if m == key else 1.0 for m in members]), strict=True))
    word = decide(p, Claim(planned.direction, planned.margin), adjusted[key])
    note = "" if len(have) == planned.n else f" (the plan registers {planned.n}: not its test yet)"
    share = sum(r["chosen_longer_share"] for r in have) / len(have)
    return (
        f"{key}: b − a = ({planned.b}) − ({planned.a})\n"
        f"  seeds {have[0]['seed']}-{have[-1]['seed']}, n = {len(have)}{note}: {describe(p, 3)}\n"
        f"  a: {[round(x, 3) for x in a]}\n  b: {[round(x, 3) for x in b]}\n"
        f"  chosen longer in {share:.2f} of the selected pairs of unequal length (mean over seeds)\n"
        f"  Holm over '{cc.FAMILY}' (this comparison alone with data, the others at p = 1): "
        f"p = {adjusted[key]:.3g}; claimed direction {planned.direction:+d}: {word}"
    )


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=Path, required=True, help="central_claims.py's output folder (its shared stage)"
    )
    p.add_argument("--size", choices=("default", "smoke"), default="default")
    add_run_arguments(p, RECORDS)
    args = resolve_run_arguments(p.parse_args(argv), RECORDS)
    args.rollouts = None  # central_claims' sizes_of reads it; no PPO runs here
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [k for k in args.seeds if not (args.records and (args.records / f"seed-{k}.json").is_file())]
    if not args.report_only and todo:
        from rlhfkit.engine.threads import set_num_threads

        set_num_threads()
        oq.shared_stage(cc.shared_args(args), cc.sizes_of(args, cc.SIZES))  # once, before the seeds
        if args.jobs > 1 and len(todo) > 1:
            commit = ["--commit", args.commit] if args.commit else []
            if not seed_jobs(__file__, [*argv, *commit], todo, args.jobs):
                return 1
            args.report_only = True
    results = [run_seed(seed, args) for seed in args.seeds]
    if not args.no_report:
        print(report(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
