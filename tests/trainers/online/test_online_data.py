"""Online runs with a user's data and reward functions: TRL-convention functions train GRPO, None leaves a
response out of the loss, a failing function stops the run after a checkpoint that --resume continues from,
and samples.jsonl shows what the policy writes. Also: every dataset shape read by each trainer."""

from __future__ import annotations

import json

import pytest
import torch

from rlhfkit.cli import main
from rlhfkit.engine.metrics_writer import read_metrics
from tests.helpers import tiny_llama, tiny_tokenizer
from tests.trainers.online.online_fixtures import online_cli_args, online_config, state, write_online_problem

TRL_REWARDS = '''
import os

BROKEN_CALLS = []

def cat_or_nothing(prompts, completions, completion_ids, answer, **kwargs):
    """TRL's convention: keywords, a dataset column, None (no opinion) where the row has no answer."""
    assert len(completion_ids) == len(completions) and "trainer_state" not in kwargs
    return [None if a is None else float(c.split().count(a)) for c, a in zip(completions, answer)]

def never(prompts, completions, **kwargs):
    return [None] * len(completions)

def flaky(prompts, completions, completion_ids, answer, **kwargs):
    """cat_or_nothing, but it raises at its second call once RLHFKIT_TEST_BROKEN=1 (the module stays imported
    between runs)."""
    if os.environ.get("RLHFKIT_TEST_BROKEN") == "1":
        BROKEN_CALLS.append(1)
        if len(BROKEN_CALLS) >= 2:
            raise ValueError("boom")
    return cat_or_nothing(prompts, completions, completion_ids, answer)
'''


def with_answers(paths):
    """The prompts get an 'answer' column ('cat'), null in every fourth row (a row without the key is refused
    before training: the function takes it without a default)."""
    rows = [json.loads(line) for line in paths["prompts"].read_text().splitlines()]
    for i, row in enumerate(rows):
        row["answer"] = "cat" if i % 4 != 3 else None
    paths["prompts"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["rewards"].write_text(TRL_REWARDS)


@pytest.mark.slow
def test_responses_that_nothing_scores_are_left_out_of_the_loss_and_counted(tmp_path):
    from rlhfkit.trainers.online import train

    paths = write_online_problem(tmp_path, reward_model=False)
    with_answers(paths)
    cfg = online_config(
        paths,
        tmp_path / "none",
        "train.max_steps=1",
        "logging.samples_per_step=0",
        kind="grpo",
        reward="never",
    )
    from transformers import AutoModelForCausalLM

    train(cfg)
    before = AutoModelForCausalLM.from_pretrained(paths["policy"])
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "none" / "final")
    assert all(torch.equal(a, b) for a, b in zip(state(before).values(), state(after).values(), strict=True))
    (metrics,) = read_metrics(tmp_path / "none" / "metrics.jsonl")
    assert metrics["score/unscored"] == 8 and metrics["response/trained_frac"] == 0.0
    assert (
        not (tmp_path / "none" / "samples.jsonl").exists()
        or not (tmp_path / "none" / "samples.jsonl").read_text()
    )


def _comparable(path):
    return [
        {k: v for k, v in row.items() if not k.startswith(("time/", "tokens_per_second"))}
        for row in read_metrics(path)
    ]


