"""``final/`` of an online run keeps the generation config the user's model came with (EOS, pad, BOS and the
rest), although the trainer samples with a blank one: plain ``generate()`` on ``final/`` stops where the base
model stops. (peft's ``generate`` copied the blanked config onto the base model, so a LoRA run's ``final/``
held only ``transformers_version`` and ran past the end of turn.)"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from rlhfkit.trainers import online
from tests.trainers.online.online_fixtures import online_config, write_online_problem

NEW_TOKENS = 8


@pytest.mark.parametrize("lora", [0, 4])
def test_plain_generate_on_final_stops_where_the_base_model_stops(tmp_path, lora):
    paths = write_online_problem(tmp_path, reward_model=False)
    base = AutoModelForCausalLM.from_pretrained(paths["policy"]).eval()
    prompt = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        free = base.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None)
    # the user's model ends a turn on the third token it writes here (a second EOS, as chat models carry
    # <|im_end|> beside </s>), and comes with a setting of its own
    stop = int(free[0, prompt.shape[1] + 2])
    assert stop not in free[0, prompt.shape[1] : prompt.shape[1] + 2].tolist()
    config = GenerationConfig.from_pretrained(paths["policy"])
    config.eos_token_id, config.repetition_penalty = [config.eos_token_id, stop], 1.0
    config.save_pretrained(paths["policy"])
    base = AutoModelForCausalLM.from_pretrained(paths["policy"]).eval()

    cfg = online_config(
        paths,
        tmp_path / "run",
        "train.max_steps=1",
        "train.learning_rate=0",
        f"model.lora_rank={lora}",
        kind="grpo",
    )
    online.train(cfg)
    final = tmp_path / "run" / "final"
    saved = json.loads((final / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [2, stop] and saved["bos_token_id"] == 1 and saved["pad_token_id"] == 3
    assert saved["repetition_penalty"] == 1.0
    trained = AutoModelForCausalLM.from_pretrained(final).eval()
    with torch.no_grad():
        want = base.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS)
        got = trained.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert want.shape[1] == prompt.shape[1] + 3  # the base model stops at its second EOS
    assert torch.equal(got, want)
