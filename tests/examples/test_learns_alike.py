"""examples/experiments/learns_alike.py: the launch of each arm, the runs' settings, the verdict and the table by
hand, and the whole experiment at the smoke size (slow: 3 launches). The figures come from the full run
(docs/experiments.md)."""

from __future__ import annotations

import sys

import pytest

from tests.examples.loader import load_example

ex = load_example("experiments/learns_alike")


def _records(base_gold, sharded_gold, sft_gold=0.0):
    records = []
    for seed, (b, sh) in enumerate(zip(base_gold, sharded_gold, strict=True)):
        figures = {"proxy": 0.0, "kl": 0.0, "length": 10.0}
        records.append({"kind": "sft", "arm": "sft", "seed": seed, "gold": sft_gold, **figures})
        train = [{"rollout": 1, "score": 0.0, "kl": 0.0}, {"rollout": 2, "score": 1.0, "kl": 0.1}]
        for arm, gold in (("1", b), ("2-sharded", sh)):
            records.append(
                {
                    "kind": "ppo",
                    "arm": arm,
                    "seed": seed,
                    "gold": gold,
                    "seconds": 1.0,
                    **figures,
                    "train": train,
                }
            )
    return records


def test_each_arm_launches_as_its_name_says():
    one = ex.launch_argv("ppo", "1", "c.yaml")
    assert one[0] == sys.executable and "torch.distributed.run" not in one
    assert not any(a.startswith("train.sharding") for a in one)
    dp = ex.launch_argv("grpo", "2-dp", "c.yaml")
    assert dp[1:3] == ["-m", "torch.distributed.run"] and dp[dp.index("--nproc_per_node") + 1] == "2"
    assert not any(a.startswith("train.sharding") for a in dp)
    sharded = ex.launch_argv("grpo", "2-sharded", "c.yaml")
    assert sharded[: len(dp)] == dp and sharded[len(dp) :] == ["train.sharding=full_shard"]
    engine = ex.launch_argv("ppo", "vllm", "c.yaml")
    assert engine[: len(one)] == one and engine[len(one) :] == ["online.generation_backend=vllm"]
    assert "vllm" not in ex.DEFAULT_ARMS  # it needs the environment of ./setup.sh vllm


def test_grpo_gets_as_many_responses_a_rollout_as_ppo():
    s = ex.SIZES["default"]
    stage = {"sft": "sft", "reward": "rm", "files": {"prompts_train": "p.jsonl"}}
    ppo, grpo = ex.run_config("ppo", "x", 0, stage, s), ex.run_config("grpo", "y", 0, stage, s)
    assert grpo["train.batch_size"] * grpo["online.group_size"] == ppo["train.batch_size"] == s.ppo_batch
    assert {k: v for k, v in ppo.items() if k not in ("output_dir", "train.batch_size")} == {
        k: v for k, v in grpo.items() if k not in ("output_dir", "train.batch_size", "online.group_size")
    }


def test_the_verdicts_are_the_pages_rule_on_the_paired_gold():
    by = lambda records, arm: ex._by(records, "ppo", arm)  # noqa: E731
    sft = lambda records: ex._by(records, "sft", "sft")  # noqa: E731
    # differences +0.02, -0.01, +0.03, 0.00, +0.01, 0.00: mean +0.0083, 90% interval inside ±0.1; six seeds, so
    # that "above SFT" can pass the exact test (p = 2 / 64)
    base = [1.0, 2.0, 3.0, 1.5, 2.5, 2.0]
    alike = _records(base, [1.02, 1.99, 3.03, 1.5, 2.51, 2.0])
    assert ex.verdict(by(alike, "1"), by(alike, "2-sharded"), sft(alike)) == (
        "alike (within ±0.1 gold): no difference (within ±0.1); above SFT: holds"
    )
    # one seed-sd of the base arm (0.79) would call +0.3 on every seed alike; the rule says it is a difference
    apart = _records(base, [b + 0.3 + 0.01 * i for i, b in enumerate(base)])
    assert ex.verdict(by(apart, "1"), by(apart, "2-sharded"), sft(apart)).startswith(
        "alike (within ±0.1 gold): fails;"
    )
    # differences of ±0.5: neither inside the margin nor outside it; and a seed below its SFT policy
    wide = _records(base, [1.5, 1.5, 3.5, 1.0, 2.5, 1.5], sft_gold=1.2)
    assert ex.verdict(by(wide, "1"), by(wide, "2-sharded"), sft(wide)) == (
        "alike (within ±0.1 gold): open; above SFT: open"
    )
    five = _records(base[:5], [1.02, 1.99, 3.03, 1.5, 2.51])  # 5 of 5 above SFT: exact p = 0.0625
    assert ex.verdict(by(five, "1"), by(five, "2-sharded"), sft(five)).endswith("above SFT: open")
    one = _records([1.0], [1.0])
    assert ex.verdict(by(one, "1"), by(one, "2-sharded"), sft(one)).endswith("open; above SFT: open")


def test_the_table_has_every_seed_and_the_paired_difference():
    text = ex.markdown(_records([1.0, 2.0, 3.0], [2.5, 1.5, 2.9]), ["ppo"], ["1", "2-sharded"])
    assert "| PPO, 2 processes, FSDP2 full_shard | 2.30 (2.50 / 1.50 / 2.90) |" in text
    assert "| SFT | 0.00 (0.00 / 0.00 / 0.00) |" in text
    assert "FSDP2 full_shard minus 1 process: +0.30 (+1.50 / -0.50 / -0.10)" in text


@pytest.mark.long  # a whole experiment end to end: CI's long step (the suite stays under 15 minutes)
def test_the_experiment_end_to_end_at_the_smoke_size(tmp_path):
    out = tmp_path / "out"
    assert ex.main(["--out", str(out), "--size", "smoke", "--seeds", "0", "--kinds", "grpo"]) == 0
    records = ex.collect(out, [0], ["grpo"], list(ex.DEFAULT_ARMS))
    assert {r["arm"] for r in records} == {"sft", *ex.DEFAULT_ARMS}
    for r in records[1:]:
        assert len(r["train"]) == ex.SIZES["smoke"].rollouts and r["seconds"] > 0
    sharded = out / "seed-0" / "grpo-2-sharded"
    assert "full_shard" in (sharded / "config.yaml").read_text()
    assert (sharded / "final" / "config.json").is_file()  # gathered into a plain HF folder
    assert (out / "learns_alike.png").stat().st_size > 0
    text = (out / "learns_alike.md").read_text()  # one seed: the rule has no interval to decide on
    assert "verdicts (the page's rule): alike (within ±0.1 gold): open; above SFT: open" in text
    assert all(r["eval_samples"] == ex.SIZES["smoke"].final_samples for r in records)  # the final read
