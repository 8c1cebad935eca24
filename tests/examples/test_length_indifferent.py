"""examples/experiments/length_indifferent.py: the indifferent gold by hand, the relabelling (its probabilities,
its seed), the length-correlated selection, the correlation against a plain formula, the read's length
preference over the well-formed samples only, the report's rule, and the runner end to end at the smoke size
with its records. The figures themselves come from the 20-seed run."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest

from rlhfkit.reporting.paired import holm, paired
from rlhfkit.reporting.plan import load_plan
from rlhfkit.tasks.reviews import INVALID_SCORE, gold_score, gold_terms
from tests.examples.loader import load_example

ex = load_example("experiments/length_indifferent")

PROMPT = "Write a positive review of the red blender."
SHORT = " The blender is great."
LONG = " The blender is great. I love the price. The design is good. The quality is solid. I like the size."


def test_the_indifferent_gold_is_the_tasks_gold_without_its_length_term():
    terms = gold_terms(PROMPT, LONG)
    assert terms.length < 0  # five sentences: the task's annotators dock the two past the third
    assert ex.indifferent_gold(PROMPT, LONG) == pytest.approx(gold_score(PROMPT, LONG) - terms.length)
    assert ex.indifferent_gold(PROMPT, SHORT) == gold_score(PROMPT, SHORT)  # no length term to remove
    assert ex.indifferent_gold(PROMPT, " blender blender") == INVALID_SCORE


def test_relabelling_follows_bradley_terry_on_the_indifferent_gold_and_its_seed():
    pair = {"prompt": PROMPT, "chosen": SHORT, "rejected": LONG}
    margin = (ex.indifferent_gold(PROMPT, LONG) - ex.indifferent_gold(PROMPT, SHORT)) / 0.5
    p_long = 1 / (1 + math.exp(-margin))
    labels = ex.relabel([pair] * 4000, seed=3, temperature=0.5)
    share = sum(r["chosen"] == LONG for r in labels) / len(labels)
    assert share == pytest.approx(p_long, abs=0.03)
    assert all({r["chosen"], r["rejected"]} == {SHORT, LONG} and r["prompt"] == PROMPT for r in labels)
    assert labels == ex.relabel([pair] * 4000, seed=3, temperature=0.5)
    assert labels != ex.relabel([pair] * 4000, seed=4, temperature=0.5)
    tie = {"prompt": PROMPT, "chosen": SHORT, "rejected": " The blender is good."}
    ties = ex.relabel([tie] * 4000, seed=0, temperature=0.5)
    assert sum(r["chosen"] == SHORT for r in ties) / 4000 == pytest.approx(0.5, abs=0.03)  # no order bias


def test_the_selection_keeps_every_longer_or_equal_chosen_and_a_third_of_the_shorter():
    longer = {"prompt": PROMPT, "chosen": LONG, "rejected": SHORT}
    shorter = {"prompt": PROMPT, "chosen": SHORT, "rejected": LONG}
    equal = {"prompt": PROMPT, "chosen": SHORT, "rejected": SHORT}
    kept = ex.length_correlated([longer, shorter, equal] * 3000, seed=1)
    assert sum(r is longer for r in kept) == 3000 and sum(r is equal for r in kept) == 3000
    assert sum(r is shorter for r in kept) / 3000 == pytest.approx(1 / 3, abs=0.03)
    assert kept == ex.length_correlated([longer, shorter, equal] * 3000, seed=1)
    assert ex.length_correlated([shorter] * 50, seed=1, keep_shorter=0.0) == []


def test_pearson_is_the_sample_correlation():
    x, y = [1.0, 2.0, 3.0, 5.0], [2.0, 1.0, 4.0, 7.0]
    mx, my = sum(x) / 4, sum(y) / 4
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    expected = cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))
    assert ex.pearson(x, y) == pytest.approx(expected)
    assert ex.pearson(x, [-v for v in y]) == pytest.approx(-expected)
    assert math.isnan(ex.pearson(x, [1.0] * 4))
    with pytest.raises(ValueError):
        ex.pearson([1.0], [2.0])


def test_the_length_preference_reads_the_well_formed_samples_only():
    samples = SimpleNamespace(
        proxy=[1.0, 2.0, 3.0, 99.0], gold=[3.0, 2.0, 1.0, -99.0], lengths=[5, 6, 7, 40], valid=[1, 1, 1, 0]
    )
    pref = ex.length_preference(samples)
    assert pref["rm_length_correlation"] == pytest.approx(1.0)
    assert pref["gold_length_correlation"] == pytest.approx(-1.0)
    assert (pref["samples"], pref["valid_rate"]) == (3, 0.75)
    one = SimpleNamespace(proxy=[1.0, 2.0], gold=[1.0, 1.0], lengths=[5, 6], valid=[1, 0])
    assert ex.length_preference(one)["rm_length_correlation"] is None  # one well-formed sample: no figure


def test_the_report_is_reward_model_minus_gold_under_the_registered_rule():
    results = [
        {"seed": k, "rm_length_correlation": b, "gold_length_correlation": a, "chosen_longer_share": 0.75}
        for k, (a, b) in enumerate([(0.1, 0.4), (0.2, 0.3), (0.0, 0.5)])
    ]
    text = ex.report([*results, {}])
    p = paired([0.1, 0.2, 0.0], [0.4, 0.3, 0.5])
    members = load_plan(ex.PLAN).family_members()["central"]
    adjusted = holm([p.exact_p if m == "length-indifferent.premise" else 1.0 for m in members])
    assert (
        f"p = {adjusted[members.index('length-indifferent.premise')]:.3g}; claimed direction +1: open" in text
    )
    assert "n = 3 (the plan registers 20" in text and "a: [0.1, 0.2, 0.0]" in text
    results[1]["rm_length_correlation"] = None  # a seed with too few well-formed samples is named, not tested
    assert "seeds [1]: a correlation is undefined" in ex.report(results)


@pytest.mark.long  # end to end at the smoke size (its own shared stage): CI's long step
def test_the_runner_end_to_end_at_the_smoke_size_records_and_takes_records_back(tmp_path, capsys):
    out, records = tmp_path / "out", tmp_path / "records"
    argv = f"--out {out} --size smoke --seeds 0 --records {records} --commit abc".split()
    assert ex.main(argv) == 0
    record = json.loads((records / "seed-0.json").read_text())
    assert record["commit"] == "abc" and record["claim"] == "length-indifferent" and record["pairs"] == 8
    for key in ("rm_length_correlation", "gold_length_correlation"):  # None: too few well-formed samples
        assert record[key] is None if record["samples"] < 2 else -1 <= record[key] <= 1
    selected = [json.loads(line) for line in (out / "seed-0" / "pairs-length-correlated.jsonl").open()]
    assert len(selected) == 8 and all(set(r) == {"prompt", "chosen", "rejected"} for r in selected)
    out_text = capsys.readouterr().out
    assert "length-indifferent.premise: b − a" in out_text or "a correlation is undefined" in out_text
    shutil.rmtree(out / "seed-0")  # another sitting: the record stands in for the seed, nothing trains
    args = ex.parse_args(argv)
    assert ex.run_seed(0, args) == record
