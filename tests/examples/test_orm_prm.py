"""examples/experiments/orm_prm.py: the updates-to-reach count by hand, each arm's reward (the ORM alone, the PRM
alone, never the checker), the pairing by seed and the report's Holm correction over the plan's ``central``
family, and the runner end to end at the smoke size (the reads every 5 updates, the records copied and taken back
in place of a rerun, --report-only). The figures themselves come from the 20-seed run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhfkit.reporting.paired import holm, paired
from rlhfkit.reporting.plan import load_plan
from tests.examples.loader import load_example

ex = load_example("experiments/orm_prm")


def _reads(*accuracies):
    return [{"update": 5 * i, "exact_match": a} for i, a in enumerate(accuracies)]


def test_updates_to_reach_is_the_first_read_at_or_above_the_target_else_the_length_plus_5():
    assert ex.updates_to_reach(_reads(0.3, 0.49, 0.5, 0.2, 0.7), 20) == 10  # reaching 0.5 exactly counts
    assert ex.updates_to_reach(_reads(0.6, 0.1), 5) == 0  # the policy before any update
    assert ex.updates_to_reach(_reads(0.3, 0.7, 0.1), 10) == 5  # the first crossing, not the last read
    assert ex.updates_to_reach(_reads(0.3, 0.49, 0.4), 10) == 15  # never: its length + 5
    assert ex.updates_to_reach(_reads(0.3, 0.49, 0.4), 40) == 45


def test_each_arm_has_its_reward_model_alone_and_the_quickstarts_settings():
    from rlhfkit.quickstart.verifiable import VERIFIABLE_PRESETS

    p = VERIFIABLE_PRESETS["tiny"]
    shared = {"sft": Path("sft"), "prompts_train": Path("p.jsonl")}
    models = {"orm": Path("orm"), "prm": Path("prm")}
    orm = ex.arm_settings("orm", shared, models, p, 3)
    prm = ex.arm_settings("prm", shared, models, p, 3)
    assert orm["online.reward_model"] == Path("orm") and "online.process_reward_model" not in orm
    assert prm["online.process_reward_model"] == Path("prm") and "online.reward_model" not in prm
    for s in (orm, prm):
        assert (
            s["online.reward_functions"] == "[]" and "online.critic_model" not in s
        )  # no checker, no critic
        assert s["train.eval_steps"] == ex.EVERY and s["seed"] == 3
        assert (s["train.max_steps"], s["online.group_size"], s["train.batch_size"]) == (40, 8, 8)
    assert {k: v for k, v in orm.items() if "reward" not in k} == {
        k: v for k, v in prm.items() if "reward" not in k
    }
    with pytest.raises(ValueError, match="unknown arm"):
        ex.arm_settings("rule", shared, models, p, 3)


def test_the_report_pairs_by_seed_and_corrects_over_the_central_family():
    results = [
        {"seed": s, "orm": {"accuracy": a, "updates": 45}, "prm": {"accuracy": b, "updates": u}}
        for s, a, b, u in [(0, 0.1, 0.5, 35), (1, 0.2, 0.4, 45), (2, 0.15, 0.6, 30)]
    ]
    results.append({"seed": 3, "orm": {"accuracy": 0.9, "updates": 0}, "prm": {}})  # one arm only: unpaired
    seeds, a, b = ex.values_of(results, "accuracy")
    assert (seeds, a, b) == ([0, 1, 2], [0.1, 0.2, 0.15], [0.5, 0.4, 0.6])
    text = ex.report(results)
    members = load_plan(ex.PLAN).family_members()[ex.FAMILY]
    ps = [1.0] * len(members)
    ps[members.index("orm-prm.accuracy")] = paired(a, b).exact_p
    ps[members.index("orm-prm.updates")] = paired([45, 45, 45], [35, 45, 30]).exact_p
    adjusted = dict(zip(members, holm(ps), strict=True))
    assert f"p = {adjusted['orm-prm.accuracy']:.3g}; claimed direction +1: open" in text
    assert f"p = {adjusted['orm-prm.updates']:.3g}; claimed direction -1: open" in text
    assert "n = 3 (the plan registers 20: not its test yet)" in text


def test_the_runner_reads_every_5_updates_keeps_records_and_takes_them_back(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    out, records = tmp_path / "out", tmp_path / "records"
    argv = [
        "--out",
        str(out),
        "--preset",
        "smoke",
        "--seeds",
        "7",
        "--records",
        str(records),
        "--commit",
        "abc",
    ]
    assert ex.main(argv) == 0
    for arm in ex.ARMS:
        record = json.loads((records / "seed-7" / f"{arm}.json").read_text())
        assert record["commit"] == "abc" and record["arm"] == arm and record["rollouts"] == 2
        assert [r["update"] for r in record["reads"]] == [0, 2]  # before the first update and after the last
        assert record["accuracy"] == record["reads"][-1]["exact_match"]
        assert record["updates"] == ex.updates_to_reach(record["reads"], 2)
        assert (out / "seed-7" / f"grpo-{arm}" / "final" / "config.json").is_file()
    shutil.rmtree(out)  # another sitting: the records stand in for the runs, nothing trains
    monkeypatch.setattr(ex, "shared_stage", lambda *a: pytest.fail("a recorded arm was trained again"))
    results = [ex.run_seed(7, ex.parse_args(argv), SimpleNamespace(rollouts=2))]
    assert results[0]["orm"]["commit"] == "abc" and results[0]["prm"]["arm"] == "prm"
    assert ex.main([*argv, "--report-only"]) == 0
