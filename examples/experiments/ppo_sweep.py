"""PPO on the built-in task at several values of one setting: the KL coefficient or the discount gamma.

Two claims of the classic RLHF chapter, one piece of code (``--sweep``):

- ``--sweep kl_coef`` (``kl_penalty.py``): the per-token reward is r_t = -beta * KL_t, plus the reward
  model's score at the last token; the KL coefficient beta trades reward for staying close to the SFT policy.
  PPO at beta in {0, 0.02, 0.05, 0.2}.
- ``--sweep gamma`` (``gamma.py``): with the score only at the last token, the return of token t is
  gamma^(T-t) * score (plus the discounted KL terms): gamma < 1 makes a score that comes sooner worth more, so
  it favours short answers (when the score is positive). PPO at gamma in {1, 0.99, 0.9}.
- ``--sweep lam`` (``gae_lambda_ppo.py``): GAE's lambda trades the critic's bias for the return's variance
  (``gae_lambda.py`` measures both for one fixed policy and critic); here, what that does to learning: PPO at
  lambda in {0, 0.5, 0.9, 0.95, 1}, gold and proxy along the runs.

For each seed: one SFT policy and one reward model, trained as ``temperature.py`` trains them (the quickstart's
tiny preset with 1,024 labelled pairs and 150 reward-model steps), shared by every PPO run of every sweep (a
run is named by its KL coefficient, gamma and lambda, so gamma = 1 of the gamma sweep and lambda = 0.95 of the
lambda sweep are kl_coef = 0.05 of the KL sweep, run once). Every ``--eval-every`` rollouts (PPO's evaluation hook: its own seeded RNG, nothing of
training changes) and for the SFT policy: one response at T = 0.7 to each of ``--eval-prompts`` held-out
prompts, the same sampling seed for every checkpoint, measured for gold (the task's annotators'
criterion), proxy (the reward model), KL to the SFT policy (k1, nats per response), length, validity and
the share of responses that end with the stop token. The training figures of every rollout (proxy score,
KL, response length) come from the run's ``metrics.jsonl``.

Writes ``OUT/<sweep>.md`` (means ± sd over seeds), ``OUT/<sweep>_rows.csv`` (per seed and checkpoint),
``OUT/<sweep>_train.csv`` (per seed and rollout) and ``OUT/<sweep>.png``. A finished stage or run is reused
(``--overwrite`` reruns them)::

    python examples/experiments/kl_penalty.py --out runs/ppo_sweep   # 3 seeds, two at a time
    python examples/experiments/gamma.py --out runs/ppo_sweep        # reuses the SFT policies, reward models
    python examples/experiments/gae_lambda_ppo.py --out runs/ppo_sweep   # the same, for lambda
    python examples/experiments/ppo_sweep.py --sweep gamma --out runs/ppo_sweep --report-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from rlhfkit.rollout.evaluate import prompt_standard_error

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stages and report beside this script
from ppo_sweep_report import report  # noqa: E402
from temperature import (  # noqa: E402
    SIZES,
    Sizes,
    add_size_arguments,
    ppo_config,
    sizes_argv,
    sizes_of,
    train_sft_and_reward,
)

SWEEPS = {"kl_coef": (0.0, 0.02, 0.05, 0.2), "gamma": (1.0, 0.99, 0.9), "lam": (0.0, 0.5, 0.9, 0.95, 1.0)}
BASE = {
    "kl_coef": 0.05,
    "gamma": 1.0,
    "lam": 0.95,
}  # the library's defaults; the other settings of each sweep
BOUNDS = {"kl_coef": (0.0, float("inf")), "gamma": (0.0, 1.0), "lam": (0.0, 1.0)}
EVAL_TEMPERATURE = 0.7  # PPO's sampling temperature, the quickstart's
TRAIN_KEYS = ("score/mean", "kl/mean", "response_length/mean")  # from metrics.jsonl, every rollout


def runs_of(sweep: str, values) -> list[dict]:
    """The PPO runs of a sweep: ``BASE`` with the swept setting at each value."""
    return [{**BASE, sweep: float(v)} for v in values]


def run_name(run: dict) -> str:
    """``kl0.05-gamma1``; lambda is named only away from its default (the runs of the first two sweeps keep
    their names)."""
    lam = run.get("lam", BASE["lam"])
    return f"kl{run['kl_coef']:g}-gamma{run['gamma']:g}" + ("" if lam == BASE["lam"] else f"-lam{lam:g}")


class Meter:
    """Gold, proxy and KL of a policy on the held-out prompts at T = 0.7 (one row per measurement).

    Two reads. Along a run (``final=False``): one response to each of the first ``s.eval_prompts`` held-out
    prompts, for the curves. A final policy (``final=True``; the SFT policy too, as every paired comparison
    reads finals against it): ``s.final_samples`` responses to each of the first ``s.final_prompts`` held-out
    prompts (all of them by default), with the evaluation's standard error beside each mean: the sd of the
    per-prompt means over sqrt(prompts), the prompt being the unit that repeats (``gold_se``, ``proxy_se``).
    Every read of a seed uses the same sampling seed, so two policies are compared on the same random stream.
    """

    def __init__(self, stage: dict, s: Sizes, seed: int):
        from rlhfkit.data import TokenLimits, prepare_examples
        from rlhfkit.models import load_causal_lm, load_scalar_model, load_tokenizer

        self.stage, self.sizes, self.seed = stage, s, seed
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

    def samples(self, policy, final: bool = False, exact_kl: bool = False):
        """The read's ``PolicySamples`` (each prompt's samples side by side) and ``(prompts, repeats)``;
        ``exact_kl``: with the exact KL to the SFT policy as well (``sample_and_score``'s ``kl_exact``)."""
        import torch

        from rlhfkit.rollout.evaluate import sample_and_score

        prompts = self.final_examples if final else self.examples
        repeats = self.sizes.final_samples if final else 1
        torch.manual_seed(1000 * self.seed + 7)  # the same sampling seed for every checkpoint
        samples = sample_and_score(
            policy,
            self.tokenizer,
            [ex for ex in prompts for _ in range(repeats)],  # each prompt's samples side by side
            temperature=EVAL_TEMPERATURE,
            max_new_tokens=self.sizes.response_length,
            reward_model=self.reward_model,
            reference=self.reference,
            gold_score=self.stage["task"].gold_score,
            is_valid=self.stage["task"].is_valid,
            exact_kl=exact_kl,
        )
        return samples, prompts, repeats

    def measure(self, policy, final: bool = False) -> dict[str, float]:
        samples, prompts, repeats = self.samples(policy, final)
        s = samples.summary()
        figures = {
            "gold": s["gold_mean"],
            "proxy": s["proxy_mean"],
            "kl": s["kl_mean"],
            "length": s["response_length_mean"],
            "ended": s["ended_rate"],
            "valid_rate": s.get("valid_rate"),
        }
        if final:
            figures.update(
                gold_se=prompt_standard_error(samples.gold, repeats),
                proxy_se=prompt_standard_error(samples.proxy, repeats),
                eval_prompts=len(prompts),
                eval_samples=repeats,
            )
        return figures

    def measure_saved(self, folder: Path) -> dict[str, float]:
        """The final read (``measure(..., final=True)``) of the policy saved in ``folder``."""
        from rlhfkit.models import load_causal_lm

        policy = load_causal_lm(str(folder), tokenizer=self.tokenizer, frozen=True).eval()
        return self.measure(policy, final=True)


def train_rows(folder: Path) -> list[dict]:
    """The training figures of every rollout of a finished run (``metrics.jsonl``)."""
    rows = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if all(k in record for k in TRAIN_KEYS):
            rows.append({"rollout": record["step"], **{k.split("/")[0]: record[k] for k in TRAIN_KEYS}})
    return rows


def run_seed(seed: int, s: Sizes, sweep: str, values, args) -> dict:
    """The SFT policy, reward model and PPO runs of one seed; each run's rows cached in its folder."""
    root = args.out / f"seed-{seed}"
    stage = train_sft_and_reward(root, seed, s, args)
    meter, sft = sft_figures(root, stage, seed, s, args)
    out = {"seed": seed, "rm_accuracy": stage["rm_accuracy"], "sft": sft, "runs": {}}
    for run in runs_of(sweep, values):
        meter, out["runs"][run_name(run)] = ppo_run(root / run_name(run), stage, meter, seed, s, run, args)
    return out


def sft_figures(root: Path, stage: dict, seed: int, s: Sizes, args) -> tuple:
    """``(meter or None, the SFT policy's figures)``, cached in ``root/sft_meter.json``."""
    cache = root / "sft_meter.json"
    if cache.is_file() and not args.overwrite:
        return None, json.loads(cache.read_text())
    meter = Meter(stage, s, seed)
    sft = meter.measure(meter.reference, final=True)
    cache.write_text(json.dumps(sft, indent=1))
    return meter, sft


def ppo_run(folder: Path, stage: dict, meter, seed: int, s: Sizes, run: dict, args, refresh=None, **extra):
    """One PPO run (``run``: its KL coefficient, gamma and lambda; ``extra``: other dotted keys, e.g. another
    starting policy) measured every ``s.eval_every`` rollouts; ``(meter, record)``, the record cached in
    ``folder/sweep_rows.json`` (reused unless ``args.overwrite``). ``meter``: a :class:`Meter` or None (made
    here when a run has to be trained). ``refresh``: None, or ``meter -> hook`` for
    ``OnlineHooks.refresh_reward_model`` (the hook re-points the meter's proxy at the refreshed reward model, so
    such a run needs a meter of its own)."""
    from rlhfkit.trainers import online

    cache = folder / "sweep_rows.json"
    if cache.is_file() and not args.overwrite:
        return meter, json.loads(cache.read_text())
    meter = meter or Meter(stage, s, seed)
    print(f"seed {seed}: PPO {run} {extra or ''}, {s.rollouts} rollouts", flush=True)
    evals: list[dict] = []
    settings = {"online.gamma": run["gamma"], "online.lam": run.get("lam", BASE["lam"]), **extra}
    cfg = ppo_config(folder, seed, stage, s, s.rollouts, EVAL_TEMPERATURE, run["kl_coef"], **settings)

    def hook(policy, step):  # the last rollout is the final read (``extra`` may set train.max_steps)
        figures = meter.measure(policy, final=step == cfg.train.max_steps)
        evals.append({"rollout": step, **figures})
        return {"eval/gold/mean": figures["gold"], "eval/score/mean": figures["proxy"]}

    hooks = online.OnlineHooks(evaluate=hook, evaluate_at_start=False)
    if refresh is not None:
        hooks.refresh_reward_model = refresh(meter)
    online.train(cfg, overwrite=True, hooks=hooks)
    record = {**BASE, **run, "eval": evals, "train": train_rows(folder)}
    cache.write_text(json.dumps(record, indent=1))
    return meter, record


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sweep", choices=sorted(SWEEPS), required=True, help="the setting PPO is run at")
    p.add_argument(
        "--values",
        type=float,
        nargs="+",
        help="default: kl_coef 0 0.02 0.05 0.2, gamma 1 0.99 0.9, lam 0 0.5 0.9 0.95 1",
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (the sweeps can share it)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    add_size_arguments(p, SIZES)  # the temperature experiment's sizes
    p.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="seeds run at once, each in its own one-thread process (default: 2, or 1 on a 1-core machine)",
    )
    p.add_argument("--overwrite", action="store_true", help="rerun finished stages and runs")
    p.add_argument("--report-only", action="store_true", help="only the table and plot from OUT")
    p.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.values = tuple(args.values or SWEEPS[args.sweep])
    bounds = BOUNDS[args.sweep]
    if any(not bounds[0] <= v <= bounds[1] for v in args.values):
        p.error(f"--values of {args.sweep} must lie in [{bounds[0]:g}, {bounds[1]:g}]")
    return args


def child_argv(args, seed: int) -> list[str]:
    argv = ["--sweep", args.sweep, "--values", *map(str, args.values), "--out", str(args.out)]
    return argv + ["--seeds", str(seed), "--size", args.size, "--no-report", *sizes_argv(args)]


def main(argv=None) -> int:
    from rlhfkit.engine.threads import set_num_threads

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    s = sizes_of(args)
    results = []
    if args.report_only:
        pass
    elif args.jobs > 1 and len(args.seeds) > 1:
        env = {**os.environ, "RLHFKIT_NUM_THREADS": os.environ.get("RLHFKIT_NUM_THREADS", "1")}
        pending, running = list(args.seeds), []
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
        results = [run_seed(seed, s, args.sweep, args.values, args) for seed in args.seeds]
    if not args.no_report:
        if not results:  # every run is cached: read the seeds back
            args.overwrite = False
            results = [collect(args.out / f"seed-{seed}", seed, args) for seed in args.seeds]
            results = [r for r in results if r is not None]
        report(args.out, args.sweep, results, base=BASE[args.sweep])
    return 0


def collect(root: Path, seed: int, args) -> dict | None:
    """A seed's cached measurements, or None when it has not finished."""
    sft = root / "sft_meter.json"
    runs = {run_name(r): root / run_name(r) / "sweep_rows.json" for r in runs_of(args.sweep, args.values)}
    if not sft.is_file() or not all(p.is_file() for p in runs.values()):
        return None
    summary = json.loads((root / "reward" / "summary.json").read_text())
    return {
        "seed": seed,
        "rm_accuracy": summary.get("heldout_gold_accuracy"),
        "sft": json.loads(sft.read_text()),
        "runs": {name: json.loads(p.read_text()) for name, p in runs.items()},
    }


if __name__ == "__main__":
    sys.exit(main())
