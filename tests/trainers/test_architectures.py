"""Bring your own model: every stage on tiny random-initialised models of the common architectures.

For each architecture (GPT-2, Llama, Qwen2, Qwen3, Mistral, Gemma, Gemma 2, Gemma 3, Phi-3, GPT-NeoX, OPT, the
mixtures of experts Qwen2-MoE, Mixtral, Qwen3-MoE, PhiMoE, and the scaled heads of Granite, Cohere and FalconH1,
which have no sequence-classification class, so SFT and GRPO only): SFT, reward, PPO and GRPO run a step each;
``final/`` reloads with plain transformers; the reward model's score of a text is the same alone and in a
left- or right-padded batch; PPO at learning rate 0 has a ratio of exactly 1 on its first minibatch (PhiMoE
routes experts at random in train mode: the update's forwards must not) and a KL of exactly 0.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhfkit.config import load_config
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.models import load_tokenizer, sequence_scores
from rlhfkit.trainers import common, online, reward, sft
from tests.helpers import pad_batch
from tests.models.tiny_architectures import ARCHITECTURES, write_tiny_model
from tests.trainers.online.online_fixtures import PROMPTS, REWARDS_PY

SFT = [
    ("hello", "world ."),
    ("the cat", "sat on a mat ."),
    ("one two", "three four ."),
    ("dog ran", "fast !"),
]
PAIRS = [
    ("hello", "world .", "bad bad"),
    ("the cat", "sat on a mat .", "no"),
    ("one two", "three four .", "six"),
]
CAUSAL_ONLY = {"granite", "cohere", "falcon_h1"}
FAST = [
    "train.lr_schedule=constant",
    "train.save_steps=100",
    "data.max_prompt_length=16",
    "logging.progress_bar=false",
]


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    """The report's plots (matplotlib, ~1.5 s a run here) are not what this matrix checks."""
    monkeypatch.setattr(common, "write_report", lambda run_dir: None)  # every trainer's finish_run


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(kind, module, tmp_path, name, *extra):
    cfg = load_config(None, [f"output_dir={tmp_path / name}", *FAST, *extra], kind)
    module.train(cfg)
    return tmp_path / name


def _loads_plainly(folder, auto_class):
    model, info = auto_class.from_pretrained(
        folder,
        output_loading_info=True,
        **({"num_labels": 1} if auto_class is AutoModelForSequenceClassification else {}),
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_sft_reward_ppo_grpo_on_a_tiny_model_of_each_architecture(tmp_path, arch):
    base = write_tiny_model(arch, tmp_path / "base")
    data = {
        "sft": _jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "completion": c} for p, c in SFT]),
        "pairs": _jsonl(
            tmp_path / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
        ),
        "prompts": _jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS[:4]]),
    }
    (tmp_path / "rewards.py").write_text(REWARDS_PY)

    # SFT: one step; final/ is a folder plain transformers loads, and it was trained
    sft_dir = (
        _run(
            "sft",
            sft,
            tmp_path,
            "sft",
            f"model.name_or_path={base}",
            f"data.train_file={data['sft']}",
            "train.max_steps=1",
            "train.batch_size=4",
            "train.learning_rate=1e-2",
        )
        / "final"
    )
    before = AutoModelForCausalLM.from_pretrained(base)
    trained = _loads_plainly(sft_dir, AutoModelForCausalLM)
    assert any(not torch.equal(p, before.state_dict()[k]) for k, p in trained.state_dict().items())

    online_common = [
        f"model.name_or_path={sft_dir}",
        f"data.train_file={data['prompts']}",
        "train.max_steps=1",
        "train.batch_size=2",
        "online.response_length=5",
        "online.temperature=1.0",
        "online.ppo_epochs=2",
        "online.num_minibatches=1",
    ]
    # Reward model and PPO where transformers has a sequence-classification class for the architecture
    # (Granite, Cohere and FalconH1 have none: SFT and GRPO only)
    if arch not in CAUSAL_ONLY:
        # Reward model: one step from the SFT model; the score of a text does not depend on its batch's padding
        rm_dir = (
            _run(
                "reward",
                reward,
                tmp_path,
                "rm",
                f"model.name_or_path={sft_dir}",
                f"data.train_file={data['pairs']}",
                "train.max_steps=1",
                "train.batch_size=3",
                "data.max_length=32",
            )
            / "final"
        )
        rm = _loads_plainly(rm_dir, AutoModelForSequenceClassification)
        tokenizer = load_tokenizer(str(rm_dir))
        texts = [tokenizer(p + " " + c)["input_ids"] + [tokenizer.eos_token_id] for p, c in SFT]
        with torch.no_grad():
            alone = torch.stack(
                [
                    sequence_scores(rm, torch.tensor([t]), torch.ones(1, len(t), dtype=torch.long))[0]
                    for t in texts
                ]
            )
            for side in ("left", "right"):
                ids, mask = pad_batch(texts, tokenizer.pad_token_id, side)
                torch.testing.assert_close(sequence_scores(rm, ids, mask), alone, atol=1e-5, rtol=0)
            ids, mask = pad_batch(texts, tokenizer.pad_token_id, "right")  # plain transformers' own pooling
            torch.testing.assert_close(
                rm(input_ids=ids, attention_mask=mask).logits[:, 0], alone, atol=1e-5, rtol=0
            )

        # PPO at learning rate 0 (reward model, critic from it): the ratio is exactly 1, the KL exactly 0
        ppo_dir = _run(
            "ppo",
            online,
            tmp_path,
            "ppo",
            *online_common,
            f"online.reward_model={rm_dir}",
            "train.learning_rate=0",
        )
        metrics = read_metrics(ppo_dir / "metrics.jsonl")[-1]
        assert metrics["ratio/first_minibatch_max_logprob_diff"] == 0.0
        assert metrics["kl/mean"] == 0.0
        _loads_plainly(ppo_dir / "final", AutoModelForCausalLM)
        _loads_plainly(ppo_dir / "final_critic", AutoModelForSequenceClassification)

    # GRPO with a reward function: one rollout that changes the policy
    grpo_dir = _run(
        "grpo",
        online,
        tmp_path,
        "grpo",
        *online_common,
        "train.learning_rate=1e-2",
        f"online.reward_functions=[{tmp_path / 'rewards.py'}:words]",
        # scored as is: 5 tokens of a tiny model end with EOS ~1% of the time, and under the default penalty
        # every response of a group would score the same (no advantage, no change) but by the sampler's luck
        "online.missing_eos=none",
    )
    after = _loads_plainly(grpo_dir / "final", AutoModelForCausalLM)
    assert any(not torch.equal(p, trained.state_dict()[k]) for k, p in after.state_dict().items())
