"""The central claims of docs/experiments.md at 20 seeds, as registered in docs/experiments_plan.json (family
``central``): one resumable runner, one claim at a time.

``overopt-central`` (overoptimization and the KL defence). The reviews task; the SFT policy and the pool of labelled
pairs of ``overoptimization_quality.py`` (shared by every seed: trained once in ``OUT/shared``); per seed, that
script's 256-pair ("weak") reward model (the first 256 pairs of the pool, 150 steps at batch 32, lr 5e-4 linear);
then PPO from the SFT policy against it at kl_coef 0 and at kl_coef 0.05, at a CONSTANT learning rate of 1e-4,
16 prompts × 48 tokens a rollout at T = 0.7, for as many rollouts as the pilot below chose. Every checkpoint
(every ``--eval-every`` = 5 rollouts, the SFT policy at rollout 0 and the last rollout) is read with the 4-sample
read: 4 responses at T = 0.7 to each of the 384 held-out prompts, one evaluation seed per training seed. Per seed
and arm, the peak checkpoint (rollout > 0) is the one whose gold is highest on held-out prompts 0-191; the peak
gold and the end gold are then read on prompts 192-383, so the drop (peak − end) is not the largest of several
noisy reads. The registered comparisons (b − a, per seed):

- ``drop-kl0``: gold at the peak − gold at the end (prompts 192-383), kl_coef 0;
- ``defence-end``: end gold (all 384 prompts), kl_coef 0.05 − kl_coef 0;
- ``defence-drop``: peak − end gold (as in drop-kl0), kl_coef 0.05 − kl_coef 0.

``refresh-own-pairs`` (as overopt-central at kl_coef 0): ``refresh``, PPO with overoptimization_quality.py's
online refresh of the weak reward model every 5 rollouts (RefreshConfig's defaults: 128 pairs sampled from the
current policy and labelled by the task's annotators, 16 steps, the weak model's own pairs replayed), keeping the
pairs it labelled (``refresh-pairs.jsonl``); then ``own-pairs``, PPO without a refresh against an offline reward
model trained once as the weak one is (from the SFT policy, 1.5 epochs, at least 150 steps) on the weak one's 256
pairs followed by exactly the refresh's labelled pairs. Comparison ``end``: end gold (all 384 prompts), refresh −
own-pairs.

``overfit-central`` (as overopt-central at kl_coef 0): PPO against overfit_reward.py's two reward models, here
from the shared SFT policy and pool: ``usual``, on the pool's first 1,024 pairs as temperature.py trains it (150
steps of 64, lr 5e-4 linear, weight decay 0.1), and ``overfit``, on the first 768 of those for 450 steps of 32
without weight decay or the best checkpoint. Comparison ``end``: end gold (all 384 prompts), overfit − usual.

``grpo-ppo`` (as overopt-central at kl_coef 0.05, the same reward model, as many responses a rollout):
``ppo`` IS overopt-central's kl0.05 arm (PPO with a critic, 16 prompts a rollout): reused from
``OUT/seed-N/overopt-central`` when that claim has run, otherwise run there by the same function with the same
settings, so its figures are the same either way (start it once no overopt-central job runs that seed: two
jobs would train the one folder); ``grpo``, ``rlhfkit train grpo`` (``kind: grpo``: the group
baseline, no critic) in groups of ``GROUP`` = 4 responses to 4 prompts a rollout (16 responses, as PPO's 16; 320
over the 20 rollouts, as PPO's 320), everything else as the PPO arm. The KL stays where PPO puts it, -0.05 × k1
per token in the reward (each response's summed reward enters the group baseline): rlhfkit's config checks allow
that for grpo, and the KL-in-loss placement of Shao et al. 2024 would change a second thing at once. Comparison
``end``: end gold (all 384 prompts), grpo − ppo; no difference is claimed (direction 0, margin gold-0.1), so
it is no member of the Holm family: its 90% interval inside ±0.1 decides it, as on the page.

``reversed-k3-penalty`` (as overopt-central at kl_coef 0.05): ``k3``, the penalty ``online.kl_estimator=k3``
(r − 1 − log r, r = π_ref / π), and ``k3-reversed``, k3 with the ratio the other way round, r' − 1 − log r' with
r' = π / π_ref per token (:func:`kl_k3_reversed`: it estimates χ² − KL, biased). rlhfkit offers no such estimator,
so this runner patches it in: the k3-reversed arm's config says ``online.kl_estimator=k3``, and while that arm
trains (and when it resumes) :func:`reversed_k3_penalty` puts :func:`kl_k3_reversed` in the place of rlhfkit's k3,
restored after; the arm's record (``ARM.json`` and ``CLAIM.json``: ``penalty``) says so, and its logged ``kl`` is
the reversed estimate. Neither arm is overopt-central's kl0.05, whose penalty is k1. Every read of these arms also
records ``kl_exact``: the exact per-token KL(π(·|prefix) ‖ π_SFT(·|prefix)) over the whole vocabulary, both at
the read's T = 0.7, summed per response, mean over the 4 × 384 samples (the mean over the prompts of their
4-sample means), on the read's own samples (``sample_and_score(exact_kl=True)``; the other figures of a read are
unchanged by it). Comparison ``kl``: end exact KL, k3-reversed − k3. Choices the registration leaves open: both
arms keep the rest of overopt-central (k1 is not an arm: the registration names the two k3 forms), and the KL is
the read's sampling distribution at T = 0.7, as the read's k1 KL is.

The central claims orm-prm and length-indifferent are not in this runner.

The length ("long enough that gold peaks and falls at kl_coef 0 in a pilot") is fixed by a pilot: seeds 100 and
101 (not among the registered 0-19), kl_coef 0 only, ``PILOT_ROLLOUTS`` = 60 rollouts, every checkpoint read as
above, and a rule written down before the pilot ran (:func:`choose_rollouts`): the first checkpoint at which, in
every pilot seed, gold (all 384 prompts) is at least ``FALL`` = 0.2 below an earlier checkpoint's that was above
the SFT policy's. The pilot prints its curves and writes them with its choice to ``OUT/pilot.json`` (it exits 3,
and the runs do not start, when no checkpoint meets the rule); the runs then take that choice (``--rollouts``
overrides it)::

    RLHFKIT_NUM_THREADS=1 nice -n 19 python examples/experiments/central_claims.py --out runs/central --pilot

The pilot, measured 2026-12-07 with that command (at commit 4f50cc4, whose rule is this file's) on the 2-core
machine, one torch thread per seed, two seeds at a time, other jobs on the machine (25 minutes wall, not a
timing; CPU per seed: 54 s for the reward model, 300-339 s for the 60 rollouts and their 12 reads). Gold (all
384 prompts, 4 samples each) at rollouts 0, 5, 10, ..., 60, kl_coef 0:

- seed 100: 0.57 0.72 0.77 0.49 −0.30 −0.60 −0.85 −0.11 0.03 −0.18 −0.12 −0.33 −2.14 (KL 1.1 at 10, 33 at 60)
- seed 101: 0.61 0.81 0.87 0.71 −1.00 −0.83 −1.47 −1.65 −1.71 −1.67 −2.29 −2.81 −3.00 (KL 0.8 at 10, 46 at 60)

Both peak at rollout 10; at 15 they are 0.28 and 0.17 below it, at 20 more than 1 below: the rule chose 20
rollouts, the length of every run of the claims below.

Layout: ``OUT/shared`` (SFT policy, pool), ``OUT/seed-N/rm256`` (the reward model), ``OUT/seed-N/sft_meter.json``
(the SFT policy's read), ``OUT/seed-N/CLAIM/ARM`` (the PPO or GRPO run, a checkpoint every read),
``ARM-reads/rollout-NNNNN.json`` (each checkpoint's read), ``ARM.json`` (the arm's figures), and
``OUT/seed-N/CLAIM.json`` (the seed's figures of a claim, with the commit they were run at). A finished stage is
not rerun; an interrupted PPO run resumes from its newest checkpoint and reuses every read already written.
Every finished ``ARM.json`` and ``CLAIM.json`` is also copied to ``examples/experiments/records/central_claims/
seed-N/`` (``--records``), committed with the code: an arm or a claim recorded there is not run again, so the
20 seeds of a claim can be run over several sittings and machines (the records keep the commit each ran at).
``--report-only`` prints each registered comparison (rlhfkit.reporting.paired: ``paired``, ``describe``, and
``decide`` with Holm's correction over the plan's ``central`` family, members without data at p = 1)::

    RLHFKIT_NUM_THREADS=1 nice -n 19 python examples/experiments/central_claims.py --out runs/central   # seeds 0-19
    python examples/experiments/central_claims.py --out runs/central --report-only

``--claims`` picks claims (default: all five), e.g. the two that reuse a finished overopt-central run's seeds::

    RLHFKIT_NUM_THREADS=1 nice -n 19 python examples/experiments/central_claims.py --out runs/central \
        --claims grpo-ppo reversed-k3-penalty
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stages and the meter beside this script
import overoptimization_quality as oq  # noqa: E402
import ppo_arms  # noqa: E402
from ppo_sweep import Meter  # noqa: E402
from temperature import add_size_arguments, ppo_config, sizes_of  # noqa: E402

PLAN = Path(__file__).resolve().parents[2] / "docs" / "experiments_plan.json"
# finished claims and arms, committed
RECORDS = Path(__file__).resolve().parent / "records" / "central_claims"
FAMILY = "central"
SEEDS = list(range(20))  # the seeds the plan registers
PILOT_SEEDS, PILOT_ROLLOUTS = [100, 101], 60  # the pilot: kl_coef 0 only, seeds outside the registered ones
FALL = 0.2  # gold; the pilot's rule (:func:`choose_rollouts`): "fallen" is at least this far below the peak
SIZES = {
    "default": oq.SIZES["default"],  # its rollouts: the pilot's choice (OUT/pilot.json: 20)
    "smoke": replace(oq.SIZES["smoke"], rollouts=3),
}
WEAK_PAIRS = {"default": 256, "smoke": 8}  # the weak reward model's training pairs (the pool's first)
USUAL_PAIRS = {"default": 1024, "smoke": 8}  # overfit_reward.py's usual reward model: the pool's first 1,024
OVERFIT = {"default": (768, 450), "smoke": (6, 4)}  # its over-fitted one: the usual one's first pairs, steps
REFRESH_EVERY = {"default": 5, "smoke": 1}  # overoptimization_quality.py's --refresh-steps
GROUP = 4  # grpo-ppo: GRPO's responses per prompt, over a quarter of PPO's prompts per rollout
# Per claim: its arms in the order they run (name -> kl_coef; "refresh": the online refresh of the weak reward
# model; "reward": the reward model when not the weak one: "own-pairs", the offline one on the weak one's pairs
# and the refresh arm's labelled pairs, or overfit_reward.py's "usual" and "overfit"; "same_as": (claim, arm),
# another claim's arm that this one is, run and read once in that claim's folder; "kind": grpo, `train grpo` in
# groups of GROUP; "kl_estimator": the penalty's; "reversed_k3": that k3 penalty with its ratio reversed, patched
# in by :func:`reversed_k3_penalty`; "exact_kl": its reads record the exact KL to the SFT policy), and per
# registered comparison the (arm, figure) of a and of b.
CLAIMS = {
    "overopt-central": {
        "arms": {"kl0": {"kl_coef": 0.0}, "kl0.05": {"kl_coef": 0.05}},
        "comparisons": {
            "drop-kl0": (("kl0", "end_gold_read"), ("kl0", "peak_gold_read")),
            "defence-end": (("kl0", "end_gold"), ("kl0.05", "end_gold")),
            "defence-drop": (("kl0", "drop"), ("kl0.05", "drop")),
        },
    },
    "refresh-own-pairs": {
        "arms": {
            "refresh": {"kl_coef": 0.0, "refresh": True},
            "own-pairs": {"kl_coef": 0.0, "reward": "own-pairs"},
        },
        "comparisons": {"end": (("own-pairs", "end_gold"), ("refresh", "end_gold"))},
    },
    "overfit-central": {
        "arms": {
            "usual": {"kl_coef": 0.0, "reward": "usual"},
            "overfit": {"kl_coef": 0.0, "reward": "overfit"},
        },
        "comparisons": {"end": (("usual", "end_gold"), ("overfit", "end_gold"))},
    },
    "grpo-ppo": {
        "arms": {
            "ppo": {"same_as": ("overopt-central", "kl0.05")},
            "grpo": {"kl_coef": 0.05, "kind": "grpo"},
        },
        "comparisons": {"end": (("ppo", "end_gold"), ("grpo", "end_gold"))},
    },
    "reversed-k3-penalty": {
        "arms": {
            "k3": {"kl_coef": 0.05, "kl_estimator": "k3", "exact_kl": True},
            "k3-reversed": {"kl_coef": 0.05, "kl_estimator": "k3", "reversed_k3": True, "exact_kl": True},
        },
        "comparisons": {"kl": (("k3", "end_kl_exact"), ("k3-reversed", "end_kl_exact"))},
    },
}
ARMS = list(dict.fromkeys(name for claim in CLAIMS.values() for name in claim["arms"]))
REVERSED_K3 = (  # the record of an arm trained under reversed_k3_penalty
    "k3 with the ratio reversed, r' - 1 - log r' with r' = pi_theta / pi_ref per token (central_claims.py "
    "kl_k3_reversed), patched by the runner in the place of rlhfkit's k3 while the arm trained: the config's "
    "online.kl_estimator says k3, the penalty (and the logged kl) was the reversed k3"
)


def kl_k3_reversed(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """The k3-reversed arm's penalty per token: ``r' - 1 - log r'`` with the ratio REVERSED, ``r' = pi_theta /
    pi_ref`` (k3 takes ``pi_ref / pi_theta``; Schulman, "Approximating KL divergence", 2020). ``logprobs``,
    ``ref_logprobs``: ``(B, T)`` log pi_theta and log pi_ref of the sampled tokens -> ``(B, T)``.

    On samples from pi_theta it averages to chi^2(pi_theta || pi_ref) - KL(pi_theta || pi_ref), not the KL: a
    biased KL estimate (docs/experiments.md, "KL estimators"), which rlhfkit does not offer; the claim measures
    what training on it does. ``expm1``, as rlhfkit's k3: exactly 0 where the two log-probs agree, and >= 0."""
    log_r = logprobs - ref_logprobs  # (B, T) log pi_theta / pi_ref
    return torch.expm1(log_r) - log_r


