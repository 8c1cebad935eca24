"""What PPO does to the output distribution: gold, proxy and sharpness of SFT and PPO policies at 0 <= T <= 1.

The claim tested (a common account of classic RLHF): after PPO the output distribution is sharper
(mode-seeking), less diverse, and the policy is at its best decoded greedily (T = 0), while an SFT policy is
best sampled at about T = 0.7. On the built-in ``reviews`` task, for each seed:

1. an SFT policy and a reward model, as the quickstart trains them (fewer pairs and reward-model steps);
2. three PPO runs from that SFT policy against that reward model (the quickstart's PPO otherwise):
   ``ppo`` (trained at T = 0.7, KL coefficient 0.1), ``ppo-T1`` (trained at T = 1.0) and ``ppo-kl/4``
   (KL coefficient 0.025, twice as many rollouts: the run that goes furthest from the SFT policy);
3. every ``--eval-every`` rollouts (PPO's evaluation hook: its own seeded RNG, nothing of training changes):
   one response to each of ``--eval-prompts`` held-out prompts at each temperature (0 = greedy; every cell with
   the same sampling seed); at a run's last rollout and for the SFT policy, the final read instead:
   ``--final-samples`` responses to each of the ``--final-prompts`` held-out prompts (one when greedy), with
   the standard errors ``gold_se`` and ``proxy_se`` (the prompt as the unit); measured with
   :func:`rlhfkit.rollout.sharpness.measure_policy`: gold (the task's annotators' criterion), proxy (the
   reward model PPO optimised), validity, length, distinct responses, KL to the SFT policy (k1, nats per
   response, at the sampling temperature), and on the tokens of those responses the per-token entropy and
   top-token probability of the policy's own distribution (T = 1) and of the SFT policy's, and how often
   their most likely tokens agree.

Writes ``OUT/rows.csv`` (one row per seed, run, rollout and temperature), ``OUT/table.csv`` (means and
standard deviations over seeds), ``OUT/table.md`` and ``OUT/temperature.png``. Every seed's stages live in
``OUT/seed-N/``; a finished stage is reused (``--overwrite`` reruns them)::

    python examples/experiments/temperature.py --out runs/temperature             # 3 seeds, two at a time
    python examples/experiments/temperature.py --out runs/temperature --jobs 1    # one seed after another
    python examples/experiments/temperature.py --out runs/temperature --report-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from rlhfkit.config import config_from

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the report beside this script
from temperature_report import TEMPERATURES, TERMS, TRAIN_TEMPERATURE, report, terms_report  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """How big each stage is (the defaults: the quickstart's tiny preset, fewer pairs and reward steps)."""

    model: str = "tiny"
    sft_steps: int = 300
    sft_batch: int = 32
    sft_lr: float = 3e-3
    pairs: int = 1024
    rm_steps: int = 150
    rm_batch: int = 64
    rm_lr: float = 5e-4
    ppo_batch: int = 32
    ppo_lr: float = 1e-4
    response_length: int = 48
    rollouts: int = 40
    eval_every: int = 10
    eval_prompts: int = 128
    final_prompts: int = 0  # a final policy's evaluation: this many held-out prompts (0: every one) ...
    final_samples: int = 4  # ... with this many samples each


SIZES = {
    "default": Sizes(),
    "smoke": Sizes(
        sft_steps=4,
        sft_batch=8,
        pairs=16,
        rm_steps=2,
        rm_batch=8,
        ppo_batch=4,
        response_length=12,
        rollouts=2,
        eval_every=2,
        eval_prompts=6,
        final_prompts=6,
        final_samples=2,
    ),
}


def runs_of(sizes: Sizes) -> dict[str, dict]:
    """The PPO variants: training temperature, KL coefficient, rollouts."""
    return {
        "ppo": {"temperature": TRAIN_TEMPERATURE["ppo"], "kl_coef": 0.1, "rollouts": sizes.rollouts},
        "ppo-T1": {"temperature": TRAIN_TEMPERATURE["ppo-T1"], "kl_coef": 0.1, "rollouts": sizes.rollouts},
        "ppo-kl/4": {
            "temperature": TRAIN_TEMPERATURE["ppo-kl/4"],
            "kl_coef": 0.025,
            "rollouts": 2 * sizes.rollouts,
        },
    }


def _done(folder: Path, args) -> bool:
    return (folder / "summary.json").is_file() and not args.overwrite


def train_sft_and_reward(root: Path, seed: int, s: Sizes, args) -> dict:
    """Task files, SFT policy, labelled pairs and reward model of one seed (the quickstart's stages 1-4)."""
    stage = train_sft(root, seed, s, args)
    pairs_dir = label(root / "pairs", stage, seed, s, args)
    train_reward_model(
        root / "reward",
        stage["sft"],
        pairs_dir / "pairs_train.jsonl",
        pairs_dir / "pairs_eval.jsonl",
        seed,
        s,
        args,
    )
    rm_summary = json.loads((root / "reward" / "summary.json").read_text())
    return {
        **stage,
        "reward": root / "reward" / "final",
        "rm_accuracy": rm_summary.get("heldout_gold_accuracy"),
    }


def train_sft(root: Path, seed: int, s: Sizes, args) -> dict:
    """Task files and SFT policy of one seed (the quickstart's stages 1-2): ``task``, ``files``, ``sft``."""
    from rlhfkit.quickstart.stages import sft_stage
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files
    from rlhfkit.trainers import sft

    task = get_task("reviews", seed=seed)
    files = prepare_task_files(task, root / "task", s.model, num_sft_eval=min(256, 4 * s.eval_prompts))
    if not _done(root / "sft", args):
        print(f"seed {seed}: SFT, {s.sft_steps} steps", flush=True)
        sft.train(
            config_from(
                "sft",
                root / "sft",
                {
                    **_common(seed, s),
                    **sft_stage(files, s.sft_steps, s.sft_batch, s.sft_lr),
                    "train.eval_steps": s.sft_steps,
                    "train.log_steps": 10,
                },
            ),
            overwrite=True,
        )
    return {"task": task, "files": files, "sft": root / "sft" / "final"}


def _common(seed: int, s: Sizes) -> dict:
    return {"seed": seed, "data.max_prompt_length": 32, "data.max_length": 32 + s.response_length}


def label(pairs_dir: Path, stage: dict, seed: int, s: Sizes, args, num_eval_pairs: int | None = None) -> Path:
    """``s.pairs`` training pairs (and ``num_eval_pairs``, default a quarter as many, held out) sampled from the
    SFT policy and labelled by the task's annotators, in ``pairs_dir`` (kept when already there)."""
    from rlhfkit.rollout.pairs import label_pairs

    if args.overwrite or not (pairs_dir / "pairs_train.jsonl").is_file():
        print(f"seed {seed}: {s.pairs} labelled pairs", flush=True)
        label_pairs(
            str(stage["sft"]),
            pairs_dir,
            task=stage["task"].name,
            task_seed=seed,
            num_pairs=s.pairs,
            num_eval_pairs=max(16, s.pairs // 4) if num_eval_pairs is None else num_eval_pairs,
            seed=seed,
            max_new_tokens=s.response_length,
            overwrite=True,
        )
    return pairs_dir


def train_reward_model(
    folder: Path, sft_dir: Path, train_file: Path, eval_file: Path, seed: int, s: Sizes, args
) -> None:
    """A reward model from the SFT policy on ``train_file`` (``s.rm_steps`` steps), unless ``folder`` holds one."""
    from rlhfkit.trainers import reward

    if _done(folder, args):
        return
    print(f"seed {seed}: reward model on {train_file.name}, {s.rm_steps} steps", flush=True)
    reward.train(
        config_from(
            "reward",
            folder,
            {
                **_common(seed, s),
                "model.name_or_path": sft_dir,
                "data.train_file": train_file,
                "data.eval_file": eval_file,
                "train.max_steps": s.rm_steps,
                "train.batch_size": s.rm_batch,
                "train.learning_rate": s.rm_lr,
                "train.weight_decay": 0.1,
                "train.warmup_steps": max(1, s.rm_steps // 15),
                "train.lr_schedule": "linear",
                "train.save_steps": s.rm_steps,
                "train.eval_steps": s.rm_steps,
                "train.log_steps": 10,
            },
        ),
        overwrite=True,
    )


def final_repeats(s: Sizes, temperature: float) -> int:
    """Samples of each prompt in a final read: ``s.final_samples``, one when greedy (it repeats itself)."""
    return s.final_samples if temperature > 0 else 1


class Evaluator:
    """Measures a policy at every temperature on the held-out prompts; collects one row per temperature."""

    def __init__(self, stage: dict, s: Sizes, seed: int, temperatures):
        from rlhfkit.data import TokenLimits, prepare_examples
        from rlhfkit.models import load_causal_lm, load_scalar_model, load_tokenizer

        self.stage, self.sizes, self.seed, self.temperatures = stage, s, seed, temperatures
        self.tokenizer = load_tokenizer(str(stage["sft"]))
        self.reference = load_causal_lm(str(stage["sft"]), tokenizer=self.tokenizer, frozen=True).eval()
        self.reward_model = load_scalar_model(
            str(stage["reward"]), tokenizer=self.tokenizer, frozen=True
        ).eval()
        examples = prepare_examples(
            str(stage["files"]["prompts_eval"]), "prompts", self.tokenizer, TokenLimits(32, None, "left")
        )
        self.examples = examples[: s.eval_prompts]
        self.final_examples = examples[: s.final_prompts] if s.final_prompts else examples

    def measure(self, policy, run: str, rollout: int, final: bool = False) -> list[dict]:
        """Rows of one checkpoint. ``final``: the read of a final policy (and of the SFT policy): ``final_samples``
        responses to each of the ``final_prompts`` held-out prompts (one when greedy: it repeats itself), with the
        standard errors ``gold_se`` and ``proxy_se``; otherwise one response to each of ``eval_prompts``."""
        import torch

        from rlhfkit.rollout.sharpness import measure_policy

        rows = []
        for i, temperature in enumerate(self.temperatures):
            torch.manual_seed(1000 * self.seed + i)  # the same sampling seed for every checkpoint
            samples = final_repeats(self.sizes, temperature) if final else 1
            figures = measure_policy(
                policy,
                self.tokenizer,
                self.final_examples if final else self.examples,
                samples_per_prompt=samples,
                temperature=temperature,
                max_new_tokens=self.sizes.response_length,
                reference=self.reference,
                reward_model=self.reward_model,
                gold_score=self.stage["task"].gold_score,
                is_valid=self.stage["task"].is_valid,
            )
            rows.append(
                {"seed": self.seed, "run": run, "rollout": rollout, "temperature": temperature, **figures}
            )
            if final:
                rows[-1].update(eval_prompts=len(self.final_examples), eval_samples=samples)
        return rows


def ppo_config(
    folder: Path,
    seed: int,
    stage: dict,
    s: Sizes,
    rollouts: int,
    temperature: float,
    kl_coef: float,
    *,
    kind: str = "ppo",
    **extra,
):
    """The PPO run of an experiment: the quickstart's tiny PPO from this seed's SFT policy and reward model
    (``stage``), at the given length, sampling temperature and KL coefficient; ``extra``: other dotted keys;
    ``kind``: the command (``grpo``: the same run without a critic, ``train.batch_size`` prompts in groups)."""
    return config_from(
        kind,
        folder,
        {
            "seed": seed,
            "model.name_or_path": stage["sft"],
            "data.train_file": stage["files"]["prompts_train"],
            "data.max_prompt_length": 32,
            "online.reward_model": stage["reward"],
            "online.response_length": s.response_length,
            "online.temperature": temperature,
            "online.kl_coef": kl_coef,
            "train.max_steps": rollouts,
            "train.batch_size": s.ppo_batch,
            "train.learning_rate": s.ppo_lr,
            "train.lr_schedule": "linear",
            "train.save_steps": rollouts,
            "train.eval_steps": s.eval_every,
            "train.log_steps": 1,
            **extra,
        },
    )


def run_seed(seed: int, s: Sizes, args) -> list[dict]:
    """Every stage of one seed; its rows (cached in ``OUT/seed-N/rows.json``)."""
    from rlhfkit.trainers import online

    root = args.out / f"seed-{seed}"
    cache = root / "rows.json"
    if cache.is_file() and not args.overwrite:
        return json.loads(cache.read_text())
    stage = train_sft_and_reward(root, seed, s, args)
    ev = Evaluator(stage, s, seed, args.temperatures)
    print(f"seed {seed}: the SFT policy at T = {args.temperatures}", flush=True)
    rows = ev.measure(ev.reference, "sft", 0, final=True)
    for name, run in runs_of(s).items():
        folder = root / name.replace("/", "-")
        print(f"seed {seed}: {name} ({run}), measured every {s.eval_every} rollouts", flush=True)

        def hook(policy, step, name=name, run=run):
            measured = ev.measure(policy, name, step, final=step == run["rollouts"])
            rows.extend(measured)
            at_train = next(r for r in measured if r["temperature"] == run["temperature"])
            return {"eval/gold/mean": at_train["gold"], "eval/score/mean": at_train["proxy"]}

        cfg = ppo_config(folder, seed, stage, s, run["rollouts"], run["temperature"], run["kl_coef"])
        online.train(cfg, overwrite=True, hooks=online.OnlineHooks(evaluate=hook, evaluate_at_start=False))
    info = {"seed": seed, "rm_accuracy": stage["rm_accuracy"]}
    for r in rows:
        r["rm_accuracy"] = info["rm_accuracy"]
    cache.write_text(json.dumps(rows, indent=1))
    return rows


def gold_terms_of_finals(out: Path, s: Sizes, temperatures) -> list[dict]:
    """The gold score term by term (the task's five terms, means over valid responses), the valid rate and the
    sentences per response of the SFT policy and each run's final policy at every temperature, sampled as
    :class:`Evaluator`'s final read samples; one row per seed, policy and temperature (cached in
    ``seed-N/terms.json``)."""
    import torch

    from rlhfkit.data import TokenLimits, prepare_examples
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.rollout.evaluate import sample_and_score
    from rlhfkit.tasks.reviews import gold_terms, parse_response

    rows = []
    for root in sorted(out.glob("seed-*")):
        cache = root / "terms.json"  # written once the seed has finished (its rows.json exists)
        if cache.is_file():
            rows += json.loads(cache.read_text())
            continue
        seed, mine = int(root.name.split("-")[1]), []
        tokenizer = load_tokenizer(str(root / "sft" / "final"))
        examples = prepare_examples(
            str(root / "task" / "prompts_eval.jsonl"), "prompts", tokenizer, TokenLimits(32, None, "left")
        )
        examples = examples[: s.final_prompts] if s.final_prompts else examples
        policies = {"sft": (root / "sft" / "final", 0)}
        policies.update(
            {n: (root / n.replace("/", "-") / "final", r["rollouts"]) for n, r in runs_of(s).items()}
        )
        for name, (folder, rollout) in policies.items():
            if not folder.is_dir():
                continue
            policy = load_causal_lm(str(folder), tokenizer=tokenizer, frozen=True).eval()
            for i, t in enumerate(temperatures):
                torch.manual_seed(1000 * seed + i)
                repeats = final_repeats(s, t)
                samples = sample_and_score(
                    policy,
                    tokenizer,
                    [ex for ex in examples for _ in range(repeats)],
                    temperature=t or 1.0,
                    greedy=t == 0,
                    max_new_tokens=s.response_length,
                )
                pairs = zip(samples.prompts, samples.responses, strict=True)
                valid = [
                    (gold_terms(p, r), parse_response(r)) for p, r in pairs if parse_response(r) is not None
                ]
                row = {"seed": seed, "run": name, "rollout": rollout, "temperature": t}
                row["valid_rate"] = len(valid) / max(len(samples.responses), 1)
                for term in TERMS:
                    row[term] = float(np.mean([getattr(g, term) for g, _ in valid])) if valid else None
                row["sentences"] = (
                    float(np.mean([len(sentences) for _, sentences in valid])) if valid else None
                )
                mine.append(row)
        if (root / "rows.json").is_file():
            cache.write_text(json.dumps(mine, indent=1))
        rows += mine
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES), help="0 = greedy")
    add_size_arguments(p)
    p.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="seeds run at once, each in its own one-thread process (default: 2, or 1 on a 1-core machine)",
    )
    p.add_argument("--overwrite", action="store_true", help="rerun finished stages")
    p.add_argument("--report-only", action="store_true", help="only the table and plot from OUT")
    p.add_argument(
        "--terms",
        action="store_true",
        help="also the gold score term by term of the final policies (terms.md)",
    )
    p.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if 0.7 not in args.temperatures or 0.0 not in args.temperatures:
        p.error("--temperatures must include 0 and 0.7 (the table compares greedy with T = 0.7)")
    if any(t < 0 for t in args.temperatures):
        p.error("--temperatures must be >= 0")
    return args


