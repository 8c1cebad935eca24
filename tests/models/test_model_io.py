"""Loading and saving: tokenizers' pad choice, scalar heads, safetensors, remote code, HF folders."""

import contextlib
import json
import math

import pytest
import torch

from helpers import TEXTS_FOR_SCORES, pad_batch, tiny_llama, tiny_tokenizer
from rlhfkit.errors import UserError
from rlhfkit.models import (
    PAD_TOKEN,
    disable_dropout,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    position_ids_from_mask,
    resolve_dtype,
    save_hf_folder,
    sequence_scores,
)
from rlhfkit.models.precision import FLOAT32_CPU_SDPA, autocast_region


def save_tokenizer(tmp_path, pad):
    path = tmp_path / f"tok-{pad}"
    tiny_tokenizer(pad=pad).save_pretrained(path)
    return str(path)


def test_load_tokenizer_pad_choices(tmp_path):
    path = save_tokenizer(tmp_path, None)
    added = load_tokenizer(path)
    assert added.pad_token == PAD_TOKEN and added.pad_token_id not in (added.eos_token_id, None)
    assert added.pad_token_id == len(added) - 1
    eos = load_tokenizer(path, missing_pad="eos")
    assert eos.pad_token_id == eos.eos_token_id
    kept = load_tokenizer(save_tokenizer(tmp_path, "<pad>"))
    assert kept.pad_token == "<pad>"
    with pytest.raises(UserError, match="missing_pad"):
        load_tokenizer(path, missing_pad="unk")


def test_added_pad_token_resizes_the_model(tmp_path):
    path = save_tokenizer(tmp_path, None)
    vocab = len(tiny_tokenizer(pad=None))
    tiny_llama("causal", vocab_size=vocab).save_pretrained(tmp_path / "lm")
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(str(tmp_path / "lm"), tokenizer=tokenizer)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) == vocab + 1
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.dtype == resolve_dtype("auto")