@contextmanager
def reversed_k3_penalty():
    """While open, rlhfkit's ``k3`` KL estimator is :func:`kl_k3_reversed`: ``shape_rewards`` looks
    ``online.kl_estimator`` up in ``rlhfkit.algos.kl.KL_ESTIMATORS`` at each call, so a run configured with ``k3``
    in this process trains on (and logs) the reversed penalty. Restored on exit, also on an exception. Yields a
    namespace whose ``calls`` counts the penalty's calls, for the caller to check that the trainer used it."""
    from rlhfkit.algos import kl

    used = SimpleNamespace(calls=0)

    def patched(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
        used.calls += 1
        return kl_k3_reversed(logprobs, ref_logprobs)

    original = kl.KL_ESTIMATORS["k3"]
    kl.KL_ESTIMATORS["k3"] = patched
    try:
        yield used
    finally:
        kl.KL_ESTIMATORS["k3"] = original


def split_read(gold: list[float], repeats: int, select: int) -> dict[str, float]:
    """A read's gold: ``repeats`` consecutive samples per prompt; ``gold`` over every prompt, ``gold_select`` over
    the first ``select`` prompts (where the peak is chosen), ``gold_read`` over the rest (where it is read)."""
    if repeats < 1 or len(gold) % repeats:
        raise ValueError(f"{len(gold)} gold values are not {repeats} per prompt")
    prompts = [statistics.fmean(gold[i : i + repeats]) for i in range(0, len(gold), repeats)]
    if not 0 < select < len(prompts):
        raise ValueError(f"select {select} must leave prompts on both sides of {len(prompts)}")
    return {
        "gold": statistics.fmean(prompts),
        "gold_select": statistics.fmean(prompts[:select]),
        "gold_read": statistics.fmean(prompts[select:]),
    }


def read(meter: Meter, policy, exact_kl: bool = False) -> dict[str, float]:
    """The 4-sample read of ``policy`` (``meter``'s final read, its sampling seed), its gold split in two halves
    of the held-out prompts (:func:`split_read`), with proxy, KL (k1 summed per response), length and validity
    over every prompt; ``exact_kl``: also ``kl_exact``, the exact per-token KL to the SFT policy over the whole
    vocabulary summed per response, mean over every sample (the same samples: nothing else changes)."""
    from rlhfkit.rollout.evaluate import prompt_standard_error

    samples, prompts, repeats = meter.samples(policy, final=True, exact_kl=exact_kl)
    s, select = samples.summary(), len(prompts) // 2
    exact = {"kl_exact": s["kl_exact_mean"]} if exact_kl else {}
    return {
        **exact,
        **split_read(samples.gold, repeats, select),
        "gold_se": prompt_standard_error(samples.gold, repeats),
        "proxy": s["proxy_mean"],
        "kl": s["kl_mean"],
        "length": s["response_length_mean"],
        "valid_rate": s.get("valid_rate"),
        "prompts": len(prompts),
        "select_prompts": select,
        "samples": repeats,
    }


def peak_and_end(reads: list[dict]) -> dict[str, float]:
    """Of an arm's reads (rollout 0, the SFT policy, first): the peak checkpoint (rollout > 0, the first of the
    highest ``gold_select``), its gold and the end's on the other prompts (``gold_read``), their difference, and
    the end's gold and KL on every prompt (and its exact KL where the reads have it)."""
    reads = sorted(reads, key=lambda r: r["rollout"])
    trained = [r for r in reads if r["rollout"] > 0]
    if not trained:
        raise ValueError("no checkpoint after rollout 0")
    peak, end = max(trained, key=lambda r: r["gold_select"]), trained[-1]
    exact = {"end_kl_exact": end["kl_exact"]} if "kl_exact" in end else {}
    return {
        "peak_rollout": peak["rollout"],
        "peak_gold_read": peak["gold_read"],
        "end_gold_read": end["gold_read"],
        "drop": peak["gold_read"] - end["gold_read"],
        "end_gold": end["gold"],
        "end_kl": end["kl"],
        **exact,
    }


def choose_rollouts(curves: dict[int, list[dict]], fall: float = FALL) -> int | None:
    """The pilot's rule, fixed before it ran: the first checkpoint c at which, in every pilot seed, gold (the
    4-sample read, all held-out prompts; ``curves``: per seed, its reads) is at least ``fall`` below an earlier
    checkpoint's (0 < c' < c) that was above the SFT policy's (rollout 0): gold has peaked and fallen in every
    seed. None when no checkpoint of the pilot is such."""
    gold = {k: {r["rollout"]: r["gold"] for r in reads} for k, reads in curves.items()}
    common = sorted(set.intersection(*(set(g) for g in gold.values())) - {0})

    def fallen(g: dict, c: int) -> bool:
        return any(g[0] < g[e] and g[e] - g[c] >= fall for e in common if e < c)

    return next((c for c in common if all(fallen(g, c) for g in gold.values())), None)


def pilot_report(out: Path, results: list[dict], command: list[str]) -> tuple[str, int | None]:
    """The pilot's curves (gold per checkpoint and seed, kl_coef 0) and its choice, also in ``OUT/pilot.json``."""
    curves = {r["seed"]: r["arms"]["kl0"]["reads"] for r in results if "kl0" in r["arms"]}
    choice = choose_rollouts(curves) if curves else None
    record = {"command": command, "fall": FALL, "choice": choice}
    record["curves"] = {k: [(r["rollout"], r["gold"], r["kl"]) for r in reads] for k, reads in curves.items()}
    (out / "pilot.json").write_text(json.dumps(record, indent=1))
    lines = [
        f"pilot, kl_coef 0: gold (4-sample read, {len(curves)} seeds) at each checkpoint (rollout: gold, KL)"
    ]
    for k, points in record["curves"].items():
        lines.append(f"  seed {k}: " + "; ".join(f"{c}: {g:+.2f}, {kl:.1f}" for c, g, kl in points))
    lines.append(f"choice (gold {FALL} below an earlier peak above SFT in every seed): {choice} rollouts")
    return "\n".join(lines), choice


def checkpoints(rollouts: int, every: int) -> list[int]:
    """The rollouts read along a run: 0 (the SFT policy), every ``every``-th, and the last."""
    return sorted({0, *range(every, rollouts + 1, every), rollouts})


def arm_run(
    root: Path,
    name: str,
    kl_coef: float,
    stage: dict,
    sft: dict,
    seed: int,
    s,
    refresh: dict | None = None,
    kind: str = "ppo",
    exact_kl: bool = False,
    keys: dict | None = None,
    reversed_k3: bool = False,
    records: Path | None = None,
) -> dict:
    """One arm: PPO at ``kl_coef`` in ``root/name`` (resumed from its newest checkpoint when interrupted), each
    checkpoint read once (``root/name-reads``); the arm's figures, cached in ``root/name.json``. ``refresh``:
    ``{"every": K, "pairs": the reward model's training pairs}``, the online refresh of
    ``overoptimization_quality.py`` (its defaults); the pairs it labels are kept in ``root/name-pairs.jsonl``.
    ``kind``: the command (``grpo``); ``exact_kl``: each read records the exact KL too (:func:`read`); ``keys``:
    other dotted keys of the run (left out, the run is overopt-central's, key for key); ``reversed_k3``: the
    run, resumed too, trains under :func:`reversed_k3_penalty` (its config says k3), and its record says so
    (``penalty``). ``records``: the committed folder of ``root``'s finished arms: an arm recorded there is not
    run again, and a finished one is copied there."""
    from rlhfkit.engine.checkpoint import checkpoint_step, latest_checkpoint
    from rlhfkit.quickstart.pipeline import task_refresh
    from rlhfkit.trainers import online

    done, penalty = root / f"{name}.json", REVERSED_K3 if reversed_k3 else None
    kept = records / f"{name}.json" if records is not None else None
    if not done.is_file() and kept is not None and kept.is_file():  # finished in another sitting
        copy_into(kept, done)
    if done.is_file():
        record = json.loads(done.read_text())
        if (record["rollouts"], record["eval_every"]) != (s.rollouts, s.eval_every):
            raise SystemExit(
                f"{done} ran {record['rollouts']} rollouts read every {record['eval_every']}, not the asked "
                f"{s.rollouts} every {s.eval_every}: use another --out"
            )
        if record.get("penalty") != penalty:
            raise SystemExit(
                f"{done} was trained with the penalty {record.get('penalty')!r}, not {penalty!r}"
            )
        if kept is not None and not kept.is_file():  # finished here before records were kept
            copy_into(done, kept)
        return record
    reads_dir = root / f"{name}-reads"
    reads_dir.mkdir(parents=True, exist_ok=True)
    wanted = checkpoints(s.rollouts, s.eval_every)
    clock, meter, refresher = time.process_time(), None, None
    pairs_file = root / f"{name}-pairs.jsonl"
    hooks, settings = online.OnlineHooks(), {}
    if (
        refresh is not None
    ):  # the refresh re-points the meter's proxy at the refreshed reward model: a meter now
        meter = Meter(stage, s, seed)
        refresher = task_refresh(stage["task"], meter, refresh["pairs"], s, seed)
        hooks.refresh_reward_model, settings["refresh.every"] = refresher, refresh["every"]

    def path(step: int) -> Path:
        return reads_dir / f"rollout-{step:05d}.json"

    def hook(policy, step):
        nonlocal meter
        if step == 0:
            figures = sft
        elif path(step).is_file():
            figures = json.loads(path(step).read_text())
        else:
            meter = meter or Meter(stage, s, seed)
            figures = {"rollout": step, **read(meter, policy, exact_kl)}
            path(step).write_text(json.dumps(figures, indent=1))
        return {"eval/gold/mean": figures["gold"], "eval/score/mean": figures["proxy"]}

    hooks.evaluate = hook
    if not all(path(k).is_file() for k in wanted if k) or (refresh is not None and not pairs_file.is_file()):
        print(f"seed {seed}: PPO {name}, {s.rollouts} rollouts, read every {s.eval_every}", flush=True)
        cfg = ppo_config(
            root / name,
            seed,
            stage,
            s,
            s.rollouts,
            oq.EVAL_TEMPERATURE,
            kl_coef,
            kind=kind,
            **{
                "train.lr_schedule": "constant",
                "train.save_steps": s.eval_every,
                "train.keep_last_checkpoints": 2,
                **settings,
                **(keys or {}),
            },
        )
        newest = latest_checkpoint(root / name / "checkpoints")
        start = checkpoint_step(newest) if newest is not None else 0  # where the resume starts, or later
        with reversed_k3_penalty() if reversed_k3 else nullcontext() as patched:
            online.train(cfg, resume=True, hooks=hooks)
        if patched is not None and patched.calls == 0 and start < s.rollouts:
            raise SystemExit(
                f"{root / name}: the trainer never called the patched reversed k3, so it trained on plain k3; "
                "move that folder and its reads away"
            )
        if refresher is not None:  # its state (the pairs it labelled) comes back with a resumed checkpoint
            pairs_file.write_text("".join(json.dumps(r) + "\n" for r in refresher.state_dict()["pairs"]))
    reads = [{**sft, "rollout": 0}] + [json.loads(path(k).read_text()) for k in wanted if k]
    if exact_kl and any("kl_exact" not in r for r in reads[1:]):
        raise SystemExit(
            f"{reads_dir}: a read without the exact KL (kl_exact): move that folder away to reread"
        )
    record = {"kl_coef": kl_coef, "rollouts": s.rollouts, "eval_every": s.eval_every, "reads": reads}
    if kind != "ppo" or keys:
        record.update(kind=kind, keys=keys or {})
    if penalty is not None:
        record["penalty"] = penalty
    if refresh is not None:
        record.update(refresh_every=refresh["every"], refresh_labels=len(pairs_file.read_text().splitlines()))
    record.update(peak_and_end(reads), cpu_seconds=time.process_time() - clock)
    done.write_text(json.dumps(record, indent=1))
    if kept is not None:
        copy_into(done, kept)
    return record


def copy_into(source: Path, target: Path) -> None:
    """``source`` copied to ``target``, its folder made first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source.read_text())


def shared_args(args) -> argparse.Namespace:
    """What ``overoptimization_quality``'s stages read of the command line: its SFT policy and pool (task seed 0,
    no quickstart), the weak reward model's subset, 1.5 epochs of reward-model training, nothing overwritten."""
    qualities = sorted({WEAK_PAIRS[args.size], USUAL_PAIRS[args.size]})
    pairs, steps = OVERFIT[args.size]
    return argparse.Namespace(
        out=args.out, child=False, quickstart=None, task_seed=0, overwrite=False, qualities=qualities,
        size=args.size, rm_epochs=1.5, overfit_pairs=pairs, overfit_steps=steps, overfit_lr=5e-4,
    )  # fmt: skip


