"""What the vLLM engine is started from and sent (rlhfkit.rollout.engine_weights), on CPU without vLLM: the
architecture a LoRA actor names, the whole tensors a sharded actor streams (two processes), and a LoRA adapter
on a tied output head."""

from __future__ import annotations

import warnings

import pytest
import torch

from rlhfkit.errors import ConfigError
from rlhfkit.models.lora import add_lora
from rlhfkit.rollout.engine_weights import check_tied_head, engine_config, plain_weights
from rlhfkit.rollout.vllm_engine import EngineSettings, VLLMEngine
from tests.distributed.test_data_parallel import torchrun
from tests.helpers import tiny_llama


def lora(model, targets):
    with warnings.catch_warnings():  # peft warns of an adapter on a tied layer: what the last test is about
        warnings.simplefilter("ignore")
        peft = add_lora(model, rank=4, alpha=8, target_modules=targets)
    with torch.no_grad():  # B = 0 at the start: a non-zero one, so that merged differs from base
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(0))
    return peft


def test_engine_config_of_a_lora_actor_names_the_base_architecture():
    peft = lora(tiny_llama(), ["q_proj", "v_proj"])
    config = engine_config(peft)
    assert type(peft).__name__ == "PeftModelForCausalLM"
    assert config.architectures == ["LlamaForCausalLM"]  # what vLLM picks its implementation by
    assert config is not peft.get_base_model().config  # a copy: the actor's own config is left as it is


def test_a_sharded_actor_streams_whole_tensors_on_two_processes():
    proc = torchrun("-m", "tests.distributed.streamed_weights_worker", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_a_lora_adapter_on_a_tied_head_unties_it_and_the_vllm_engine_refuses_it():
    peft = lora(tiny_llama(tie_word_embeddings=True), ["lm_head", "q_proj"])
    # Confirmed: the streamed head is merged (W + s B A) while the embedding it is tied to is not, and the config
    # still says tied, so vLLM (which then loads no lm_head of its own) would sample from the embedding, W.
    weights = dict(plain_weights(peft))
    assert engine_config(peft).tie_word_embeddings
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    settings = EngineSettings(dtype="float32", kv_cache_gib=1, kv_cache_dtype="auto", max_model_len=64)
    with pytest.raises(ConfigError, match="ties its output head.*online.generation_backend=hf"):
        VLLMEngine(peft, settings, "model.name_or_path=tiny")
    # an adapter off the head, or a head that is not tied, keeps them as vLLM reads them
    check_tied_head(lora(tiny_llama(tie_word_embeddings=True), ["q_proj"]), "tiny")
    check_tied_head(lora(tiny_llama(), ["lm_head"]), "tiny")
