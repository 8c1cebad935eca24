"""examples/experiments/distill_evidence.py: the comparisons it prints are the plan's, b - a the right way round
and decided by the page's rule; and end to end at the smoke size (one seed: every arm, the teacher-token budget
of the SFT arm, the 4-sample reads, the cache, --report-only)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.examples.loader import load_example, smoke_seed


def results(gold_by_seed):
    """``figures.json`` contents with the given gold per policy (one dict per seed)."""
    return [
        {"seed": s, "reads": {k: {"gold": v} for k, v in gold.items()}} for s, gold in enumerate(gold_by_seed)
    ]


def test_the_report_decides_the_plans_three_comparisons_b_minus_a():
    script = load_example("experiments/distill_evidence")
    wobble = [0.01 * (i % 3 - 1) for i in range(10)]
    seeds = [
        {
            "sft": 0.0,
            "teacher": 1.0,
            "distill_reverse_kl": 0.6 + w,
            "distill_jsd": 0.6 - w,  # within 0.02 of reverse KL
            "sft_teacher": 0.2,  # below distillation: distill.sft holds
            "ppo": 0.9 + 2 * w,  # above distillation: distill.rl fails
        }
        for w in wobble
    ]
    text = script.report(results(seeds))
    lines = {line.split(" ")[1]: line for line in text.splitlines() if line.startswith("- distill.")}
    assert lines["distill.sft"].startswith("- distill.sft (distill_reverse_kl - sft_teacher): +0.40")
    assert lines["distill.sft"].endswith("-> holds")
    assert lines["distill.rl"].startswith("- distill.rl (distill_reverse_kl - ppo): -0.30")
    assert lines["distill.rl"].endswith("-> fails")
    assert lines["distill.loss"].endswith("-> no difference (within ±0.1)")
    # 10 seeds of one sign: exact p = 2 / 2^10 each; Holm over the family's two directions doubles the smaller
    assert "exact p = 0.00195; Holm p = 0.00391 ->" in lines["distill.sft"]
    assert "exact p = 0.00195; Holm p = 0.00391 ->" in lines["distill.rl"]
    assert "Holm p" not in lines["distill.loss"]  # a no-difference claim is not in the correction


@pytest.mark.long  # end to end, about two minutes: CI's long step (the suite stays under 15 minutes)
def test_distill_evidence_runs_at_smoke_size_and_reuses_its_stages(tmp_path, monkeypatch, capsys):
    script = load_example("experiments/distill_evidence")
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    out = tmp_path / "evidence"
    figures = smoke_seed(script, out)
    seed = out / "seed-0"
    assert set(figures["reads"]) == {
        "sft",
        "teacher",
        "distill_reverse_kl",
        "distill_jsd",
        "sft_teacher",
        "ppo",
    }
    configs = {
        a: yaml.safe_load((seed / a / "config.yaml").read_text())
        for a in ("distill_reverse_kl", "distill_jsd", "ppo")
    }
    assert configs["distill_reverse_kl"]["distill"]["loss"] == "reverse_kl"
    assert configs["distill_jsd"]["distill"]["loss"] == "jsd"
    # equal student updates: the PPO arm's rollouts and batch are the distillation's
    for key in ("max_steps", "batch_size"):
        assert configs["ppo"]["train"][key] == configs["distill_reverse_kl"]["train"][key]
    # the SFT arm's teacher samples: as many response tokens as the distillation's teacher scored
    rows = [
        json.loads(line) for line in (seed / "distill_reverse_kl" / "metrics.jsonl").read_text().splitlines()
    ]
    cfg = configs["distill_reverse_kl"]
    scored = sum(r["response_length/mean"] for r in rows if "response_length/mean" in r)
    scored *= cfg["train"]["batch_size"] * cfg["online"]["group_size"]
    assert figures["teacher_scored_tokens"] == round(scored)
    longest = cfg["online"]["response_length"]
    assert scored <= figures["sft_teacher_tokens"] < scored + longest + 1
    samples = (seed / "teacher_samples" / "train.jsonl").read_text().splitlines()
    assert len(samples) == figures["sft_teacher_rows"] and all(
        json.loads(s)["completion"].strip() for s in samples
    )
    assert yaml.safe_load((seed / "sft_teacher" / "config.yaml").read_text())["model"]["name_or_path"] == str(
        seed / "sft" / "final"
    )
    capsys.readouterr()
    # a finished seed is read back, not run again; --report-only prints the three comparisons
    assert script.main(["--out", str(out), "--seeds", "0", "--smoke"]) == 0
    again = capsys.readouterr().out
    assert (
        "[seed-0]" not in again
        and json.loads((seed / "figures.json").read_text())["reads"] == figures["reads"]
    )
    assert script.main(["--out", str(out), "--seeds", "0", "--report-only"]) == 0
    printed = capsys.readouterr().out
    assert all(f"- distill.{c} " in printed for c in ("sft", "rl", "loss"))


def test_finished_seeds_are_recorded_and_a_recorded_seed_is_not_run_again(tmp_path, capsys):
    """The records (committed with the code) carry a claim's seeds over sittings: a seed that finished is copied
    there, and with its record present a fresh output folder neither runs it again nor loses it from the report."""
    script = load_example("experiments/distill_evidence")
    ran = []

    def run_seed(out, seed, preset, eval_prompts):
        ran.append(seed)
        (out / f"seed-{seed}").mkdir(parents=True)
        (out / f"seed-{seed}" / "figures.json").write_text(json.dumps({"seed": seed, "gold": 0.5 + seed}))

    def report(results):
        return " ".join(f"{r['seed']}:{r['gold']}" for r in results)

    records = tmp_path / "records"
    argv = ["--seeds", "0", "1", "--records", str(records)]
    assert script.evidence_main([*argv, "--out", str(tmp_path / "a")], "doc", run_seed, report, "x.md") == 0
    assert ran == [0, 1]
    assert json.loads((records / "seed-1.json").read_text()) == {"seed": 1, "gold": 1.5}
    # another sitting: a new output folder, seed 1's record present, seed 2 new
    (records / "seed-0.json").unlink()
    out_b = tmp_path / "b"
    argv = ["--seeds", "0", "1", "2", "--records", str(records), "--out", str(out_b)]
    assert script.evidence_main(argv, "doc", run_seed, report, "x.md") == 0
    assert ran == [0, 1, 0, 2]
    assert capsys.readouterr().out.split() == ["0:0.5", "1:1.5", "0:0.5", "1:1.5", "2:2.5"]
    assert json.loads((out_b / "seed-1" / "figures.json").read_text())["gold"] == 1.5
    # --report-only runs nothing and reads the records
    argv = ["--seeds", "1", "2", "--records", str(records), "--out", str(tmp_path / "c"), "--report-only"]
    assert script.evidence_main(argv, "doc", run_seed, report, "x.md") == 0
    assert ran == [0, 1, 0, 2] and capsys.readouterr().out.split() == ["1:1.5", "2:2.5"]