@pytest.mark.slow
def test_trl_function_trains_grpo_writes_samples_and_a_failure_resumes_after_the_fix(
    tmp_path, monkeypatch, capsys
):
    paths = write_online_problem(tmp_path, reward_model=False)
    with_answers(paths)
    extra = ("train.max_steps=3", "train.save_steps=10", "logging.samples_per_step=3")
    full = tmp_path / "full"
    assert main(online_cli_args(paths, full, *extra, kind="grpo", reward="flaky")) == 0
    # A TRL-convention function (keywords, a data column, None) trains GRPO ...
    from transformers import AutoModelForCausalLM

    before, after = (AutoModelForCausalLM.from_pretrained(path) for path in (paths["policy"], full / "final"))
    assert any(
        not torch.equal(a, b) for a, b in zip(state(before).values(), state(after).values(), strict=True)
    )
    metrics = read_metrics(full / "metrics.jsonl")
    assert all("score/unscored" in m and "score/flaky" in m for m in metrics)
    # ... and samples.jsonl shows what the policy wrote, with the report's samples section.
    rows = [json.loads(line) for line in (full / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    for r in rows:
        assert set(r) == {"step", "prompt", "response", "score", "parts", "kl", "length", "ended"}
        assert (
            isinstance(r["prompt"], str) and isinstance(r["response"], str) and isinstance(r["ended"], bool)
        )
        assert r["score"] is None or r["score"] == (r["parts"]["flaky"] if r["ended"] else -1.0)
    report = (full / "report.md").read_text()
    assert "## Samples" in report and "### Newest (rollout 3)" in report and "### Best-scored" in report

    # The same run with the function failing at rollout 2: exit 2 naming it, a checkpoint of rollout 1 ...
    monkeypatch.setenv("RLHFKIT_TEST_BROKEN", "1")
    broken = tmp_path / "broken"
    assert main(online_cli_args(paths, broken, *extra, kind="grpo", reward="flaky")) == 2
    err = capsys.readouterr().err
    assert "rollout 2: reward function 'flaky' raised ValueError: boom at " in err and "rewards.py:" in err
    assert "the newest checkpoint is rollout 1" in err and "--resume" in err and "Traceback" not in err
    assert sorted(p.name for p in (broken / "checkpoints").iterdir()) == ["step-1"]
    # ... from which --resume, once the function is fixed, gives the uninterrupted run.
    monkeypatch.setenv("RLHFKIT_TEST_BROKEN", "0")
    assert main([*online_cli_args(paths, broken, *extra, kind="grpo", reward="flaky"), "--resume"]) == 0
    assert _comparable(broken / "metrics.jsonl") == _comparable(full / "metrics.jsonl")
    assert (broken / "samples.jsonl").read_text() == (full / "samples.jsonl").read_text()


def test_a_function_that_needs_a_missing_column_is_refused_before_any_model_loads(tmp_path, capsys):
    paths = write_online_problem(tmp_path, reward_model=False)
    paths["rewards"].write_text(TRL_REWARDS)  # cat_or_nothing needs 'answer'; the prompts have none
    out = tmp_path / "run"
    assert main(online_cli_args(paths, out, kind="grpo", reward="cat_or_nothing")) == 2
    err = capsys.readouterr().err
    assert "online.reward_functions[0]: reward function 'cat_or_nothing' requires 'answer'" in err
    assert not out.exists()  # refused by the pre-flight, before the run folder: the same command runs again
    # one row without it: a data error naming the file, the row and the column, also before anything is written
    rows = [{"prompt": p, "answer": "cat"} for p in ("a b", "the cat", "one")]
    del rows[1]["answer"]
    paths["prompts"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(online_cli_args(paths, out, kind="grpo", reward="cat_or_nothing")) == 2
    err = capsys.readouterr().err
    assert f"{paths['prompts']}, line 2, field 'answer': the row has no 'answer'" in err and not out.exists()


# ----------------------------------------------------------------------------------------------------------
# Every shape, read by each trainer (one file of mixed shapes per trainer: shapes are detected per row)

USER, BOT = "user", "assistant"


def msg(role, text):
    return {"role": role, "content": text}


HH = "\n\nHuman: the cat ?\n\nAssistant: yes good"
PREFERENCE_ROWS = [
    {"prompt": "the cat", "chosen": "sat good", "rejected": "ran bad"},
    {"prompt": [msg(USER, "one")], "chosen": "two good", "rejected": [msg(BOT, "ten bad")]},
    {
        "chosen": [msg(USER, "hello"), msg(BOT, "world good")],
        "rejected": [msg(USER, "hello"), msg(BOT, "dog bad")],
    },
    {"chosen": HH, "rejected": HH.replace("yes good", "no bad")},
    {
        "prompt": "the dog ?",
        "chosen": [msg(USER, "the dog ?"), msg(BOT, "yes good")],
        "rejected": [msg(USER, "the dog ?"), msg(BOT, "no bad")],
    },
]
SFT_ROWS = [
    {"text": "the cat sat on a mat ."},
    {"prompt": "one two", "completion": "three four ."},
    {"messages": [msg(USER, "hello"), msg(BOT, "world .")]},
    {"prompt": "yes", "completion": [msg(USER, "yes"), msg(BOT, "no .")]},
]
PROMPT_ROWS = [
    {"prompt": "the cat"},
    {"prompt": [msg(USER, "hello")]},
    {"messages": [msg(USER, "one"), msg(BOT, "x")]},
    PREFERENCE_ROWS[2],
    PREFERENCE_ROWS[3],
]


def write_model(root):
    tokenizer = tiny_tokenizer(chat_template=True)
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    tiny_llama(seed=0, **ids).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model"


def base_args(tmp_path, kind, model, data, *extra):
    config = tmp_path / f"{kind}.yaml"
    config.write_text("seed: 0\n")
    return [
        "train",
        kind,
        "--config",
        str(config),
        f"output_dir={tmp_path / kind}",
        f"model.name_or_path={model}",
        f"data.train_file={data}",
        "train.max_steps=1",
        "train.batch_size=4",
        "data.max_prompt_length=24",
        "data.max_length=40",
        *extra,
    ]


@pytest.mark.slow
def test_each_trainer_reads_every_shape(tmp_path):
    model = write_model(tmp_path)
    files = {}
    for name, rows in (("prefs", PREFERENCE_ROWS), ("sft", SFT_ROWS), ("prompts", PROMPT_ROWS)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "r.py").write_text(
        "def length(prompts, completions, **kw):\n    return [1.0 * len(c) for c in completions]\n"
    )
    assert main(base_args(tmp_path, "reward", model, files["prefs"], "train.batch_size=5")) == 0
    assert json.loads((tmp_path / "reward" / "summary.json").read_text())["train_pairs"] == len(
        PREFERENCE_ROWS
    )
    assert main(base_args(tmp_path, "sft", model, files["sft"])) == 0
    assert json.loads((tmp_path / "sft" / "summary.json").read_text())["train_examples"] == len(SFT_ROWS)
    assert (
        main(
            base_args(
                tmp_path,
                "grpo",
                model,
                files["prompts"],
                "train.batch_size=5",
                "online.group_size=2",
                "online.response_length=4",
                f"online.reward_functions=[{tmp_path / 'r.py'}:length]",
            )
        )
        == 0
    )
    prompts = [
        r["prompt"] for r in map(json.loads, (tmp_path / "grpo" / "samples.jsonl").read_text().splitlines())
    ]
    expected = [
        "the cat",
        [msg(USER, "hello")],
        [msg(USER, "one")],
        [msg(USER, "hello")],
        "\n\nHuman: the cat ?\n\nAssistant:",
    ]
    assert all(p in expected for p in prompts)