def test_missing_and_pickle_only_folders(tmp_path):
    with pytest.raises(UserError, match="folder not found: .*nowhere"):
        load_causal_lm(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path))
    model = tiny_llama("causal")
    model.config.save_pretrained(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(UserError, match="safetensors"):
        load_causal_lm(str(tmp_path / "bin"))


def test_remote_code_is_not_run_by_default(tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    (folder / "configuration_custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'rlhfkit-custom'\n"
    )
    config = {
        "model_type": "rlhfkit-custom",
        "architectures": ["CustomForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
            "AutoModelForSequenceClassification": "modeling_custom.CustomForCausalLM",
        },
    }
    (folder / "config.json").write_text(json.dumps(config))
    for loader in (load_causal_lm, load_scalar_model):
        with pytest.raises(UserError, match="trust_remote_code"):
            loader(str(folder))
    assert not marker.exists()


def test_scalar_model_from_causal_backbone(tmp_path):
    torch.manual_seed(0)
    lm = tiny_llama(
        "causal", hidden_size=512, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4
    )
    lm.save_pretrained(tmp_path / "lm")
    reward = load_scalar_model(str(tmp_path / "lm"), dtype="float32")
    assert reward.config.num_labels == 1 and reward.score.out_features == 1
    # backbone copied from the causal LM
    torch.testing.assert_close(reward.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    # head init std 1/sqrt(d + 1) = 0.0442 (transformers' default 0.02 would fail this)
    std = reward.score.weight.std().item()
    assert abs(std - 1 / math.sqrt(513)) < 0.15 / math.sqrt(513), std
    # a folder that already holds a trained head keeps it
    save_hf_folder(reward, tiny_tokenizer(), tmp_path / "rm")
    again = load_scalar_model(str(tmp_path / "rm"), dtype="float32")
    torch.testing.assert_close(again.score.weight, reward.score.weight)


def test_classifier_with_several_labels_is_refused(tmp_path):
    from transformers import LlamaForSequenceClassification

    from helpers import tiny_llama_config

    LlamaForSequenceClassification(tiny_llama_config(num_labels=3)).save_pretrained(tmp_path / "clf")
    with pytest.raises(UserError, match="num_labels=3"):
        load_scalar_model(str(tmp_path / "clf"))


def test_disable_dropout_makes_train_mode_deterministic():
    model = tiny_llama("causal", attention_dropout=0.5).train()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    first, second = model(ids).logits, model(ids).logits
    assert not torch.allclose(first, second)
    disable_dropout(model)
    torch.testing.assert_close(model(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert model.config.attention_dropout == 0.0


def test_resolve_dtype():
    expected = (
        torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    )
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(UserError, match="unknown dtype 'bf16'"):
        resolve_dtype("bf16")


@pytest.mark.parametrize("pad", ["eos", None, "<pad>"])
def test_saved_reward_model_scores_with_plain_transformers(tmp_path, pad):
    """pad == EOS (or no pad): the saved folder gets a distinct pad so transformers pools right."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = tiny_tokenizer(pad=pad)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = tiny_llama("scalar", pad_token_id=pad_id)
    rows_before = model.get_input_embeddings().weight.shape[0]
    save_hf_folder(model, tokenizer, tmp_path / "rm")
    assert model.get_input_embeddings().weight.shape[0] == rows_before  # caller's model untouched
    assert (tmp_path / "rm" / "model.safetensors").exists()

    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    saved_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "rm")
    new_pad = saved_tokenizer.pad_token_id
    assert new_pad != saved_tokenizer.eos_token_id and plain.config.pad_token_id == new_pad
    with torch.no_grad():
        for side in ("right", "left"):
            ours = sequence_scores(model, *pad_batch(TEXTS_FOR_SCORES, pad_id, side))
            ids, mask = pad_batch(TEXTS_FOR_SCORES, new_pad, side)
            # right padding needs nothing special; left padding needs mask-derived position ids
            position_ids = position_ids_from_mask(mask) if side == "left" else None
            theirs = plain(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, 0]
            torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


def test_saved_causal_lm_loads_with_plain_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_llama("causal")
    save_hf_folder(model, tiny_tokenizer(), tmp_path / "lm")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "lm").eval()
    ids = torch.tensor([TEXTS_FOR_SCORES[1]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=0, atol=0)
    reloaded = load_causal_lm(str(tmp_path / "lm"))
    assert reloaded.config.pad_token_id == tiny_tokenizer().pad_token_id


def test_bf16_attention_runs_in_float32_on_cpu(tmp_path, monkeypatch):
    """bf16 on a CPU: attention runs in float32 (torch's bf16 CPU attention backward is several times slower),
    with the padding mask sdpa gets, and without grad too (the old log-probs' no-grad forward must equal the
    update's, bit for bit); a float32 model keeps plain sdpa; the saved config does not name rlhfkit's
    attention, so plain transformers loads it."""
    from transformers import AutoModelForCausalLM

    save_hf_folder(tiny_llama("causal"), tiny_tokenizer(), tmp_path / "lm")
    assert load_causal_lm(str(tmp_path / "lm")).config._attn_implementation == "sdpa"
    model = load_causal_lm(str(tmp_path / "lm"), dtype="bfloat16")
    assert model.config._attn_implementation == FLOAT32_CPU_SDPA

    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        out = sdpa(query, key, value, attn_mask=attn_mask, **kwargs)
        seen.append((out.dtype, attn_mask is not None))  # what the kernel computed in, after autocast
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids, mask = pad_batch(TEXTS_FOR_SCORES, tiny_tokenizer().pad_token_id, "left")
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert seen and all(dtype == torch.float32 for dtype, _ in seen)
    assert all(has_mask for _, has_mask in seen)  # left padding: the mask reached the kernel
    assert logits.dtype == torch.bfloat16  # the rest of the forward is still under bf16 autocast
    logits.float().sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    seen.clear()
    with torch.no_grad():  # no backward: the same float32 kernel, so the two forwards agree exactly
        again = model(input_ids=ids, attention_mask=mask).logits
    assert seen and all(dtype == torch.float32 for dtype, _ in seen)
    assert torch.equal(again, logits.detach())

    model.save_pretrained(tmp_path / "saved")
    assert "rlhfkit" not in (tmp_path / "saved" / "config.json").read_text()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "saved").config._attn_implementation == "sdpa"


def test_autocast_region_casts_the_weights_once(tmp_path):
    """generate's decode steps run inside one autocast region: the float32 weights are cast to bf16 at the
    first forward only (outside a region every forward casts them again)."""
    from torch.profiler import profile

    save_hf_folder(tiny_llama("causal"), tiny_tokenizer(), tmp_path / "lm")
    model = load_causal_lm(str(tmp_path / "lm"), dtype="bfloat16").eval()
    assert isinstance(autocast_region(load_causal_lm(str(tmp_path / "lm"))), contextlib.nullcontext)
    ids = torch.tensor([TEXTS_FOR_SCORES[1]])

    def casts(region: bool) -> int:
        with torch.no_grad(), profile() as prof:
            with autocast_region(model) if region else contextlib.nullcontext():
                for _ in range(3):
                    model(input_ids=ids)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")

    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert casts(region=False) - casts(region=True) >= 2 * linears  # forwards 2 and 3 reuse the casts
