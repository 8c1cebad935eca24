"""A mixture of experts' router load-balancing loss enters SFT and the online update.

transformers computes the Switch Transformer load-balancing loss (Fedus et al. 2022, eq. 4) when asked for
the router logits, and adds ``router_aux_loss_coef`` times it to its own loss only when given labels, which
rlhfkit never passes: without ``model.router_aux_loss_coef`` the routers would train with nothing keeping
their load balanced.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhfkit.config import load_config
from rlhfkit.errors import ConfigError
from rlhfkit.models import load_tokenizer
from rlhfkit.trainers import online
from rlhfkit.trainers.common import router_aux_coef
from rlhfkit.trainers.sft import SFTCollator, sft_objective
from tests.models.tiny_architectures import write_tiny_model
from tests.trainers.online.online_fixtures import PROMPTS, REWARDS_PY


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return write_tiny_model("mixtral", tmp_path_factory.mktemp("mixtral") / "model", router_jitter_noise=0.0)


def _sft_batch(folder):
    tokenizer = load_tokenizer(str(folder))
    examples = []
    for prompt, completion in [("hello", "world ."), ("the cat", "sat on a mat ."), ("one two", "three")]:
        p = tokenizer(prompt)["input_ids"]
        c = tokenizer(" " + completion)["input_ids"] + [tokenizer.eos_token_id]
        examples.append({"prompt_ids": p, "completion_ids": c})
    collate = SFTCollator(tokenizer.pad_token_id)
    return collate, examples


def test_sft_loss_adds_the_weighted_load_balancing_loss_transformers_computes(mixtral):
    model = AutoModelForCausalLM.from_pretrained(mixtral).eval()
    collate, examples = _sft_batch(mixtral)
    batch = collate(examples)
    tokens = float(sum(len(e["completion_ids"]) for e in examples))
    plain, _ = sft_objective(collate, None, 4, "cpu", aux_coef=0.0).loss(model, batch, tokens)
    weighted, parts = sft_objective(collate, None, 4, "cpu", aux_coef=0.5).loss(model, batch, tokens)
    with torch.no_grad():
        expected_aux = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True
        ).aux_loss
    assert float(expected_aux) > 0
    torch.testing.assert_close(weighted - plain, 0.5 * expected_aux, atol=1e-6, rtol=1e-5)
    assert parts["loss/router_aux"] == pytest.approx(float(expected_aux), rel=1e-5)

    # the routers get a gradient from it: without it they would differ only by the language-model loss
    grads = []
    for loss in (plain, weighted):
        model.zero_grad()
        loss.backward(retain_graph=True)
        grads.append(
            torch.cat(
                [p.grad.flatten() for n, p in model.named_parameters() if "gate" in n and p.grad is not None]
            )
        )
    assert not torch.allclose(grads[0], grads[1])


def test_the_weight_defaults_to_the_model_configs_own_and_a_dense_model_refuses_one(mixtral, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(mixtral)
    assert model.config.router_aux_loss_coef > 0
    assert router_aux_coef(model, None) == pytest.approx(model.config.router_aux_loss_coef)
    assert router_aux_coef(model, 0.0) == 0.0 and router_aux_coef(model, 0.3) == 0.3
    dense = AutoModelForCausalLM.from_pretrained(write_tiny_model("llama", tmp_path / "llama"))
    assert router_aux_coef(dense, None) == 0.0
    with pytest.raises(ConfigError, match="model.router_aux_loss_coef=0.3.*not a mixture of experts"):
        router_aux_coef(dense, 0.3)


def test_the_online_update_trains_the_routers_on_it(mixtral, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:4]))
    (tmp_path / "rewards.py").write_text(REWARDS_PY)

    def run(name, coef):
        out = tmp_path / name
        cfg = load_config(
            None,
            [
                f"output_dir={out}",
                f"model.name_or_path={mixtral}",
                f"data.train_file={prompts}",
                f"online.reward_functions=[{tmp_path / 'rewards.py'}:words]",
                f"model.router_aux_loss_coef={coef}",
                "train.max_steps=1",
                "train.batch_size=2",
                "train.learning_rate=1e-2",
                "train.lr_schedule=constant",
                "train.save_steps=100",
                "online.response_length=5",
                "online.ppo_epochs=1",
                "online.num_minibatches=1",
                "logging.progress_bar=false",
            ],
            "grpo",
        )
        online.train(cfg)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        weights = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
        return rows[-1], {k: v for k, v in weights.items() if ".gate." in k}

    without, gates_without = run("without", 0.0)
    with_aux, gates_with = run("with", 5.0)
    assert "loss/router_aux" not in without and with_aux["loss/router_aux"] > 0
    # the same rollout (same seed, lr 0 nowhere), so the routers differ only through the added loss
    assert gates_with.keys() == gates_without.keys() and gates_with
    assert any(not torch.equal(gates_with[k], gates_without[k]) for k in gates_with)