def shared_view(sa) -> dict:
    """The shared stage that :func:`main` trained (``oq.shared_stage``), read without writing anything: a seed's
    job runs beside others, and ``oq.shared_stage`` rewrites the task's files that they read."""
    from rlhfkit.tasks import get_task

    root = sa.out / "shared"
    files = {n: root / "task" / f"{n}.jsonl" for n in ("prompts_train", "prompts_eval")}
    pool = root / "pairs"
    subsets = {n: pool / f"pairs_train_{n}.jsonl" for n in sa.qualities}
    missing = [p for p in (*files.values(), root / "sft" / "final", *subsets.values()) if not p.exists()]
    if missing:
        raise SystemExit(f"the shared stage is not finished: {missing[0]} is missing")
    task = get_task("reviews", seed=sa.task_seed)
    return {"task": task, "files": files, "sft": root / "sft" / "final", "pool": pool, "subsets": subsets}


def run_seed(seed: int, args) -> list[dict]:
    """One seed's stages and the arms of ``args.arms`` in ``args.claims`` (``--report-only``: only what is
    cached); per claim that has run, its figures, also in ``OUT/seed-N/CLAIM.json``."""
    root = args.out / f"seed-{seed}"
    files = {claim: root / f"{claim}.json" for claim in args.claims}
    done = {claim: recorded(args, seed, claim) for claim in args.claims}
    if args.report_only or all(done.values()):
        return [done[c] or json.loads(f.read_text()) for c, f in files.items() if done[c] or f.is_file()]
    kept = args.records / f"seed-{seed}" if args.records is not None else None
    s, sa = sizes_of(args, SIZES), shared_args(args)
    shared = shared_view(sa)
    quality = WEAK_PAIRS[args.size]
    weak = shared["subsets"][quality]
    stage, rm = oq.reward_stage(root, f"rm{quality}", shared, weak, quality, seed, s, sa)
    sft_file = root / "sft_meter.json"  # the SFT policy's read (rollout 0 of every arm)
    if not sft_file.is_file():
        meter = Meter(stage, s, seed)
        sft_file.write_text(json.dumps({"rollout": 0, **read(meter, meter.reference)}, indent=1))
    sft = json.loads(sft_file.read_text())
    out = []
    for claim, figures_file in files.items():
        if done[claim]:
            out.append(done[claim])
            continue
        old = json.loads(figures_file.read_text()) if figures_file.is_file() else {}
        arms, rms = dict(old.get("arms", {})), {**old.get("reward_models", {}), "weak": rm}
        for name, arm in CLAIMS[claim]["arms"].items():
            if name not in args.arms:
                continue
            if "same_as" in arm:  # another claim's arm, run (or reused) in its folder as that claim runs it
                other, other_arm = arm["same_as"]
                kl_coef = CLAIMS[other]["arms"][other_arm]["kl_coef"]
                arms[name] = arm_run(
                    root / other, other_arm, kl_coef, stage, sft, seed, s, records=kept and kept / other
                )
                continue
            view, refresh = stage, None
            if arm.get("refresh"):
                refresh = {"every": REFRESH_EVERY[args.size], "pairs": weak}
            if arm.get("reward") == "own-pairs":
                view, rms["own-pairs"] = own_pairs_stage(root / claim, shared, weak, seed, s, sa)
            if arm.get("reward") in ("usual", "overfit"):
                view, rms[arm["reward"]] = overfit_stage(root / claim, arm["reward"], shared, seed, s, sa)
            kind, keys = arm.get("kind", "ppo"), {}
            if kind == "grpo":
                keys = grpo_keys(s)
            if "kl_estimator" in arm:
                keys["online.kl_estimator"] = arm["kl_estimator"]
            exact = arm.get("exact_kl", False)
            arms[name] = arm_run(
                root / claim, name, arm["kl_coef"], view, sft, seed, s, refresh, kind, exact, keys or None,
                reversed_k3=arm.get("reversed_k3", False), records=kept and kept / claim,
            )  # fmt: skip
        if not arms:  # none of its arms asked (the pilot's kl0 alone), none run before
            continue
        record = {"seed": seed, "claim": claim, "commit": args.commit, "reward_models": rms, "sft": sft}
        out.append({**record, "arms": arms})
        figures_file.write_text(json.dumps(out[-1], indent=1))
        if kept is not None:
            copy_into(figures_file, kept / figures_file.name)
    return out


