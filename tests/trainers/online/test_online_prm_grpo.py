"""The online loop with a process reward model (dense step rewards), with the KL as a k3 loss term
(``online.kl_in_loss``), and the degenerate-group metrics: each against a hand computation."""

import json

import pytest
import torch

from rlhfkit.algos import kl_k3
from rlhfkit.cli import main
from rlhfkit.config import load_config
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.tasks import get_task
from rlhfkit.trainers.online import collect
from rlhfkit.trainers.online.ppo_update import micro_batch_loss
from tests.helpers import tiny_llama
from tests.trainers.online.online_fixtures import make_context
from tests.trainers.online.test_online import _hand_built_generation, rollout_for_update


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    """The arithmetic task's tokenizer, a random tiny policy and PRM, a few prompts."""
    root = tmp_path_factory.mktemp("arith")
    task = get_task("arithmetic")
    tok = task.build_tokenizer(root / "policy")
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    ids["eos_token_id"] = tok.eos_token_id
    tiny_llama(seed=0, **ids).save_pretrained(root / "policy")
    prm = tiny_llama("scalar", seed=1, **ids)
    prm.save_pretrained(root / "prm")
    tok.save_pretrained(root / "prm")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in task.prompts("train")[:8]))
    return root


def overrides(root, out, *extra):
    return [
        f"output_dir={out}",
        f"model.name_or_path={root / 'policy'}",
        f"data.train_file={root / 'prompts.jsonl'}",
        "online.reward_functions=[rlhfkit.tasks.arithmetic:step_accuracy_reward]",
        "train.batch_size=4",
        "train.learning_rate=1e-3",
        "train.lr_schedule=constant",
        "online.response_length=8",
        "online.temperature=1.0",
        "online.ppo_epochs=1",
        "data.max_prompt_length=16",
        "online.kl_coef=0.2",
        *extra,
    ]


def _stepped_responses(problem, monkeypatch):
    """The tokenizer and four 20-token responses with steps (one cut off mid-step), each ended by EOS and padded
    with it, "sampled" by a stand-in generator (a random policy would write no steps)."""
    from rlhfkit.models import load_tokenizer

    tok = load_tokenizer(str(problem / "policy"))
    texts = ["7+5=12\n12-3=9\nanswer=9\n", "1+1=2\n", "3-1=2\n2+2=", "answer=4\n"]
    raw = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    raw = [(r + [tok.eos_token_id] * 20)[:20] for r in raw]
    monkeypatch.setattr(collect, "generate_responses", _hand_built_generation(tok, raw))
    return tok, raw


