"""examples/experiments/gae_lambda.py end to end at a smoke size on a tiny random policy and reward model of the
built-in task: the two ends of lambda behave as GAE says whatever the critic (lambda = 0 has no variance once
(s_t, a_t) is given; lambda = 1 has the final reward's variance), and the tables and plot are written; and the
experiment reads the critic's values exactly as the PPO trainer does (its normalisation applied, so that returns
and values are on one scale)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from rlhfkit.tasks import get_task
from tests.examples.loader import EXAMPLES
from tests.helpers import tiny_llama


def _script():
    spec = importlib.util.spec_from_file_location("gae_lambda", EXAMPLES / "experiments" / "gae_lambda.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gae_lambda_experiment_runs_and_its_ends_behave(tmp_path, capsys):
    task = get_task("reviews", seed=0)
    folders = {}
    for name, kind in (("policy", "causal"), ("reward", "scalar")):
        folders[name] = tmp_path / name
        tokenizer = task.build_tokenizer(folders[name])
        ids = dict(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        tiny_llama(kind, seed=1, **ids).save_pretrained(folders[name])
    out = tmp_path / "exp"
    rows = _script().main(
        ["--out", str(out), "--policy", str(folders["policy"]), "--reward-model", str(folders["reward"])]
        + ["--prompts", "3", "--continuations", "4", "--max-new-tokens", "5", "--seeds", "0"]
    )
    assert {p.name for p in out.iterdir()} == {"gae_lambda.json", "gae_lambda.md", "gae_lambda.png"}
    assert json.loads((out / "gae_lambda.json").read_text()) == rows
    assert "| 0.95 |" in capsys.readouterr().out
    (row,) = rows
    assert row["pairs"] >= 3 and row["return_variance"] > 0
    assert row["variance_0"] == pytest.approx(0.0, abs=1e-9)  # delta_t: the next state is fixed by (s_t, a_t)
    assert row["variance_1"] == pytest.approx(row["return_variance"], rel=1e-6)  # R - V(s_t)
    assert row["variance_0.5"] < row["variance_1"]


def test_the_experiments_value_read_is_the_trainers():
    """Same critic, same prompt + response rows: the values the experiment builds its advantages from equal the
    trainer's (stage 1: ``model_inputs`` then ``critic_values``), on a critic whose stored normalisation is far
    from (1, 0), so a raw read of the head cannot pass."""
    from rlhfkit.models import response_values
    from rlhfkit.trainers.online.context import critic_values, model_inputs

    pad = 3
    critic = tiny_llama("scalar", seed=2, pad_token_id=pad)
    critic.config.rlhfkit_reward_gain, critic.config.rlhfkit_reward_bias = 2.5, -0.7
    reward_model = tiny_llama("scalar", seed=3, pad_token_id=pad)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(4, 48, (n,), generator=gen).tolist()

    prompts = [tokens(n) for n in (5, 3, 7)]
    responses = [tokens(n) for n in (4, 6, 1)]
    score, values, mask = _script().rewards_and_values(reward_model, critic, prompts, responses, pad)

    # the trainer's batch: a column of padding no row uses on each side, which model_inputs drops
    P, T = 8, 7
    query_ids = torch.full((3, P), pad)
    query_mask = torch.zeros(3, P, dtype=torch.long)
    response_ids = torch.full((3, T), pad)
    response_mask = torch.zeros(3, T, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        query_ids[i, P - len(p) :], query_mask[i, P - len(p) :] = torch.tensor(p), 1
        response_ids[i, : len(r)], response_mask[i, : len(r)] = torch.tensor(r), True
    ids, attn, start, w = model_inputs(query_ids, query_mask, response_ids, response_mask)
    with torch.no_grad():
        trainer = critic_values(critic, ids, attn, start)  # (3, w)
        raw = response_values(critic, ids, attn, start)  # (3, w) the head alone
    assert w == values.shape[1] == 6 and torch.equal(mask, response_mask[:, :w])
    assert torch.allclose(values[mask], trainer[mask].double(), atol=1e-5)
    assert not torch.allclose(raw[mask].double(), values[mask], atol=0.1)  # the normalisation matters here
    assert score.shape == (3,) and score.dtype == torch.float64
