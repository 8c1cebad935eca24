"""Saving a model and its tokenizer as a Hugging Face folder that plain transformers loads.

The folder holds ``config.json``, safetensors weights and the tokenizer files, and nothing
rlhfkit-specific. A LoRA model is saved merged (plain transformers loads it), with its adapter alone in
``adapter/`` beside the weights (peft's format; rlhfkit accepts that folder wherever a model is expected). A reward model whose tokenizer pads with EOS (or has no pad) is saved with a
distinct ``<|pad|>`` token and one more embedding row: transformers' own sequence-classification
pooling reads the score at the last token that is *not* the pad id, so with pad == EOS it would
skip the EOS the score belongs to (huggingface/transformers#30004, huggingface/trl#2778).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from rlhfkit.models.loading import PAD_TOKEN
from rlhfkit.models.lora import ADAPTER_DIR, is_peft_model, merged_copy, save_adapter, save_rlhfkit_keys
from rlhfkit.models.readout import unwrap_model


def is_scalar_model(model: torch.nn.Module) -> bool:
    """True for a sequence-classification model (reward / value), judged by its class name."""
    return type(unwrap_model(model)).__name__.endswith("ForSequenceClassification")


def release_freed_memory() -> None:
    """Hand the memory the C allocator keeps after frees back to the system (glibc's ``malloc_trim``), so that
    a save, which needs a whole copy of the model at once, starts from what the process holds rather than from
    the peak of its last training forward (the activations it freed stay reserved otherwise). Nothing where the
    C library is not glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return
    if trim is not None:
        trim(0)


def save_hf_folder(
    model: torch.nn.Module, tokenizer, path: str | os.PathLike, dtype: str = "float32"
) -> None:
    """Write ``model`` (safetensors) and ``tokenizer`` into the folder ``path``.

    The caller's model and tokenizer are never changed in a way that matters to training: when a
    reward model needs a distinct pad token, a copy of both is resized and saved (so an optimizer
    that holds the model's parameters is not left with stale ones); this briefly needs the memory
    of a second copy of the model.

    Args:
        model: a causal LM or a scalar model, possibly wrapped (DDP / accelerate).
        tokenizer: its tokenizer.
        path: the output folder (created if missing).
        dtype: the dtype of the written weights (``model.save_dtype``): ``"float32"`` (what a trained role
            holds) or ``"bfloat16"`` (half the size; the model itself is not changed).
    Raises:
        NonFiniteError: a weight or a float in the model's config is NaN or infinite (nothing is written).
    """
    model = unwrap_model(model)
    from rlhfkit.engine.finite import check_finite_weights

    check_finite_weights(model, str(path))  # final/ is never written from a diverged model
    os.makedirs(path, exist_ok=True)
    release_freed_memory()
    owned = False  # whether `model` is already a copy of the caller's
    if is_peft_model(model):  # LoRA: the adapter alone in adapter/, the merged model here
        save_adapter(model, tokenizer, os.path.join(path, ADAPTER_DIR))
        save_rlhfkit_keys(model.config, os.path.join(path, ADAPTER_DIR))
        model, owned = merged_copy(model), True
    pad_id = tokenizer.pad_token_id
    if is_scalar_model(model) and (pad_id is None or pad_id == tokenizer.eos_token_id):
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
        model = model if owned else copy.deepcopy(model)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    if model.config.pad_token_id != tokenizer.pad_token_id:
        model.config.pad_token_id = tokenizer.pad_token_id
    state_dict = None
    if dtype != "float32":
        target = {"bfloat16": torch.bfloat16}[dtype]
        state_dict = {k: v.to(target) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.save_pretrained(path, state_dict=state_dict)
    if state_dict is not None:  # config.json names the dtype of the files (transformers wrote the model's)
        config_file = Path(path) / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
        config["dtype"] = dtype
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tokenizer.save_pretrained(path)