def recorded(args, seed: int, claim: str) -> dict | None:
    """The committed record of a seed's claim (``RECORDS/seed-N/CLAIM.json``) when it holds every arm of the
    claim that ``args.arms`` asks for, else None."""
    if args.records is None:
        return None
    path = args.records / f"seed-{seed}" / f"{claim}.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    asked = [a for a in CLAIMS[claim]["arms"] if a in args.arms]
    return record if all(a in record["arms"] for a in asked) else None


def grpo_keys(s) -> dict:
    """grpo-ppo's GRPO arm: groups of ``GROUP`` responses to a quarter of PPO's prompts per rollout, so that
    both arms sample the same number of responses per rollout (PPO's ``s.ppo_batch``)."""
    if s.ppo_batch % GROUP:
        raise SystemExit(
            f"--ppo-batch {s.ppo_batch}: grpo-ppo needs a multiple of {GROUP} (groups of {GROUP})"
        )
    return {"train.batch_size": s.ppo_batch // GROUP, "online.group_size": GROUP}


def own_pairs_stage(root: Path, shared: dict, weak: Path, seed: int, s, sa) -> tuple[dict, dict]:
    """The offline reward model of refresh-own-pairs, trained once as the weak one is (1.5 epochs, at least
    ``s.rm_steps`` steps) on the weak one's pairs and, after them, every pair the refresh arm labelled
    (``root/refresh-pairs.jsonl``): the refresh's own pairs and labels, all at once from the start."""
    lines = weak.read_text().splitlines() + (root / "refresh-pairs.jsonl").read_text().splitlines()
    pairs = root / "own-pairs.jsonl"
    if not pairs.is_file():
        pairs.write_text("\n".join(lines) + "\n")
    return oq.reward_stage(root, "rm-own-pairs", shared, pairs, len(lines), seed, s, sa)


def overfit_stage(root: Path, kind: str, shared: dict, seed: int, s, sa) -> tuple[dict, dict]:
    """overfit_reward.py's reward models from the shared SFT policy: ``usual``, on the pool's first 1,024 pairs
    as ``temperature.py`` trains it (150 steps of 64, weight decay 0.1), or ``overfit``, on the first 768 of
    those for 450 steps of 32 without weight decay or the best checkpoint (``overfit_reward.overfit_settings``)."""
    from overfit_reward import overfit_settings
    from temperature import SIZES as RM_SIZES
    from temperature import train_reward_model

    usual, folder = shared["subsets"][USUAL_PAIRS[sa.size]], root / f"rm-{kind}"
    eval_file = shared["pool"] / "pairs_eval.jsonl"
    if kind == "usual":
        train_file = usual
        train_reward_model(folder, shared["sft"], usual, eval_file, seed, RM_SIZES[sa.size], sa)
    else:
        train_file = root / f"pairs_first{sa.overfit_pairs}.jsonl"
        if not train_file.is_file():
            train_file.write_text("\n".join(usual.read_text().splitlines()[: sa.overfit_pairs]) + "\n")
        stage = {"sft": shared["sft"], "pairs": {"eval": eval_file}}
        ppo_arms.train_reward_variant(
            folder, stage, train_file, seed, RM_SIZES[sa.size], sa, **overfit_settings(sa)
        )
    summary = json.loads((folder / "summary.json").read_text())
    rm = {
        "rm_accuracy": summary.get("heldout_gold_accuracy"),
        "labels": len(train_file.read_text().splitlines()),
    }
    return {**shared, "reward": folder / "final"}, rm


def values_of(results: list[dict], claim: str, cid: str) -> tuple[list[int], list[float], list[float]]:
    """The seeds that have both arms of a comparison, and a's and b's figure per seed, in seed order."""
    (arm_a, fig_a), (arm_b, fig_b) = CLAIMS[claim]["comparisons"][cid]
    mine = (r for r in results if r["claim"] == claim and arm_a in r["arms"] and arm_b in r["arms"])
    have = sorted(mine, key=lambda r: r["seed"])
    return (
        [r["seed"] for r in have],
        [r["arms"][arm_a][fig_a] for r in have],
        [r["arms"][arm_b][fig_b] for r in have],
    )


def report(results: list[dict], claims, plan_path: Path = PLAN) -> str:
    """Each registered comparison of ``claims``: the per-seed differences b − a (``describe``), the exact p after
    Holm's correction over the plan's ``central`` family (registered members without data count at p = 1), and
    ``decide``'s verdict under the plan's direction and margin. A no-difference comparison (direction 0: grpo-ppo)
    is no member of the family (the page's rule corrects directional comparisons only): its 90% interval against
    ±margin decides it, uncorrected, as on the page."""
    from rlhfkit.reporting.paired import Claim, decide, describe, holm, paired
    from rlhfkit.reporting.plan import load_plan

    plan = load_plan(plan_path)
    data = {}
    for claim in claims:
        for cid in CLAIMS[claim]["comparisons"]:
            seeds, a, b = values_of(results, claim, cid)
            if seeds:
                data[f"{claim}.{cid}"] = (seeds, paired(a, b))
    members = plan.family_members()[FAMILY]
    adjusted = dict(
        zip(members, holm([data[k][1].exact_p if k in data else 1.0 for k in members]), strict=True)
    )
    lines = []
    for claim in claims:
        for cid in CLAIMS[claim]["comparisons"]:
            key, planned = f"{claim}.{cid}", plan.comparisons[f"{claim}.{cid}"]
            head = f"{key}: b − a = ({planned.b}) − ({planned.a})"
            if key not in data:
                lines.append(f"{head}: no seed has run")
                continue
            seeds, p = data[key]
            word = decide(p, Claim(planned.direction, planned.margin), adjusted.get(key))
            note = "" if len(seeds) == planned.n else f" (the plan registers {planned.n}: not its test yet)"
            if key in adjusted:
                rule = (
                    f"Holm over '{FAMILY}': p = {adjusted[key]:.3g}; claimed direction {planned.direction:+d}"
                )
            else:  # no difference claimed: equivalence within the margin, outside the family's correction
                ci90 = p.interval(0.90)
                where = "no interval" if ci90 is None else f"90% t-interval [{ci90[0]:+.2f}, {ci90[1]:+.2f}]"
                rule = f"no difference claimed, margin ±{planned.margin:g} ({planned.margin_key}): {where}"
            lines.append(
                f"{head}\n  seeds {seeds[0]}-{seeds[-1]}, n = {len(seeds)}{note}: {describe(p)}\n  {rule}: {word}"
            )
    return "\n".join(lines)


def git_commit() -> str | None:
    """The commit of this script's checkout, or None outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument(
        "--seeds", type=int, nargs="+", help=f"default {SEEDS[0]}-{SEEDS[-1]}; the pilot's {PILOT_SEEDS}"
    )
    p.add_argument("--pilot", action="store_true",
                   help=f"the pilot: kl0 alone, {PILOT_ROLLOUTS} rollouts; writes OUT/pilot.json")  # fmt: skip
    p.add_argument("--claims", nargs="+", choices=list(CLAIMS), default=list(CLAIMS))
    p.add_argument("--arms", nargs="+", choices=ARMS, default=ARMS,
                   help="the arms to run, of the claims asked (the pilot: kl0)")  # fmt: skip
    add_size_arguments(p, SIZES)
    p.add_argument(
        "--jobs", type=int, default=2, help="seeds run at once, each in its own one-thread process"
    )
    p.add_argument("--commit", help="the commit the runs record (default: this checkout's HEAD)")
    p.add_argument(
        "--report-only", action="store_true", help="only the comparisons, from OUT and the records"
    )
    p.add_argument(
        "--records",
        type=Path,
        help="the finished claims and arms, per seed, kept apart from OUT and not run again (default, at the "
        "default size: examples/experiments/records/central_claims, committed with the code)",
    )
    p.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.records is None and args.size == "default" and not args.pilot:
        args.records = RECORDS
    args.overwrite = False  # ppo_arms.run_seeds reads it; a finished stage is never rerun here
    args.seeds = args.seeds or (PILOT_SEEDS if args.pilot else SEEDS)
    if args.pilot:
        args.claims, args.arms, args.rollouts = ["overopt-central"], ["kl0"], args.rollouts or PILOT_ROLLOUTS
    elif args.size == "default" and args.rollouts is None and not args.report_only:
        pilot = args.out / "pilot.json"  # the length the pilot chose
        choice = json.loads(pilot.read_text()).get("choice") if pilot.is_file() else None
        if choice is None:
            p.error(f"{pilot}: no choice of rollouts; run the pilot first (--pilot), or give --rollouts")
        args.rollouts = int(choice)
    args.commit = args.commit or git_commit()
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [k for k in args.seeds if not all(recorded(args, k, c) for c in args.claims)]
    if args.report_only or not todo:  # from OUT and the records; nothing trained
        results = [run_seed(seed, args) for seed in args.seeds]
    else:  # the shared stage once, before the seeds' jobs start
        from rlhfkit.engine.threads import set_num_threads

        set_num_threads()
        oq.shared_stage(shared_args(args), sizes_of(args, SIZES))
        commit = ["--commit", args.commit] if args.commit else []
        results = ppo_arms.run_seeds(__file__, [*argv, *commit], args, run_seed)
    if results is None:
        return 1
    if args.pilot and not args.no_report:
        text, choice = pilot_report(args.out, [r for seed in results for r in seed], [sys.argv[0], *argv])
        print(text, flush=True)
        return 0 if choice is not None else 3
    if not args.no_report:
        print(report([r for seed in results for r in seed], args.claims), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
