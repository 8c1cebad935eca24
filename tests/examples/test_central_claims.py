"""examples/experiments/central_claims.py: the split read, the peak and the drop by hand, the checkpoints read,
the pairing by seed, the report's Holm correction over the plan's ``central`` family, and the runner end to end at
the smoke size (every checkpoint read, an interrupted arm resumed to the same figures, --report-only). The figures
themselves come from the 20-seed run."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from rlhfkit.reporting.paired import holm, sign_flip_p
from rlhfkit.reporting.plan import load_plan
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


def test_reversed_k3_penalty_runs_both_penalties_and_reads_the_exact_kl_at_the_smoke_size(tmp_path, capsys):
    out = tmp_path / "central"
    argv = f"--out {out} --size smoke --seeds 0 --jobs 1 --claims reversed-k3-penalty".split()
    assert ex.main(argv) == 0
    seed = out / "seed-0"
    figures = json.loads((seed / "reversed-k3-penalty.json").read_text())
    for name, estimator in (("k3", "k3"), ("k3-reversed", "k3_reversed")):
        config = yaml.safe_load((seed / "reversed-k3-penalty" / name / "config.yaml").read_text())
        assert (config["kind"], config["online"]["kl_estimator"], config["online"]["kl_coef"]) == (
            "ppo",
            estimator,
            0.05,
        )
        assert config["online"]["kl_in_loss"] is False and config["train"]["lr_schedule"] == "constant"
        arm = figures["arms"][name]
        reads = arm["reads"]
        assert [r["rollout"] for r in reads] == [0, 1, 2, 3]
        assert all(r["kl_exact"] > 0 for r in reads[1:])  # every trained checkpoint's exact KL to SFT
        assert arm["end_kl_exact"] == reads[-1]["kl_exact"] and arm["end_kl"] == reads[-1]["kl"]
    # the penalties differ: the two arms' logged KL is each its own estimator's
    logged = {}
    for name in ("k3", "k3-reversed"):
        rows = (seed / "reversed-k3-penalty" / name / "metrics.jsonl").read_text().splitlines()
        logged[name] = [json.loads(r)["kl/mean"] for r in rows if "kl/mean" in json.loads(r)]
    # rollout 1 (the SFT policy: both 0) trains alike in both arms, so rollout 2 samples the same responses
    # from the same policy: two estimates of one KL, each arm's own estimator
    assert logged["k3"][0] == logged["k3-reversed"][0] == 0
    assert 0 < logged["k3"][1] != logged["k3-reversed"][1] > 0
    before = _mtimes(seed)
    capsys.readouterr()
    assert ex.main(argv) == 0
    assert {p for p, t in _mtimes(seed).items() if before.get(p) != t} == {seed / "reversed-k3-penalty.json"}
    text = capsys.readouterr().out
    assert "reversed-k3-penalty.kl: b − a = (reversed k3 penalty) − (k3 penalty)" in text
    assert "claimed direction -1" in text
