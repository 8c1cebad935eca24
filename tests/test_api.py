"""The Python entry point ``rlhfkit.train(kind, config, train_dataset=None) -> Path``: sft and grpo on tiny models
from a list of dicts and from a ``datasets.Dataset``, a config as a dict (nested and dotted) or a YAML file; the
run equal to the command line's; a mistake raised as the ConfigError / DataError whose message the command line
prints; the dict-of-keys reader."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import rlhfkit
from rlhfkit.cli import main
from rlhfkit.config import nest_keys
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.errors import ConfigError, DataError
from tests.trainers.online.online_fixtures import PROMPTS, write_online_problem
from tests.trainers.sft_fixtures import PAIRS, write_sft_problem

SFT_ROWS = [{"prompt": p, "completion": c} for p, c in PAIRS * 2]
DOCS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "python.md"
README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(page: Path) -> list[str]:
    return [
        body
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", page.read_text(), re.S | re.M)
        if lang == "python"
    ]


@pytest.fixture(scope="module")
def sft_paths(tmp_path_factory):
    return write_sft_problem(tmp_path_factory.mktemp("api-sft"))


@pytest.fixture(scope="module")
def online_paths(tmp_path_factory):
    return write_online_problem(tmp_path_factory.mktemp("api-online"), reward_model=False)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv(
        "RLHFKIT_NUM_THREADS", "1"
    )  # the entry point, like the command line, would take every core


def sft_config(paths, out) -> dict:
    """Nested sections and dotted keys mixed, as a notebook would write them; a Path value as it comes."""
    return {
        "output_dir": out,
        "model": {"name_or_path": paths["model"]},
        "train": {"batch_size": 4, "micro_batch_size": 2, "learning_rate": 3e-3, "lr_schedule": "constant"},
        "train.max_steps": 2,
        "data.max_prompt_length": 16,
        "data.max_length": 32,
    }


def test_sft_from_a_list_of_dicts_is_the_command_lines_run_on_the_same_rows(sft_paths, tmp_path):
    out = rlhfkit.train("sft", sft_config(sft_paths, tmp_path / "api"), train_dataset=SFT_ROWS)
    assert out == tmp_path / "api" and (out / "final" / "model.safetensors").is_file()
    kept = out / "inputs" / "train_dataset.jsonl"
    assert [json.loads(line) for line in kept.read_text().splitlines()] == SFT_ROWS
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["train_file"] == str(kept)
    # the same rows from a file, through the command line: the same weights
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in SFT_ROWS))
    config = tmp_path / "cli.yaml"
    config.write_text(yaml.safe_dump({**nest_keys(sft_config(sft_paths, tmp_path / "cli"), "t"), "seed": 0}))
    assert main(["train", "sft", "--config", str(config), f"data.train_file={rows}"]) == 0
    api, cli = (
        load_file(str(out / "final" / "model.safetensors")),
        load_file(str(tmp_path / "cli" / "final" / "model.safetensors")),
    )
    assert api.keys() == cli.keys() and all(torch.equal(api[k], cli[k]) for k in api)
    initial = load_file(str(sft_paths["model"] / "model.safetensors"))
    assert any(not torch.equal(initial[k], api[k]) for k in initial)  # it trained


def test_sft_from_a_yaml_file_and_a_datasets_dataset_resumed_by_the_command_line(sft_paths, tmp_path):
    from datasets import Dataset

    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump(nest_keys(sft_config(sft_paths, tmp_path / "run"), "t")))
    out = rlhfkit.train("sft", str(config), train_dataset=Dataset.from_list(SFT_ROWS))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r][-1] == 2
    assert json.loads((out / "summary.json").read_text())["kind"] == "sft"
    # the run's config.yaml names its kept rows: the command line resumes it without the Dataset
    assert main(["train", "sft", "--config", str(out / "config.yaml"), "--resume", "train.max_steps=3"]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r][-1] == 3


def test_grpo_from_a_datasets_dataset_with_the_sequence_level_ratio(online_paths, tmp_path):
    from datasets import Dataset

    config = {
        "output_dir": str(tmp_path / "grpo"),
        "model.name_or_path": str(online_paths["policy"]),
        "online": {
            "reward_functions": [f"{online_paths['rewards']}:cat_count"],
            "group_size": 2,
            "response_length": 6,
            "ppo_epochs": 2,
            "num_minibatches": 2,
            "importance_sampling_level": "sequence",
        },
        "train": {"batch_size": 4, "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3},
        "data.max_prompt_length": 16,
    }
    out = rlhfkit.train("grpo", config, train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all("loss/policy" in r for r in rows)
    initial = load_file(str(online_paths["policy"] / "model.safetensors"))
    final = load_file(str(out / "final" / "model.safetensors"))
    assert any(not torch.equal(initial[k], final[k]) for k in initial)


def _cli_error(capsys, argv) -> str:
    assert main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("rlhfkit: error: ")
    return line.removeprefix("rlhfkit: error: ")


def test_a_config_mistake_is_the_command_lines_message_as_an_exception(sft_paths, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    values = {**nest_keys(sft_config(sft_paths, tmp_path / "run"), "t"), "per_device_train_batch_size": 4}
    config.write_text(yaml.safe_dump(values))
    with pytest.raises(ConfigError) as error:
        rlhfkit.train("sft", config, train_dataset=SFT_ROWS)
    assert str(error.value) == _cli_error(capsys, ["train", "sft", "--config", str(config)])
    assert "train.micro_batch_size" in str(error.value)
    assert not (tmp_path / "run").exists()  # before the run folder


def test_a_bad_row_names_train_dataset_the_row_and_the_field(sft_paths, tmp_path, capsys):
    rows = [*SFT_ROWS[:2], {"prompt": "hello", "completion": 7}, *SFT_ROWS[2:]]
    with pytest.raises(DataError) as error:
        rlhfkit.train("sft", sft_config(sft_paths, tmp_path / "run"), train_dataset=rows)
    message = str(error.value)
    assert message.startswith("train_dataset, row 2, field 'completion': ")
    # the command line on the same rows as a file: the same words, with the file and its line
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "cli.yaml"
    config.write_text(yaml.safe_dump(nest_keys(sft_config(sft_paths, tmp_path / "cli"), "t")))
    cli = _cli_error(capsys, ["train", "sft", "--config", str(config), f"data.train_file={path}"])
    assert cli == message.replace("train_dataset, row 2", f"{path}, line 3")


@pytest.mark.parametrize(
    "dataset, match",
    [
        ([], "train_dataset: has no rows"),
        ([{"prompt": "a", "completion": "b"}, "text"], "train_dataset, row 1: expected a dict, got str"),
        ([{"prompt": "a", "completion": {1, 2}}], "train_dataset, row 0: not JSON data"),
        ({"train": []}, r"train_dataset: expected one split, e.g. train_dataset\['train'\]"),
        ("rows.jsonl", "train_dataset: expected a datasets.Dataset or a list of dicts, got str"),
    ],
)
def test_a_dataset_that_is_no_list_of_rows_is_refused_by_name(sft_paths, tmp_path, dataset, match):
    with pytest.raises(DataError, match=match):
        rlhfkit.train("sft", sft_config(sft_paths, tmp_path / "run"), train_dataset=dataset)
    assert not (tmp_path / "run").exists()


def test_train_file_and_train_dataset_together_are_refused(sft_paths, tmp_path):
    config = {**sft_config(sft_paths, tmp_path / "run"), "data.train_file": str(sft_paths["train"])}
    with pytest.raises(ConfigError, match="data.train_file is set and train_dataset is given"):
        rlhfkit.train("sft", config, train_dataset=SFT_ROWS)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(nest_keys(config, "t")))
    with pytest.raises(ConfigError, match=f"{path}: data.train_file is set"):
        rlhfkit.train("sft", path, train_dataset=SFT_ROWS)


def test_an_unknown_key_in_the_dict_names_the_dict(sft_paths, tmp_path):
    with pytest.raises(ConfigError, match=r"the config dict: unknown key 'train.max_stpes' \(did you mean"):
        rlhfkit.train("sft", {**sft_config(sft_paths, tmp_path / "r"), "train.max_stpes": 3}, SFT_ROWS)
    with pytest.raises(ConfigError, match="config: expected a YAML file's path or a dict of keys, got list"):
        rlhfkit.train("sft", ["train.max_steps=3"], SFT_ROWS)


def test_nest_keys_merges_sections_and_dotted_keys():
    got = nest_keys(
        {"model": {"name_or_path": Path("m")}, "model.lora_rank": 8, "online.reward_functions": ("a:b",)}, "s"
    )
    assert got == {"model": {"name_or_path": "m", "lora_rank": 8}, "online": {"reward_functions": ["a:b"]}}
    assert nest_keys({"data": {"columns": {"prompt": "q"}}}, "s") == {"data": {"columns": {"prompt": "q"}}}
    with pytest.raises(ConfigError, match="s: 'train.max_steps' is set twice"):
        nest_keys({"train.max_steps": 2, "train": {"max_steps": 3}}, "s")
    with pytest.raises(ConfigError, match="s: 'train.max_steps' is set twice"):
        nest_keys({"train": {"max_steps": 3}, "train.max_steps": 2}, "s")
    with pytest.raises(ConfigError, match="s: 'model.lora_rank' goes inside a key that holds a value"):
        nest_keys({"model": 3, "model.lora_rank": 8}, "s")
    with pytest.raises(ConfigError, match="s: expected a dict of keys"):
        nest_keys(["train.max_steps=2"], "s")
    with pytest.raises(ConfigError, match="s: key 3 is not a string"):
        nest_keys({3: 1}, "s")


def test_the_docs_example_runs_as_written(sft_paths, tmp_path, monkeypatch):
    """docs/python.md's block, run as a notebook runs it (its functions in ``__main__``), with the Hub model
    swapped for the tiny stand-in: SFT from a list of dicts, then GRPO from its final/ on a Dataset."""
    block = next(
        body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", DOCS_PAGE.read_text(), re.S | re.M)
    )
    assert block.count("HuggingFaceTB/SmolLM2-135M-Instruct") == 1
    code = block.replace("HuggingFaceTB/SmolLM2-135M-Instruct", str(sft_paths["model"]))
    monkeypatch.chdir(tmp_path)
    notebook = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    exec(compile(code, str(DOCS_PAGE), "exec"), notebook.__dict__)
    grpo = notebook.__dict__["grpo"]
    assert grpo == Path("runs/notebook-grpo") and (grpo / "report.html").is_file()
    assert [r["step"] for r in read_metrics(grpo / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (tmp_path / "runs" / "notebook-sft" / "inputs" / "train_dataset.jsonl").is_file()


def test_the_readme_example_resolves(monkeypatch, tmp_path):
    """The README's call, checked as `rlhfkit config show` checks a command (no model is loaded): its keys exist
    for its kind and its rows are a valid dataset."""
    from rlhfkit.commands import _write_rows, train_config

    calls = []

    def check(kind, config, train_dataset=None):
        rows = _write_rows(train_dataset, tmp_path / "train_dataset.jsonl")
        layers = (
            ("the config dict", nest_keys(config, "the config dict")),
            ("rows", {"data": {"train_file": str(rows)}}),
        )
        calls.append(train_config(kind, None, [], layers=layers))

    monkeypatch.setattr(rlhfkit, "train", check)
    block = next(body for body in python_blocks(README) if "rlhfkit.train(" in body)
    exec(compile(block, str(README), "exec"), {})
    assert [cfg.kind for cfg in calls] == ["sft"] and calls[0].train.max_steps == 50
