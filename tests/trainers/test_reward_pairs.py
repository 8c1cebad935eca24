"""Labelling pairs on the built-in task: two samples per prompt, the annotators' labels and gold fields, the
files and `rlhfkit label-pairs`."""

import json
import math
import random

import pytest
import torch

from rlhfkit.cli import main
from rlhfkit.errors import UserError
from rlhfkit.rollout.pairs import (
    SampledPair,
    annotate_records,
    drop_uninformative,
    label_pairs,
    sample_response_pairs,
)
from rlhfkit.tasks import get_task
from rlhfkit.tasks.annotators import sigmoid
from tests.helpers import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def task_policy(tmp_path_factory):
    """A random tiny Llama policy folder (a word-level test tokenizer: training the task's own takes seconds,
    and nothing here depends on which words come out)."""
    folder = tmp_path_factory.mktemp("policy")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    tiny_llama(seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id).save_pretrained(folder)
    return folder


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_annotated_records_carry_gold_scores_and_agreement():
    task = get_task("reviews")
    rng = random.Random(0)
    pairs = []
    for prompt in task.prompts("train")[:40]:
        a, b = task.sample_completion(prompt, rng), task.sample_completion(prompt, rng)
        pairs.append(SampledPair(prompt, a, b))
    records = annotate_records(task, pairs, seed=3)
    assert records == annotate_records(task, pairs, seed=3)  # deterministic from the seed
    ties = 0
    for pair, record in zip(pairs, records, strict=True):
        assert {record["chosen"], record["rejected"]} == {pair.a, pair.b} and record["prompt"] == pair.prompt
        assert record["gold_chosen"] == task.gold_score(pair.prompt, record["chosen"])
        assert record["gold_rejected"] == task.gold_score(pair.prompt, record["rejected"])
        gap = abs(record["gold_chosen"] - record["gold_rejected"])
        if gap == 0:
            ties += 1
            assert record["gold_agreement"] is None
        else:
            assert record["gold_agreement"] == pytest.approx(sigmoid(gap / task.annotator_temperature))
    assert 0 < ties < len(records)
    untied = [
        (p.prompt, p.a, p.b) for p, r in zip(pairs, records, strict=True) if r["gold_agreement"] is not None
    ]
    ceiling = sum(r["gold_agreement"] for r in records if r["gold_agreement"] is not None) / len(untied)
    assert ceiling == pytest.approx(task.bayes_ceiling(untied))
    # near-noiseless annotators always pick the higher gold score
    careful = annotate_records(task, pairs, seed=3, temperature=1e-3)
    assert all(r["gold_chosen"] >= r["gold_rejected"] for r in careful)


def test_identical_and_empty_pairs_are_dropped_and_counted():
    pairs = [
        SampledPair("p", " a.", " b."),
        SampledPair("p", " a.", " a."),
        SampledPair("p", "", " b."),
        SampledPair("p", " c.", " d.", ended_b=False),
    ]
    kept, counts = drop_uninformative(pairs)
    assert [(p.a, p.b) for p in kept] == [(" a.", " b."), (" c.", " d.")]
    assert counts == {"dropped_identical": 1, "dropped_empty": 1, "truncated_responses": 1}


def test_two_samples_per_prompt_at_temperature_1_with_the_pad_token_suppressed(task_policy, monkeypatch):
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.rollout import generation

    tokenizer = load_tokenizer(str(task_policy))
    model = load_causal_lm(str(task_policy), tokenizer=tokenizer)
    calls = []
    real = generation.generate_responses

    def spy(model, ids, mask, **kwargs):
        calls.append((ids, kwargs))
        return real(model, ids, mask, **kwargs)

    monkeypatch.setattr(generation, "generate_responses", spy)
    prompts = get_task("reviews").prompts("train")[:3]
    pairs = sample_response_pairs(model, tokenizer, prompts, max_new_tokens=6, batch_size=4, seed=1)
    assert [p.prompt for p in pairs] == prompts
    assert [ids.shape[0] for ids, _ in calls] == [4, 2]  # two rows per prompt, 4 rows per call
    ids, kwargs = calls[0]
    assert torch.equal(ids[0], ids[1]) and not torch.equal(ids[1], ids[2])
    # The pad id is not a stop token, so the sampling suppresses it (generate_responses applies it: tested there).
    assert kwargs["pad_token_id"] == tokenizer.pad_token_id and kwargs["sampling"].temperature == 1.0
    assert tokenizer.pad_token_id in kwargs["sampling"].suppress_ids
    assert kwargs["stop_token_ids"] == [tokenizer.eos_token_id] != [tokenizer.pad_token_id]
    again = sample_response_pairs(model, tokenizer, prompts, max_new_tokens=6, batch_size=4, seed=1)
    assert [(p.a, p.b) for p in again] == [(p.a, p.b) for p in pairs]  # seeded


def test_label_pairs_writes_train_and_heldout_files(task_policy, tmp_path):
    task = get_task("reviews")
    out = tmp_path / "pairs"
    meta = label_pairs(str(task_policy), out, num_pairs=6, num_eval_pairs=4, max_new_tokens=6, batch_size=8)
    train, held = _lines(out / "pairs_train.jsonl"), _lines(out / "pairs_eval.jsonl")
    assert meta["train"]["pairs"] == len(train) and meta["eval"]["pairs"] == len(held)
    assert len(train) + meta["train"]["dropped_identical"] + meta["train"]["dropped_empty"] == 6
    assert set(r["prompt"] for r in train) <= set(task.prompts("train"))
    assert set(r["prompt"] for r in held) <= set(task.prompts("eval"))
    assert len(set(r["prompt"] for r in train)) == len(train)  # one pass over the prompts before any repeats
    for r in train + held:
        assert r["gold_chosen"] == task.gold_score(r["prompt"], r["chosen"])
        assert r["gold_rejected"] == task.gold_score(r["prompt"], r["rejected"])
    assert json.loads((out / "labels.json").read_text())["eval"] == {k: v for k, v in meta["eval"].items()}
    assert meta["annotator_temperature"] == task.annotator_temperature
    with pytest.raises(UserError, match="exists"):
        label_pairs(str(task_policy), out, num_pairs=6, num_eval_pairs=4, max_new_tokens=6)
    label_pairs(
        str(task_policy), out, num_pairs=6, num_eval_pairs=4, max_new_tokens=6, batch_size=8, overwrite=True
    )
    assert _lines(out / "pairs_train.jsonl") == train  # the same seed gives the same pairs


def test_label_pairs_command(task_policy, tmp_path, capsys):
    out = tmp_path / "cli"
    args = [
        "label-pairs",
        "--policy",
        str(task_policy),
        "--out",
        str(out),
        "--pairs",
        "4",
        "--eval-pairs",
        "2",
        "--max-new-tokens",
        "4",
        "--seed",
        "2",
        "--annotator-temperature",
        "0.25",
    ]
    assert main(args) == 0
    assert "training pairs" in capsys.readouterr().out
    meta = json.loads((out / "labels.json").read_text())
    assert meta["seed"] == 2 and meta["annotator_temperature"] == 0.25
    assert main(args) == 2 and "--overwrite" in capsys.readouterr().err
    assert (
        main([*args, "--overwrite", "--pairs", "0"]) == 2
        and "--pairs must be >= 1" in capsys.readouterr().err
    )
    missing = ["label-pairs", "--policy", str(tmp_path / "nope"), "--out", str(out)]
    assert main(missing) == 2 and "policy folder not found" in capsys.readouterr().err
    assert math.isfinite(meta["seconds"]["total"])