def test_ppo_with_a_prm_adds_its_step_rewards_to_the_outcome(problem, tmp_path, monkeypatch):
    """Responses with steps (a random policy would write none): "sampled" by a stand-in generator."""
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    _stepped_responses(problem, monkeypatch)
    out = tmp_path / "ppo"
    config = tmp_path / "c.yaml"
    config.write_text("seed: 0\n")
    args = overrides(
        problem,
        out,
        f"online.process_reward_model={problem / 'prm'}",
        "train.max_steps=2",
        "online.response_length=20",
    )
    assert main(["train", "ppo", "--config", str(config), *args]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert rows
    assert all(
        row["score/process_steps"] == pytest.approx(6 / 4) and row["score/process_mean"] != 0 for row in rows
    )
    for row in rows:
        assert "score/process_mean" in row and "score/process_steps" in row
        # per response: outcome + the PRM's step rewards - kl_coef * KL (nothing masked: every response kept)
        expected = row["score/mean"] + row["score/process_mean"] - 0.2 * row["kl/mean"]
        assert row["reward/mean"] == pytest.approx(expected, abs=1e-5)


def test_grpo_on_a_prm_alone_takes_the_step_rewards_as_the_whole_reward(problem, tmp_path, monkeypatch):
    """No outcome scorer (Math-Shepherd's PRM-only RL): every response is scored 0 and kept, its reward is the
    sum of its step rewards, each P - 1 at a step end, less the KL penalty; GRPO's advantages come from that."""
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    from rlhfkit.data import TokenLimits, prepare_examples
    from rlhfkit.models import load_scalar_model
    from rlhfkit.rollout.process_rewards import process_rewards, step_end_table, step_ends

    tok, raw = _stepped_responses(problem, monkeypatch)
    out = tmp_path / "grpo"
    args = [a for a in overrides(problem, out) if not a.startswith("online.reward_functions")]
    prompt = get_task("arithmetic").prompts("train")[0]  # one prompt, so each row's PRM input is known
    (tmp_path / "one.jsonl").write_text(json.dumps({"prompt": prompt}) + "\n")
    args += [
        f"data.train_file={tmp_path / 'one.jsonl'}",
        f"online.process_reward_model={problem / 'prm'}",
        "train.max_steps=1",
        "train.batch_size=2",
        "online.group_size=2",
        "online.response_length=20",
    ]
    config = tmp_path / "c.yaml"
    config.write_text("seed: 0\n")
    assert main(["train", "grpo", "--config", str(config), *args]) == 0
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    # the PRM's step rewards of the four responses, by hand: P - 1 at each text's step ends
    prm = load_scalar_model(str(problem / "prm"), frozen=True)
    limits = TokenLimits(16, None, "left")  # the prompt's ids as the loop prepares them
    prompt_ids = list(prepare_examples(str(tmp_path / "one.jsonl"), "prompts", tok, limits)[0]["prompt_ids"])
    steps, per_row = 0, []
    for r in raw:  # the response runs to its first EOS; the padding after it is masked
        ids = torch.tensor([prompt_ids + r])
        mask = (torch.arange(len(r)) <= r.index(tok.eos_token_id))[None]
        ends = step_ends(torch.tensor([r]), mask, step_end_table(tok, "\n"))
        steps += int(ends.sum())
        per_row.append(float(process_rewards(prm, ids, torch.ones_like(ids), len(prompt_ids), ends).sum()))
    assert row["score/mean"] == 0.0 and row["score/process_steps"] == pytest.approx(steps / 4)
    assert row["score/process_mean"] == pytest.approx(sum(per_row) / 4, abs=1e-5)
    assert row["reward/mean"] == pytest.approx(row["score/process_mean"] - 0.2 * row["kl/mean"], abs=1e-5)


def test_kl_in_loss_is_k3_against_the_reference_and_leaves_the_reward(problem, tmp_path):
    # the plain k3 loss, chosen by name (the default is an unbiased form: tests/trainers/online/test_loss_terms.py)
    cfg = load_config(
        None,
        overrides(
            problem,
            tmp_path / "g",
            "online.group_size=2",
            "online.kl_in_loss=true",
            "online.kl_loss_estimator=k3",
            "train.max_steps=1",
        ),
        "grpo",
    )
    ctx = make_context(cfg)
    with torch.no_grad():  # a reference that differs from the actor, so that the KL is not 0
        for p in ctx.roles.reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rollout = rollout_for_update(ctx)
    # the loss with zero advantages is the KL term alone: kl_coef * token-mean k3(pi_theta, pi_ref)
    rollout.advantages = torch.zeros_like(rollout.advantages)
    mask = rollout.mask
    normalizer = float(mask.sum())
    from rlhfkit.trainers.online.context import StatSums

    loss, parts, _ = micro_batch_loss(ctx, rollout, normalizer, StatSums(), True)
    k3 = kl_k3(rollout.logprobs, rollout.ref_logprobs)  # the actor has not moved: new = old log-probs
    expected = (k3 * mask).sum() / normalizer
    assert (
        float(parts["loss/kl"].detach()) == pytest.approx(float(expected), rel=1e-4) and float(expected) > 0
    )
    assert float(loss.detach()) == pytest.approx(0.2 * float(expected), rel=1e-4)
    loss.backward()  # and it has a gradient
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in ctx.roles.actor.parameters())


def test_grpo_run_with_kl_in_loss_logs_groups_and_keeps_the_kl_out_of_the_reward(
    problem, tmp_path, monkeypatch
):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    out = tmp_path / "grpo"
    config = tmp_path / "c.yaml"
    config.write_text("seed: 0\n")
    rewards = tmp_path / "rewards.py"  # varies within a group, so the policy moves and the KL is not 0
    rewards.write_text(
        "def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n"
    )
    args = overrides(
        problem,
        out,
        "online.group_size=4",
        "online.kl_in_loss=true",
        "train.max_steps=3",
        "online.missing_eos=none",
    )
    args = [a for a in args if not a.startswith("online.reward_functions")] + [
        f"online.reward_functions=[{rewards}:length]"
    ]
    assert main(["train", "grpo", "--config", str(config), *args]) == 0
    marker = json.loads((out / "checkpoints" / "step-3" / "COMPLETE").read_text())
    assert marker["models"] == ["actor"]  # no critic
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    for row in rows:
        assert row["reward/mean"] == pytest.approx(row["score/mean"], abs=1e-6)  # the KL is not in the reward
        assert "loss/kl" in row and row["loss/kl"] >= 0
        for name in ("zero_std", "singleton", "partial", "empty"):
            assert 0.0 <= row[f"groups/{name}_fraction"] <= 1.0
        assert row["groups/singleton_fraction"] == 0.0 and row["groups/empty_fraction"] == 0.0
    assert rows[-1]["kl/mean"] > 1e-4  # the policy moved: a KL in the reward would have shown
