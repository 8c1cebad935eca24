"""The actor's weights as the vLLM engine takes them (:mod:`rlhfkit.rollout.vllm_engine`), one tensor at a time,
under Hugging Face names: a plain model's own tensors, a LoRA model's merged layer by layer as they are taken
(:func:`rlhfkit.models.lora.merged_weights`), a sharded (FSDP2) model's all-gathered one parameter at a time
(:func:`streamed_weights`); and what the engine is started from and how (:func:`engine_config`,
:func:`launched_processes`). docs/distributed.md ("vLLM with sharding") has the design and the measured peaks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from rlhfkit.errors import ConfigError
from rlhfkit.models.lora import is_peft_model, merged_weights


def plain_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The actor's weights under Hugging Face names, as the engine loads them, one tensor at a time: a LoRA
    model merged on the fly, W + s B A computed per layer as it is taken
    (:func:`rlhfkit.models.lora.merged_weights`: the trained model is untouched and no merged copy is made); a
    sharded model gathered per parameter (:func:`streamed_weights`)."""
    if is_sharded(model):
        yield from streamed_weights(model)
        return
    if is_peft_model(model):
        yield from merged_weights(model)
        return
    for name, tensor in model.state_dict().items():
        yield name, tensor.detach()


def engine_config(model: torch.nn.Module):
    """A copy of the actor's Hugging Face config that names its model class in ``architectures`` (what vLLM
    picks its implementation by): the class under a peft model's adapters or FSDP2's wrapper class."""
    import copy

    from torch.distributed.fsdp import FSDPModule

    base = model.get_base_model() if is_peft_model(model) else model
    cls = type(base)
    if issubclass(cls, FSDPModule):  # fully_shard made the class FSDP<Name>(FSDPModule, <Name>)
        cls = next(b for b in cls.__bases__ if not issubclass(b, FSDPModule))
    config = copy.deepcopy(base.config)
    config.architectures = [cls.__name__]
    return config


def check_tied_head(model: torch.nn.Module, where: str) -> None:
    """Refuse a LoRA adapter on the output head of a model whose head is tied to its input embedding: the
    adapter unties them (the trained head is W + s B A, the embedding stays W), while vLLM, reading the config's
    ``tie_word_embeddings``, loads no head of its own and samples from the embedding, W.

    Raises:
        ConfigError: naming ``where`` and the ways out.
    """
    if not is_peft_model(model) or not getattr(model.get_base_model().config, "tie_word_embeddings", False):
        return
    head = model.get_base_model().get_output_embeddings()
    if hasattr(head, "lora_A"):
        raise ConfigError(
            f"online.generation_backend=vllm: {where} ties its output head to its input embedding and "
            "model.lora_target_modules puts an adapter on that head, which unties them: vLLM would sample from "
            "the tied embedding without the adapter; leave the head out of model.lora_target_modules or use "
            "online.generation_backend=hf"
        )


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded with FSDP2 (``train.sharding``; :mod:`rlhfkit.engine.sharded`)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def streamed_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A sharded (FSDP2) model's weights under Hugging Face names, one whole tensor at a time: each parameter's
    shards are all-gathered (``DTensor.full_tensor``) just before the engine's loader takes it, and the gathered
    tensor is dropped when the loader has copied it. No process holds a whole copy of the model: the most it
    holds at once is what vLLM's layer-wise loader keeps until one of its layers is complete (the weights of
    one attention or MLP block, in the model's own order), docs/distributed.md "vLLM with sharding".

    A collective: every process of the run must iterate it to the end, in the same order (the state dict's
    order is the model's, the same on every process). A parameter that FSDP holds gathered at the moment (a
    plain tensor, not a DTensor) is already whole."""
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def launched_processes() -> int:
    """The number of processes a launcher started (``WORLD_SIZE`` beside ``RANK`` and ``LOCAL_RANK``, which
    vLLM's external-launcher mode reads), 1 for a process that no launcher started."""
    if not all(key in os.environ for key in ("RANK", "LOCAL_RANK")):
        return 1
    return int(os.environ.get("WORLD_SIZE", "1") or 1)
