"""examples/experiments/central_claims.py: the split read, the peak and the drop by hand, the checkpoints read,
the pairing by seed, the report's Holm correction over the plan's ``central`` family, the reversed k3 penalty that the
runner patches in for one arm (its values, its target, the patch and its removal), and the runner end to end at the
smoke size (every checkpoint read, an interrupted arm resumed to the same figures, --report-only). The figures
themselves come from the 20-seed run."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from hypothesis import given, settings

from rlhfkit.algos import kl as kl_module
from rlhfkit.algos import kl_k3, shape_rewards
from rlhfkit.reporting.paired import holm, sign_flip_p
from rlhfkit.reporting.plan import load_plan
from tests.algos.strategies import add_junk, batches
from tests.examples.loader import load_example

ex = load_example("experiments/central_claims")


def test_the_split_read_averages_each_prompt_then_each_half():
    gold = [1.0, 3.0, 0.0, 0.0, -1.0, 1.0, 4.0, 2.0]  # 4 prompts x 2 samples: prompt means 2, 0, 0, 3
    assert ex.split_read(gold, 2, 2) == pytest.approx({"gold": 1.25, "gold_select": 1.0, "gold_read": 1.5})
    assert ex.split_read(gold, 2, 1) == pytest.approx({"gold": 1.25, "gold_select": 2.0, "gold_read": 1.0})
    with pytest.raises(ValueError):
        ex.split_read(gold, 3, 1)  # not 3 per prompt
    with pytest.raises(ValueError):
        ex.split_read(gold, 2, 4)  # nothing left to read on


def _read(rollout, select, read, gold=0.0, kl=1.0):
    return {"rollout": rollout, "gold_select": select, "gold_read": read, "gold": gold, "kl": kl}


def test_the_peak_is_chosen_on_the_first_half_and_read_on_the_second():
    reads = [
        _read(10, 0.9, 0.2),
        _read(0, 5.0, 5.0),  # the SFT policy: never the peak, whatever it reads
        _read(5, 0.4, 0.8),  # the highest read on the second half is not chosen
        _read(15, 0.9, 0.1),  # a tie on the first half: the first checkpoint is the peak
        _read(20, 0.1, -0.3, gold=0.25, kl=7.0),
    ]
    got = ex.peak_and_end(reads)
    assert got == pytest.approx(
        {
            "peak_rollout": 10,
            "peak_gold_read": 0.2,
            "end_gold_read": -0.3,
            "drop": 0.5,
            "end_gold": 0.25,
            "end_kl": 7.0,
        }
    )
    assert ex.peak_and_end([_read(0, 1.0, 1.0), _read(5, 0.2, 0.3)])["drop"] == 0.0  # the peak is the end
    with pytest.raises(ValueError):
        ex.peak_and_end([_read(0, 1.0, 1.0)])


def test_the_end_exact_kl_is_the_last_reads_where_the_reads_have_it():
    reads = [_read(0, 0.0, 0.0), _read(5, 0.9, 0.2, kl=2.0), _read(10, 0.1, 0.1, kl=3.0)]
    reads[1]["kl_exact"], reads[2]["kl_exact"] = 1.5, 2.5  # the peak is rollout 5, the end rollout 10
    got = ex.peak_and_end(reads)
    assert (got["peak_rollout"], got["end_kl"], got["end_kl_exact"]) == (5, 3.0, 2.5)
    assert "end_kl_exact" not in ex.peak_and_end(
        [{k: v for k, v in r.items() if k != "kl_exact"} for r in reads]
    )


# --- the reversed k3 penalty: the k3-reversed arm's, patched in by the runner ------------------------------
LN2 = math.log(2.0)


def test_the_reversed_k3_is_r_minus_1_minus_log_r_with_r_the_policy_over_the_reference():
    lp = torch.tensor([[math.log(0.5), math.log(0.25), -1.3]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5), -1.3]])
    got = ex.kl_k3_reversed(lp, ref)  # r' = pi / pi_ref = 2, 1/2, 1
    torch.testing.assert_close(got, torch.tensor([[2.0 - 1.0 - LN2, 0.5 - 1.0 + LN2, 0.0]]))
    assert got[0, 2] == 0  # exactly, where the policies agree (expm1)
    # rlhfkit's k3 takes r = pi_ref / pi: 1/2 where r' = 2, and the other way round
    torch.testing.assert_close(kl_k3(lp, ref)[:, :2], torch.tensor([[0.5 - 1.0 + LN2, 2.0 - 1.0 - LN2]]))


@pytest.mark.parametrize("seed", range(3))
def test_the_reversed_k3_matches_a_float64_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    lp, ref = -torch.rand(5, 40, generator=gen) * 6, -torch.rand(5, 40, generator=gen) * 6
    got = ex.kl_k3_reversed(lp, ref)
    assert got.shape == (5, 40) and got.dtype == torch.float32 and (got >= 0).all()
    for b in range(5):
        for t in range(40):
            x = float(lp[b, t].double()) - float(ref[b, t].double())  # log pi / pi_ref
            assert got[b, t].item() == pytest.approx(math.exp(x) - 1.0 - x, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_the_reversed_k3_averages_to_chi2_minus_kl_under_the_policy_not_to_kl(seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64) * 1.5, 0)  # the policy
    q = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64) * 1.5, 0)  # the reference
    kl = float((p * (p / q).log()).sum())
    chi2 = float((p * p / q).sum()) - 1.0
    # the exact expectation over the policy's samples: every token, weighted by its probability
    expectation = float((p * ex.kl_k3_reversed(p.log(), q.log())).sum())
    assert expectation == pytest.approx(chi2 - kl, rel=1e-9)
    assert float((p * kl_k3(p.log(), q.log())).sum()) == pytest.approx(kl, rel=1e-9)  # k3's is the KL
    assert abs(expectation - kl) > 0.05 * kl  # not the KL it stands in for


@settings(max_examples=30, deadline=None)
@given(batch=batches(max_t=30))
def test_the_patched_penalty_ignores_masked_positions(batch):
    gen, B, T, mask = batch
    lp, ref = -torch.rand(B, T, generator=gen) * 4, -torch.rand(B, T, generator=gen) * 4
    scores = torch.randn(B, generator=gen)
    with ex.reversed_k3_penalty():
        rewards, kl = shape_rewards(scores, lp, ref, mask, 0.05, "k3")
        junk = shape_rewards(scores, add_junk(gen, lp, mask), add_junk(gen, ref, mask), mask, 0.05, "k3")
    assert torch.equal(junk[0], rewards) and torch.equal(junk[1], kl)  # NaN / inf under the mask: no effect
    assert torch.equal(kl, torch.where(mask.bool(), ex.kl_k3_reversed(lp, ref), 0.0))
    plain_rewards, plain_kl = shape_rewards(scores, lp, ref, mask, 0.05, "k3")  # rlhfkit's k3 again
    torch.testing.assert_close(rewards + 0.05 * kl, plain_rewards + 0.05 * plain_kl)  # the score lands alike


def _one_token():
    # r' = pi / pi_ref = 2: the reversed k3 is 1 - ln 2, rlhfkit's k3 (r = 1/2) ln 2 - 1/2
    return torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])


def test_the_patch_is_the_k3_the_trainer_looks_up_inside_the_context_only_and_after_an_exception():
    lp, ref = _one_token()
    mask, none = torch.ones(1, 1), torch.zeros(1)
    assert kl_module.KL_ESTIMATORS["k3"] is kl_k3
    with ex.reversed_k3_penalty() as used:
        torch.testing.assert_close(kl_module.kl_estimator("k3")(lp, ref), torch.tensor([[1.0 - LN2]]))
        torch.testing.assert_close(
            shape_rewards(none, lp, ref, mask, 0.05, "k3")[1], torch.tensor([[1.0 - LN2]])
        )
        assert used.calls == 2
        assert (
            kl_module.KL_ESTIMATORS["k1"] is kl_module.kl_k1
            and kl_module.KL_ESTIMATORS["k2"] is kl_module.kl_k2
        )
    assert kl_module.KL_ESTIMATORS["k3"] is kl_k3
    torch.testing.assert_close(shape_rewards(none, lp, ref, mask, 0.05, "k3")[1], torch.tensor([[LN2 - 0.5]]))
    with pytest.raises(RuntimeError, match="mid-run"), ex.reversed_k3_penalty():
        assert kl_module.KL_ESTIMATORS["k3"] is not kl_k3
        raise RuntimeError("mid-run")
    assert kl_module.KL_ESTIMATORS["k3"] is kl_k3


def test_an_arm_trains_under_the_patch_resumed_too_and_its_record_says_so(tmp_path, monkeypatch):
    from rlhfkit.trainers import online

    lp, ref = _one_token()
    s, seen = SimpleNamespace(rollouts=2, eval_every=1), []
    reads = tmp_path / "arm-reads"

    def trainer(stop_after=None, stage_3=True):
        def train(
            cfg, resume, hooks
        ):  # a stand-in: stage 3 of one rollout, then the reads of its checkpoints
            if stage_3:
                seen.append(
                    (resume, shape_rewards(torch.zeros(1), lp, ref, torch.ones(1, 1), 0.05, "k3")[1].item())
                )
            for k in (1, 2):
                (reads / f"rollout-{k:05d}.json").write_text(json.dumps({**_read(k, 0.1, 0.2), "proxy": 0.0}))
                if k == stop_after:
                    raise KeyboardInterrupt

        return train

    monkeypatch.setattr(ex, "ppo_config", lambda *args, **kwargs: None)
    sft = {**_read(0, 0.0, 0.0), "proxy": 0.0}
    keys = {"online.kl_estimator": "k3"}

    def run(**kwargs):
        return ex.arm_run(tmp_path, "arm", 0.05, {}, sft, 0, s, keys=dict(keys), **kwargs)

    monkeypatch.setattr(online, "train", trainer(stop_after=1))  # interrupted after rollout 1's read
    with pytest.raises(KeyboardInterrupt):
        run(reversed_k3=True)
    assert kl_module.KL_ESTIMATORS["k3"] is kl_k3 and not (tmp_path / "arm.json").exists()
    monkeypatch.setattr(online, "train", trainer())
    record = run(reversed_k3=True)  # resumed: the patch again
    assert seen == [(True, pytest.approx(1.0 - LN2))] * 2 and kl_module.KL_ESTIMATORS["k3"] is kl_k3
    assert record["keys"] == keys and record["penalty"] == ex.REVERSED_K3
    assert json.loads((tmp_path / "arm.json").read_text())["penalty"] == ex.REVERSED_K3
    assert "k3 with the ratio reversed" in record["penalty"] and "patched by the runner" in record["penalty"]
    with pytest.raises(SystemExit, match="penalty"):  # its cache is no plain k3 arm's
        run()
    # a trainer that resolved its estimator before the patch: the arm stops instead of recording plain k3
    (tmp_path / "arm.json").unlink()
    (reads / "rollout-00002.json").unlink()
    monkeypatch.setattr(online, "train", trainer(stage_3=False))
    with pytest.raises(SystemExit, match="never called the patched reversed k3"):
        run(reversed_k3=True)
    assert not (tmp_path / "arm.json").exists()


def test_every_checkpoint_and_the_last_rollout_are_read():
    assert ex.checkpoints(40, 5) == [0, 5, 10, 15, 20, 25, 30, 35, 40]
    assert ex.checkpoints(12, 5) == [0, 5, 10, 12]


def _seed(seed, kl0, kl005):
    arms = {}
    for name, (peak, end, end_all) in (("kl0", kl0), ("kl0.05", kl005)):
        if peak is not None:
            arms[name] = {
                "peak_gold_read": peak,
                "end_gold_read": end,
                "drop": peak - end,
                "end_gold": end_all,
            }
    return {"seed": seed, "claim": "overopt-central", "arms": arms}


def test_the_comparisons_pair_each_seed_with_itself_and_skip_a_seed_without_both_arms():
    results = [
        _seed(2, (1.0, 0.5, 0.4), (1.1, 1.0, 0.9)),
        _seed(0, (0.8, 0.1, 0.2), (0.7, 0.6, 0.5)),
        _seed(1, (0.9, 0.3, 0.3), (None, None, None)),
    ]
    results.append({"seed": 3, "claim": "refresh-own-pairs", "arms": {"refresh": {}, "own-pairs": {}}})
    assert ex.values_of(results, "overopt-central", "drop-kl0") == (
        [0, 1, 2],
        [0.1, 0.3, 0.5],
        [0.8, 0.9, 1.0],
    )
    seeds, a, b = ex.values_of(results, "overopt-central", "defence-end")
    assert (seeds, a, b) == ([0, 2], [0.2, 0.4], [0.5, 0.9])
    seeds, a, b = ex.values_of(results, "overopt-central", "defence-drop")
    assert seeds == [0, 2] and a == pytest.approx([0.7, 0.5]) and b == pytest.approx([0.1, 0.1])


def test_the_report_corrects_over_the_whole_central_family_of_the_plan():
    # 20 seeds: every drop at kl_coef 0 is positive, the penalty's end gain is positive in 19 seeds of 20
    results = [
        _seed(k, (1.0 + 0.01 * k, 0.2, 0.1), (0.9, 0.8 - 0.01 * k, 0.6 if k else 0.05)) for k in range(20)
    ]
    text = ex.report(results, ["overopt-central"])
    members = load_plan(ex.PLAN).family_members()["central"]
    assert len(members) == 9  # the seven claims' directional comparisons; grpo-ppo claims no difference
    drop = [1.0 + 0.01 * k - 0.2 for k in range(20)]
    end = [(0.6 if k else 0.05) - 0.1 for k in range(20)]
    ps = {"overopt-central.drop-kl0": sign_flip_p(drop), "overopt-central.defence-end": sign_flip_p(end)}
    ps["overopt-central.defence-drop"] = sign_flip_p(
        [(0.9 - (0.8 - 0.01 * k)) - d for k, d in enumerate(drop)]
    )
    expected = dict(zip(members, holm([ps.get(k, 1.0) for k in members]), strict=True))
    blocks = dict(
        zip(("drop-kl0", "defence-end", "defence-drop"), text.split("overopt-central.")[1:], strict=True)
    )
    for cid, block in blocks.items():
        key = f"overopt-central.{cid}"
        assert f"p = {expected[key]:.3g};" in block and "n = 20:" in block
        assert expected[key] > ps[key]  # the correction is over nine members, not three
    assert blocks["drop-kl0"].rstrip().endswith("holds")
    assert blocks["defence-end"].rstrip().endswith("holds")
    assert blocks["defence-drop"].rstrip().endswith("holds")  # the drop is smaller with the penalty: -1 holds
    assert "(+0.80 / +0.81 / +0.82 / " in blocks["drop-kl0"]  # each seed b − a, in seed order
    few = ex.report(results[:5], ["overopt-central"])
    assert "n = 5 (the plan registers 20: not its test yet)" in few and "holds" not in few


@pytest.mark.long
def test_the_runner_end_to_end_at_the_smoke_size_resumes_an_interrupted_arm(tmp_path, capsys):
    out = tmp_path / "central"
    argv = ["--out", str(out), "--size", "smoke", "--seeds", "0", "--jobs", "1", "--commit", "abc1234"]
    assert ex.main(argv) == 0
    root = out / "seed-0" / "overopt-central"
    figures = json.loads((out / "seed-0" / "overopt-central.json").read_text())
    assert figures["commit"] == "abc1234" and set(figures["arms"]) == {"kl0", "kl0.05"}
    # refresh-own-pairs: the offline reward model trained on the weak one's pairs, then the refresh's own
    own = json.loads((out / "seed-0" / "refresh-own-pairs.json").read_text())
    claim = out / "seed-0" / "refresh-own-pairs"
    labelled = (claim / "refresh-pairs.jsonl").read_text().splitlines()
    weak = (out / "shared" / "pairs" / "pairs_train_8.jsonl").read_text().splitlines()
    assert own["arms"]["refresh"]["refresh_labels"] == len(labelled) > 0
    assert all(set(json.loads(r)) >= {"prompt", "chosen", "rejected"} for r in labelled)
    assert (claim / "own-pairs.jsonl").read_text().splitlines() == weak + labelled
    config = yaml.safe_load((claim / "rm-own-pairs" / "config.yaml").read_text())
    assert config["data"]["train_file"] == str(claim / "own-pairs.jsonl")
    assert own["reward_models"]["own-pairs"]["labels"] == len(weak) + len(labelled)
    ppo = yaml.safe_load((claim / "own-pairs" / "config.yaml").read_text())
    assert ppo["online"]["reward_model"] == str(claim / "rm-own-pairs" / "final")
    assert ppo["online"]["kl_coef"] == 0.0 and ppo["train"]["lr_schedule"] == "constant"
    assert yaml.safe_load((claim / "refresh" / "config.yaml").read_text())["refresh"]["every"] == 1
    # overfit-central: the usual reward model on the pool's first 8 pairs, the over-fitted one on the first 6
    claim = out / "seed-0" / "overfit-central"
    usual = yaml.safe_load((claim / "rm-usual" / "config.yaml").read_text())
    overfit = yaml.safe_load((claim / "rm-overfit" / "config.yaml").read_text())
    assert usual["data"]["train_file"] == str(out / "shared" / "pairs" / "pairs_train_8.jsonl")
    assert (claim / "pairs_first6.jsonl").read_text().splitlines() == weak[:6]
    assert overfit["data"]["train_file"] == str(claim / "pairs_first6.jsonl")
    assert (
        overfit["train"]["max_steps"],
        overfit["train"]["weight_decay"],
        overfit["reward"]["keep_best"],
    ) == (
        4,
        0.0,
        False,
    )
    assert usual["train"]["weight_decay"] == 0.1 and usual["train"]["max_steps"] == 2
    for name in ("usual", "overfit"):
        ppo = yaml.safe_load((claim / name / "config.yaml").read_text())
        assert (
            ppo["online"]["reward_model"] == str(claim / f"rm-{name}" / "final")
            and ppo["online"]["kl_coef"] == 0
        )
    for name, kl_coef in (("kl0", 0.0), ("kl0.05", 0.05)):
        arm = figures["arms"][name]
        assert [r["rollout"] for r in arm["reads"]] == [0, 1, 2, 3] and arm["kl_coef"] == kl_coef
        assert all(r["prompts"] == 6 and r["samples"] == 2 and r["select_prompts"] == 3 for r in arm["reads"])
        assert arm["drop"] == pytest.approx(arm["peak_gold_read"] - arm["end_gold_read"])
    # an interruption after rollout 2's checkpoint: what came after it is lost, the run resumes from rollout 2
    first = json.loads((root / "kl0.json").read_text())
    (root / "kl0.json").unlink()
    (root / "kl0-reads" / "rollout-00003.json").unlink()
    shutil.rmtree(root / "kl0" / "checkpoints" / "step-3")
    shutil.rmtree(root / "kl0" / "final")
    kept = (root / "kl0-reads" / "rollout-00002.json").stat().st_mtime_ns
    checkpoint = (root / "kl0" / "checkpoints" / "step-2").stat().st_mtime_ns
    assert ex.main(argv) == 0
    # resumed, not run again: rollout 2's checkpoint is the one it started from, and rollout 3's is back
    assert (root / "kl0" / "checkpoints" / "step-2").stat().st_mtime_ns == checkpoint
    assert (root / "kl0" / "checkpoints" / "step-3").is_dir()
    again = json.loads((root / "kl0.json").read_text())
    assert again["reads"] == first["reads"]  # the resumed run reads the same policy at rollout 3
    assert (root / "kl0-reads" / "rollout-00002.json").stat().st_mtime_ns == kept
    capsys.readouterr()
    assert ex.main([*argv, "--report-only"]) == 0
    text = capsys.readouterr().out
    assert "overopt-central.defence-drop" in text and "seeds 0-0, n = 1" in text
    assert "refresh-own-pairs.end: b − a = (PPO with the reward model refreshed online)" in text
    assert "overfit-central.end: b − a = (the over-fitted reward model) − (the usual reward model)" in text


def test_the_runs_record_the_commit_of_this_checkout():
    import subprocess

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ex.PLAN.parent, capture_output=True, text=True)
    assert ex.git_commit() == head.stdout.strip() and len(ex.git_commit()) == 40


def _curve(points):
    return [{"rollout": c, "gold": g, "kl": 0.0} for c, g in points]


def test_the_pilot_chooses_the_first_checkpoint_where_every_seed_has_peaked_and_fallen():
    a = _curve([(0, 0.5), (5, 0.9), (10, 1.0), (15, 0.85), (20, 0.7)])  # falls 0.15 by 15, 0.3 by 20
    b = _curve([(0, 0.5), (5, 0.6), (10, 0.65), (15, 0.7), (20, 0.45), (25, 0.4)])  # falls 0.25 by 20
    assert ex.choose_rollouts({100: a, 101: b}) == 20
    assert ex.choose_rollouts({100: a}) == 20 and ex.choose_rollouts({101: b}) == 20
    assert ex.choose_rollouts({100: a, 101: b}, fall=0.3) is None  # seed 101 falls 0.25 only
    assert ex.choose_rollouts({100: a}, fall=0.15) == 15
    below_sft = _curve([(0, 2.0), (5, 1.5), (10, 1.2), (15, 1.0), (20, 0.8)])  # no peak above the SFT policy
    assert ex.choose_rollouts({100: a, 102: below_sft}) is None


def test_the_pilot_writes_its_choice_and_the_runs_take_it(tmp_path):
    results = [
        {
            "seed": 100,
            "claim": "overopt-central",
            "arms": {"kl0": {"reads": _curve([(0, 0.5), (5, 0.9), (10, 0.6)])}},
        }
    ]
    text, choice = ex.pilot_report(tmp_path, results, ["central_claims.py", "--pilot"])
    assert choice == 10 and "seed 100: 0: +0.50, 0.0; 5: +0.90, 0.0; 10: +0.60, 0.0" in text
    assert json.loads((tmp_path / "pilot.json").read_text())["choice"] == 10
    args = ex.parse_args(["--out", str(tmp_path)])
    assert (
        args.rollouts == 10 and args.seeds == list(range(20)) and ex.sizes_of(args, ex.SIZES).rollouts == 10
    )
    pilot = ex.parse_args(["--out", str(tmp_path / "new"), "--pilot"])
    assert (pilot.seeds, pilot.arms, pilot.rollouts, pilot.claims) == (
        [100, 101],
        ["kl0"],
        60,
        ["overopt-central"],
    )
    with pytest.raises(SystemExit):  # no pilot there yet
        ex.parse_args(["--out", str(tmp_path / "new")])


def test_a_seed_reads_the_shared_stage_without_writing_it(tmp_path):
    args = ex.parse_args(["--out", str(tmp_path), "--size", "smoke"])
    sa = ex.shared_args(args)
    with pytest.raises(SystemExit, match="not finished"):
        ex.shared_view(sa)
    shared = tmp_path / "shared"
    for path in ("task/prompts_train.jsonl", "task/prompts_eval.jsonl", "pairs/pairs_train_8.jsonl"):
        (shared / path).parent.mkdir(parents=True, exist_ok=True)
        (shared / path).write_text("{}\n")
    (shared / "sft" / "final").mkdir(parents=True)
    before = {p: (p.stat().st_mtime_ns, p.read_text()) for p in shared.rglob("*.jsonl")}
    view = ex.shared_view(sa)
    assert view["files"]["prompts_eval"] == shared / "task" / "prompts_eval.jsonl"
    assert view["subsets"] == {8: shared / "pairs" / "pairs_train_8.jsonl"} and view["task"].name == "reviews"
    assert {p: (p.stat().st_mtime_ns, p.read_text()) for p in shared.rglob("*.jsonl")} == before


def _pair(claim, seed, arms):
    """One seed's figures of a claim, named by arm and figure as the runner writes them (not read from CLAIMS)."""
    return {"seed": seed, "claim": claim, "arms": {arm: {figure: x} for arm, (figure, x) in arms.items()}}