def add_size_arguments(p: argparse.ArgumentParser, sizes: dict[str, Sizes] | None = None) -> None:
    """``--size`` (one of ``sizes``, default this module's) and one option per :class:`Sizes` field, each
    overriding the chosen size (shared by the experiments that train the quickstart's stages)."""
    p.add_argument(
        "--size", choices=sorted(sizes or SIZES), default="default", help="smoke: seconds, for the tests"
    )
    for field, value in asdict(Sizes()).items():
        if field != "model":
            p.add_argument("--" + field.replace("_", "-"), type=type(value), help=f"default {value}")


def sizes_of(args, sizes: dict[str, Sizes] | None = None) -> Sizes:
    """The chosen size of ``sizes`` (default this module's) with the options given on the command line."""
    s = (sizes or SIZES)[args.size]
    return replace(s, **{k: getattr(args, k) for k in asdict(s) if getattr(args, k, None) is not None})


def sizes_argv(args, sizes: dict[str, Sizes] | None = None) -> list[str]:
    """A job's size options (exactly the parent's sizes) and ``--overwrite`` when the parent has it."""
    argv = []
    for field, value in asdict(sizes_of(args, sizes)).items():
        if field != "model":
            argv += ["--" + field.replace("_", "-"), str(value)]
    return argv + (["--overwrite"] if args.overwrite else [])


