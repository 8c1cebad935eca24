"""The sampler of an online run (online.sampler) recorded with its version in config.yaml (the key and the run
line) and in summary.json; a kind that samples nothing records none."""

from __future__ import annotations

import json

import torch
import yaml

from rlhfkit.cli import main
from rlhfkit.config import load_config, read_run_info
from rlhfkit.engine.folder import run_sampler
from tests.trainers.online.online_fixtures import online_cli_args, online_config, write_online_problem


def test_an_online_run_records_its_sampler_in_config_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path, reward_model=False)
    out = tmp_path / "run"
    assert main(online_cli_args(paths, out, "train.max_steps=1", kind="grpo")) == 0
    record = {"name": "exact", "version": 1}
    assert yaml.safe_load((out / "config.yaml").read_text())["online"]["sampler"] == "exact"
    assert read_run_info(out / "config.yaml")["sampler"] == record
    assert json.loads((out / "summary.json").read_text())["sampler"] == record


def test_the_record_follows_the_setting_and_the_kind(tmp_path):
    paths = {"policy": tmp_path, "prompts": tmp_path / "p.jsonl", "rewards": tmp_path / "r.py"}
    multinomial = online_config(paths, tmp_path / "run", "online.sampler=multinomial", kind="grpo")
    assert run_sampler(multinomial) == {"name": "multinomial", "version": f"torch {torch.__version__}"}
    sft = load_config(
        None, [f"output_dir={tmp_path}", "model.name_or_path=m", "data.train_file=d.jsonl"], "sft"
    )
    assert run_sampler(sft) is None