def test_the_new_claims_report_b_minus_a_under_the_registered_rule():
    # reversed-k3-penalty: the reversed penalty's end exact KL below k3's in every seed (b − a < 0, claimed -1)
    reversed_k3 = [
        _pair(
            "reversed-k3-penalty",
            k,
            {"k3": ("end_kl_exact", 3.0 + 0.1 * k), "k3-reversed": ("end_kl_exact", 2.0 + 0.05 * k)},
        )
        for k in range(20)
    ]
    # grpo-ppo: GRPO's end gold within a few hundredths of PPO's (no difference claimed, margin 0.1 gold)
    grpo = [
        _pair(
            "grpo-ppo", k, {"ppo": ("end_gold", 0.5), "grpo": ("end_gold", 0.5 + (0.03 if k % 2 else 0.01))}
        )
        for k in range(20)
    ]
    text = ex.report(reversed_k3 + grpo, ["grpo-ppo", "reversed-k3-penalty"])
    head, block = text.split("reversed-k3-penalty.kl: ")
    assert block.startswith("b − a = (reversed k3 penalty) − (k3 penalty)")
    assert "(-1.00 / -1.05 / -1.10 / " in block and "n = 20:" in block
    members = load_plan(ex.PLAN).family_members()["central"]
    diffs = [(2.0 + 0.05 * k) - (3.0 + 0.1 * k) for k in range(20)]
    p = holm([sign_flip_p(diffs) if m == "reversed-k3-penalty.kl" else 1.0 for m in members])
    assert (
        f"Holm over 'central': p = {p[members.index('reversed-k3-penalty.kl')]:.3g}; claimed direction -1"
        in block
    )
    assert block.rstrip().endswith("holds")
    assert head.startswith("grpo-ppo.end: b − a = (GRPO's group baseline) − (PPO with a critic)")
    assert "grpo-ppo.end" not in members  # no difference claimed: decided by its 90% interval, uncorrected
    assert "no difference claimed, margin ±0.1 (gold-0.1): 90% t-interval [+0.02, +0.02]" in head
    assert head.rstrip().endswith("no difference (within ±0.1)")