def child_argv(args, seed: int) -> list[str]:
    argv = ["--out", str(args.out), "--seeds", str(seed), "--size", args.size, "--no-report"]
    argv += ["--temperatures", *map(str, args.temperatures)]
    return argv + sizes_argv(args)


def main(argv=None) -> int:
    from rlhfkit.engine.threads import set_num_threads

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        s = sizes_of(args)
        if args.jobs > 1 and len(args.seeds) > 1:
            env = {**os.environ, "RLHFKIT_NUM_THREADS": os.environ.get("RLHFKIT_NUM_THREADS", "1")}
            pending = list(args.seeds)
            running: list[subprocess.Popen] = []
            while pending or running:
                while pending and len(running) < args.jobs:
                    cmd = [sys.executable, os.path.abspath(__file__), *child_argv(args, pending.pop(0))]
                    running.append(subprocess.Popen(cmd, env=env))
                running[0].wait()
                if running[0].returncode != 0:
                    print(f"a seed failed: {' '.join(running[0].args)}", file=sys.stderr)
                    return 1
                running.pop(0)
        else:
            set_num_threads()
            for seed in args.seeds:
                run_seed(seed, s, args)
    if not args.no_report:
        report(args.out, args.temperatures)
    if args.terms:
        terms = gold_terms_of_finals(args.out, sizes_of(args), args.temperatures)
        print(terms_report(args.out, terms), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
