"""Keys a user with their own checkpoint sets: a chat template, the dtype of final/, and the bf16-on-CPU
warning."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfkit.cli import main
from rlhfkit.config import load_config
from rlhfkit.models import load_causal_lm, precision
from rlhfkit.trainers.common import run_tokenizer
from tests.helpers import tiny_llama, tiny_tokenizer

TEMPLATE = "{% for m in messages %}{{ m['role'] }} says {{ m['content'] }} ; {% endfor %}"


@pytest.fixture
def model_dir(tmp_path):
    tokenizer = tiny_tokenizer(chat_template=True)
    tiny_llama(seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id).save_pretrained(
        tmp_path / "model"
    )
    tokenizer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _sft_run(tmp_path, model_dir, name, config_text="", *extra):
    data = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world ."}]},
        {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat ."}]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / f"{name}.yaml"
    config.write_text("seed: 0\nlogging:\n  progress_bar: false\n" + config_text)
    out = tmp_path / name
    args = ["train", "sft", "--config", str(config), f"output_dir={out}", f"model.name_or_path={model_dir}"]
    args += [f"data.train_file={data}", "train.max_steps=1", "train.batch_size=2", "train.save_steps=100"]
    return main([*args, *extra]), out


def test_chat_template_from_a_string_or_a_file_replaces_the_tokenizers_own(tmp_path, model_dir):
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    for value in (TEMPLATE, str(tmp_path / "template.jinja")):
        overrides = [
            f"output_dir={tmp_path / 'o'}",
            f"model.name_or_path={model_dir}",
            "data.train_file=x.jsonl",
        ]
        cfg = load_config(None, overrides, "sft")
        cfg.data.chat_template = value
        tokenizer = run_tokenizer(cfg)
        chat = [{"role": "user", "content": "hello"}]
        assert tokenizer.apply_chat_template(chat, tokenize=False) == "user says hello ; "


def test_chat_template_reaches_the_trained_folder_and_bad_ones_are_named(tmp_path, model_dir, capsys):
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    code, out = _sft_run(tmp_path, model_dir, "run", "", f"data.chat_template={tmp_path / 'template.jinja'}")
    assert code == 0
    assert AutoTokenizer.from_pretrained(out / "final").chat_template == TEMPLATE  # generate uses the same

    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    code, _ = _sft_run(tmp_path, model_dir, "bad", "", f"data.chat_template={tmp_path / 'bad.jinja'}")
    err = capsys.readouterr().err
    assert code == 2 and "data.chat_template" in err and "bad.jinja" in err and "Traceback" not in err
    code, _ = _sft_run(tmp_path, model_dir, "missing", "", "data.chat_template=no_such_template.jinja")
    err = capsys.readouterr().err
    assert code == 2 and "neither a Jinja template" in err and "Traceback" not in err


def test_save_dtype_bfloat16_writes_half_size_files_and_keeps_training_in_float32(tmp_path, model_dir):
    code, out = _sft_run(tmp_path, model_dir, "bf16", "", "model.save_dtype=bfloat16", "train.save_steps=1")
    assert code == 0
    final = load_file(str(out / "final" / "model.safetensors"))
    assert {t.dtype for t in final.values() if t.is_floating_point()} == {torch.bfloat16}
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    # the resume checkpoint holds the float32 weights that training continues from
    checkpoint = load_file(str(next((out / "checkpoints").glob("step-*")) / "model.model.safetensors"))
    assert {t.dtype for t in checkpoint.values() if t.is_floating_point()} == {torch.float32}
    # final/ is those weights rounded to bf16, and plain transformers loads it
    plain = AutoModelForCausalLM.from_pretrained(out / "final")
    for name, tensor in final.items():
        torch.testing.assert_close(tensor, checkpoint[name].to(torch.bfloat16), rtol=0, atol=0)
    assert plain.dtype in (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("has_bf16", [False, True])
def test_bf16_on_a_cpu_warns_only_without_bf16_instructions(model_dir, monkeypatch, has_bf16):
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: has_bf16)
    monkeypatch.setattr(precision, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_causal_lm(str(model_dir), dtype="bfloat16")
        load_causal_lm(str(model_dir), dtype="float32")
    slow = [w for w in caught if "bf16 instructions" in str(w.message)]
    assert len(slow) == (0 if has_bf16 else 1)