def _mtimes(folder):
    return {p: p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.long  # end to end at the smoke size: CI's long step (the suite stays under 15 minutes)
def test_grpo_ppo_reuses_the_kl_penalty_arm_and_runs_grpo_in_groups_at_the_smoke_size(tmp_path, capsys):
    out = tmp_path / "central"
    argv = ["--out", str(out), "--size", "smoke", "--seeds", "0", "--jobs", "1", "--commit", "abc1234"]
    assert ex.main([*argv, "--claims", "grpo-ppo"]) == 0
    seed = out / "seed-0"
    figures = json.loads((seed / "grpo-ppo.json").read_text())
    assert set(figures["arms"]) == {"ppo", "grpo"} and figures["commit"] == "abc1234"
    # the PPO arm is overopt-central's kl_coef 0.05 arm, run where that claim runs it, with its settings
    assert not (seed / "grpo-ppo" / "ppo").exists()
    assert figures["arms"]["ppo"] == json.loads((seed / "overopt-central" / "kl0.05.json").read_text())
    ppo = yaml.safe_load((seed / "overopt-central" / "kl0.05" / "config.yaml").read_text())
    grpo = yaml.safe_load((seed / "grpo-ppo" / "grpo" / "config.yaml").read_text())
    assert (ppo["kind"], ppo["online"]["advantage_estimator"], ppo["online"]["group_size"]) == (
        "ppo",
        "gae",
        1,
    )
    # GRPO: groups of 4 over a quarter of PPO's prompts, so as many responses a rollout (4 at the smoke size)
    assert (grpo["kind"], grpo["online"]["advantage_estimator"], grpo["online"]["group_size"]) == (
        "grpo",
        "grpo",
        4,
    )
    assert grpo["train"]["batch_size"] * 4 == ppo["train"]["batch_size"] == 4
    for key in ("kl_coef", "kl_estimator", "kl_in_loss", "temperature", "response_length", "reward_model"):
        assert grpo["online"][key] == ppo["online"][key], key
    for key in ("learning_rate", "lr_schedule", "max_steps", "save_steps"):
        assert grpo["train"][key] == ppo["train"][key], key
    assert ppo["online"]["kl_coef"] == 0.05 and ppo["train"]["lr_schedule"] == "constant"
    assert [r["rollout"] for r in figures["arms"]["grpo"]["reads"]] == [0, 1, 2, 3]
    rows = [
        json.loads(line) for line in (seed / "grpo-ppo" / "grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert any("groups/zero_std_fraction" in r for r in rows)  # the group baseline was computed
    # a second call, with overopt-central's arm asked too: nothing runs again, the two claims share the arm
    before = _mtimes(seed)
    capsys.readouterr()
    assert ex.main([*argv, "--claims", "overopt-central", "grpo-ppo", "--arms", "kl0.05", "ppo", "grpo"]) == 0
    changed = {p for p, t in _mtimes(seed).items() if before.get(p) != t}
    assert changed == {seed / "overopt-central.json", seed / "grpo-ppo.json"}  # only the claims' summaries
    overopt = json.loads((seed / "overopt-central.json").read_text())
    assert overopt["arms"]["kl0.05"] == json.loads((seed / "grpo-ppo.json").read_text())["arms"]["ppo"]
    text = capsys.readouterr().out
    assert "grpo-ppo.end: b − a = (GRPO's group baseline) − (PPO with a critic)" in text
    assert "no difference claimed, margin ±0.1 (gold-0.1)" in text


def _spy_stage_3(monkeypatch):
    """Every ``shape_rewards`` call of the online trainer, tagged with the run (its folder's name) that made it:
    (run, estimator name, kl_coef, logprobs, ref_logprobs, mask, the per-token kl it returned)."""
    from rlhfkit.trainers import online
    from rlhfkit.trainers.online import shaping

    calls, now = [], {}
    train, shape = online.train, shaping.shape_rewards

    def tagged(cfg, *args, **kwargs):
        now["run"] = Path(cfg.output_dir).name
        return train(cfg, *args, **kwargs)

    def spy(scores, logprobs, ref_logprobs, mask, kl_coef, estimator):
        rewards, kl = shape(scores, logprobs, ref_logprobs, mask, kl_coef, estimator)
        calls.append((now["run"], estimator, float(kl_coef), logprobs, ref_logprobs, mask, kl.clone()))
        return rewards, kl

    monkeypatch.setattr(online, "train", tagged)
    monkeypatch.setattr(shaping, "shape_rewards", spy)
    return calls


def _trained_on(call) -> str:
    """Which penalty a stage-3 call's kl is, from its own log-probs in float64: ``reversed`` or ``k3``."""
    _, _, _, lp, ref, mask, kl = call
    x = lp.double() - ref.double()  # log pi / pi_ref
    valid = mask.bool()
    reverse = torch.where(valid, torch.expm1(x) - x, 0.0)
    k3 = torch.where(valid, torch.expm1(-x) + x, 0.0)
    assert (reverse - k3).abs().max() > 1e-4  # a call that tells them apart
    for name, value in (("reversed", reverse), ("k3", k3)):
        if torch.allclose(kl.double(), value, rtol=1e-5, atol=1e-6):
            return name
    return "neither"


@pytest.mark.long  # end to end at the smoke size: CI's long step (the suite stays under 15 minutes)
def test_reversed_k3_penalty_trains_each_arm_on_its_own_penalty_resumed_too_at_the_smoke_size(
    tmp_path, capsys, monkeypatch
):
    calls = _spy_stage_3(monkeypatch)
    out = tmp_path / "central"
    argv = f"--out {out} --size smoke --seeds 0 --jobs 1 --claims reversed-k3-penalty".split()
    assert ex.main(argv) == 0
    seed = out / "seed-0"
    claim = seed / "reversed-k3-penalty"
    figures = json.loads((seed / "reversed-k3-penalty.json").read_text())
    for name in ("k3", "k3-reversed"):
        config = yaml.safe_load((claim / name / "config.yaml").read_text())
        assert (config["kind"], config["online"]["kl_estimator"], config["online"]["kl_coef"]) == (
            "ppo",
            "k3",  # both: the reversed one is patched in by the runner, which its record says
            0.05,
        )
        assert config["online"]["kl_in_loss"] is False and config["train"]["lr_schedule"] == "constant"
        arm = figures["arms"][name]
        reads = arm["reads"]
        assert [r["rollout"] for r in reads] == [0, 1, 2, 3]
        assert all(r["kl_exact"] > 0 for r in reads[1:])  # every trained checkpoint's exact KL to SFT
        assert arm["end_kl_exact"] == reads[-1]["kl_exact"] and arm["end_kl"] == reads[-1]["kl"]
        assert arm == json.loads((claim / f"{name}.json").read_text())
    assert (
        figures["arms"]["k3-reversed"]["penalty"] == ex.REVERSED_K3 and "penalty" not in figures["arms"]["k3"]
    )
    # stage 3 of every rollout: the k3 arm's kl is k3 of its log-probs, the reversed arm's the reversed k3
    stage_3 = [c for c in calls if c[2] == 0.05]  # kl_coef 0.05: shape_rollout (0: the kl re-measured)
    trained = [c for c in stage_3 if (c[3] != c[4]).any()]  # rollout 1 samples the SFT policy: every kl is 0
    assert [c[0] for c in stage_3] == ["k3"] * 3 + ["k3-reversed"] * 3 and all(c[1] == "k3" for c in calls)
    assert [(c[0], _trained_on(c)) for c in trained] == [("k3", "k3")] * 2 + [("k3-reversed", "reversed")] * 2
    # and its logged kl/mean is that reversed estimate: the mean over responses of its sum
    rows = [json.loads(r) for r in (claim / "k3-reversed" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["kl/mean"] for r in rows if "kl/mean" in r]
    spied = [float(c[6].double().sum() / c[5].any(1).sum()) for c in stage_3[3:]]
    assert logged == pytest.approx(spied, rel=1e-6, abs=1e-9) and logged[1] > 0
    before = _mtimes(seed)
    capsys.readouterr()
    assert ex.main(argv) == 0
    assert {p for p, t in _mtimes(seed).items() if before.get(p) != t} == {seed / "reversed-k3-penalty.json"}
    text = capsys.readouterr().out
    assert "reversed-k3-penalty.kl: b − a = (reversed k3 penalty) − (k3 penalty)" in text
    assert "claimed direction -1" in text
    # the reversed arm interrupted after rollout 2's checkpoint: resumed from it under the patch again
    first = json.loads((claim / "k3-reversed.json").read_text())
    (claim / "k3-reversed.json").unlink()
    (claim / "k3-reversed-reads" / "rollout-00003.json").unlink()
    shutil.rmtree(claim / "k3-reversed" / "checkpoints" / "step-3")
    shutil.rmtree(claim / "k3-reversed" / "final")
    calls.clear()
    assert ex.main(argv) == 0
    resumed = [c for c in calls if c[2] == 0.05]
    assert [(c[0], _trained_on(c)) for c in resumed] == [("k3-reversed", "reversed")]  # rollout 3 alone
    again = json.loads((claim / "k3-reversed.json").read_text())
    assert again["penalty"] == ex.REVERSED_K3 and again["reads"] == first["reads"]
    assert kl_module.KL_ESTIMATORS["k3"] is kl_k3


def test_a_finished_arm_is_recorded_and_a_recorded_arm_is_not_trained_again(tmp_path, monkeypatch):
    """The committed records carry arms over sittings: a finished arm is copied there, and in a fresh output
    folder its record stands for the run (no training)."""
    from rlhfkit.trainers import online

    s, sft, records, trained = (
        SimpleNamespace(rollouts=2, eval_every=1),
        {**_read(0, 0.0, 0.0), "proxy": 0.0},
        tmp_path / "records",
        [],
    )

    def train(cfg, resume, hooks):
        trained.append(cfg)
        for k in (1, 2):
            reads = tmp_path / "a" / "arm-reads" / f"rollout-{k:05d}.json"
            reads.write_text(json.dumps({**_read(k, 0.1 * k, 0.2 * k), "proxy": 0.0}))

    monkeypatch.setattr(ex, "ppo_config", lambda *args, **kwargs: "cfg")
    monkeypatch.setattr(online, "train", train)
    first = ex.arm_run(tmp_path / "a", "arm", 0.0, {}, sft, 0, s, records=records)
    assert trained == ["cfg"] and json.loads((records / "arm.json").read_text()) == first
    monkeypatch.setattr(online, "train", lambda *a, **k: pytest.fail("a recorded arm was trained again"))
    assert ex.arm_run(tmp_path / "b", "arm", 0.0, {}, sft, 0, s, records=records) == first
    assert json.loads((tmp_path / "b" / "arm.json").read_text()) == first
    # an arm that finished in its output folder before records were kept is recorded when next asked
    (records / "arm.json").unlink()
    assert ex.arm_run(tmp_path / "b", "arm", 0.0, {}, sft, 0, s, records=records) == first
    assert json.loads((records / "arm.json").read_text()) == first
    with pytest.raises(
        SystemExit, match="not the asked"
    ):  # a record of another length is no cache of this one
        ex.arm_run(
            tmp_path / "c", "arm", 0.0, {}, sft, 0, SimpleNamespace(rollouts=4, eval_every=1), records=records
        )


def test_a_recorded_claim_runs_no_stage_and_is_reported(tmp_path, capsys):
    """A seed whose claim is recorded with every asked arm returns the record without the shared stage or its
    own (neither exists here); a record missing an asked arm does not stand for the claim."""
    records, out = tmp_path / "records", tmp_path / "out"
    (records / "seed-3").mkdir(parents=True)
    record = {"seed": 3, "claim": "grpo-ppo", "arms": {"ppo": {"end_gold": 0.5}, "grpo": {"end_gold": 0.7}}}
    (records / "seed-3" / "grpo-ppo.json").write_text(json.dumps(record))
    args = SimpleNamespace(
        out=out, claims=["grpo-ppo"], arms=list(ex.ARMS), records=records, report_only=False
    )
    assert ex.run_seed(3, args) == [record] and ex.recorded(args, 3, "grpo-ppo") == record
    assert ex.recorded(SimpleNamespace(**{**vars(args), "arms": ["ppo"]}), 3, "grpo-ppo") == record
    assert ex.recorded(args, 4, "grpo-ppo") is None
    argv = [
        "--out",
        str(out),
        "--records",
        str(records),
        "--claims",
        "grpo-ppo",
        "--seeds",
        "3",
        "--rollouts",
        "20",
    ]
    assert ex.main(argv) == 0 and not (out / "shared").exists()
    printed = capsys.readouterr().out
    assert "grpo-ppo.end" in printed and "+0.20" in printed  # grpo − ppo of the recorded seed
    del record["arms"]["grpo"]
    (records / "seed-3" / "grpo-ppo.json").write_text(json.dumps(record))
    assert ex.recorded(args, 3, "grpo-ppo") is None
