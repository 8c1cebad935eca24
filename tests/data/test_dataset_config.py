"""``data.dataset_config``: a dataset with several configurations (openai/gsm8k has main and socratic), here a
local dataset repository folder whose card names them, read by ``datasets.load_dataset(path, name)``."""

import json

import pytest

from rlhfkit.config import load_config
from rlhfkit.data import TokenLimits, load_dataset_records, prepare_run_data
from rlhfkit.errors import DataError

CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
  - split: test
    path: main/test.jsonl
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train.jsonl
---
# two configurations, as openai/gsm8k has
"""


@pytest.fixture
def repo(tmp_path):
    folder = tmp_path / "gsm-like"
    rows = {
        "main/train.jsonl": ["one two", "three four"],
        "main/test.jsonl": ["five six"],
        "socratic/train.jsonl": ["hello world", "the cat", "a dog"],
    }
    for name, questions in rows.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(
            "".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in questions)
        )
    (folder / "README.md").write_text(CARD)
    return folder


def prompts(records):
    return [r["prompt"] for r in records]


def test_each_configuration_is_read_by_its_name(repo):
    mapping = {"prompt": "question"}
    main = load_dataset_records(str(repo), "prompts", columns=mapping, dataset_config="main")
    assert prompts(main) == ["one two", "three four"]
    test = load_dataset_records(str(repo), "prompts", "test", mapping, dataset_config="main")
    assert prompts(test) == ["five six"]
    socratic = load_dataset_records(str(repo), "prompts", columns=mapping, dataset_config="socratic")
    assert prompts(socratic) == ["hello world", "the cat", "a dog"]


def test_a_missing_or_unknown_configuration_names_the_ones_there_are(repo, tmp_path):
    with pytest.raises(
        DataError, match=r"has several configurations \(main, socratic\); set data.dataset_config"
    ):
        load_dataset_records(str(repo), "prompts", columns={"prompt": "question"})
    with pytest.raises(DataError, match=r"has no configuration 'mian' \(main, socratic\)"):
        load_dataset_records(str(repo), "prompts", columns={"prompt": "question"}, dataset_config="mian")
    single = tmp_path / "p.jsonl"
    single.write_text('{"prompt": "hi"}\n')
    with pytest.raises(DataError, match="is one file, which has no configurations"):
        load_dataset_records(str(single), "prompts", dataset_config="main")


def test_the_run_reads_data_dataset_config(repo):
    from helpers import tiny_tokenizer

    cfg = load_config(
        None,
        [
            "output_dir=out",
            "model.name_or_path=m",
            f"data.train_file={repo}",
            "data.dataset_config=socratic",
            "data.columns={prompt: question}",
            "online.reward_model=rm",
        ],
        "grpo",
    )
    train, heldout = prepare_run_data(cfg.data, "prompts", tiny_tokenizer(), TokenLimits(16, None, "error"))
    assert heldout is None and [e["record"]["prompt"] for e in train] == ["hello world", "the cat", "a dog"]
