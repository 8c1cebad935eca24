"""LoRA adapters (through peft) and gradient checkpointing for the trained roles.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") freezes a linear layer's weight
W and trains a low-rank update: y = W x + (alpha / r) B A x, with A (r, d_in) random and B (d_out, r) zero at
the start, so an adapted model starts exactly where its base is. Here:

- :func:`prepare_trained` turns a loaded model into the trained role the run config asks for: gradient
  checkpointing (``model.gradient_checkpointing``), then adapters on ``model.lora_target_modules`` when
  ``model.lora_rank`` > 0 (a scalar model's ``score`` head is trained too: peft's sequence-classification
  task keeps a trainable copy of it and the original beside it); under bf16 autocast the frozen base's
  linear weights are then held in bf16 (:func:`rlhfkit.models.precision.hold_frozen_linears`: the same
  forwards, half their memory), their float32 originals on disk for the merged save;
- :class:`AdapterDisabled` is a frozen role made of a trained one's weights with its adapter switched off:
  the PPO reference (the policy's base) and, when the critic is an adapter on the reward model, the reward
  model itself. It holds no copy of any weight;
- :func:`save_adapter` writes the adapter alone in peft's format (``adapter_config.json`` +
  ``adapter_model.safetensors``); :func:`merged_copy` gives the plain Hugging Face model with the update
  merged into the float32 W (what ``final/`` holds);
- :func:`fuse_lora_forward` gives each plain LoRA linear layer a forward that adds the adapter's product into
  the base layer's output in one ``addmm_`` (``W x`` then ``+= alpha / r * (A x) B^T``) instead of peft's
  ``result + lora_B(lora_A(x)) * scaling``, which allocates three output-sized temporaries per layer; the same
  function up to the rounding of the sum, with the same saved tensors (``x`` and ``A x``);
- :func:`merged_for_generation` merges the adapter into the base's linear weights for the length of a
  ``generate`` call, the originals put back after: one matrix product per layer and decoding step instead of
  three, and none of the adapter's casts;
- :func:`adapter_base` recognises an adapter folder, so that one can be given wherever a model folder is:
  it is loaded as its base with the adapter merged in (the model it stands for).

Gradient checkpointing recomputes each block's forward in the backward pass (transformers'
``gradient_checkpointing_enable``, non-reentrant ``torch.utils.checkpoint``): the gradients are the same,
the stored activations one per block instead of every intermediate.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import types
import warnings
from pathlib import Path

import torch

from rlhfkit.errors import UserError
from rlhfkit.models.precision import hold_frozen_linears, hold_tied_head_cast, restore_frozen_linears

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
RLHFKIT_KEYS = "rlhfkit_config.json"


def is_peft_model(model: torch.nn.Module) -> bool:
    """True for a peft model (it has adapters and a ``peft_config``)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def prepare_trained(model: torch.nn.Module, model_cfg) -> torch.nn.Module:
    """Gradient checkpointing and LoRA as ``model_cfg`` (a :class:`rlhfkit.config.ModelConfig`) says.

    Args:
        model: a freshly loaded causal LM or scalar model (dropout already handled).
        model_cfg: reads ``gradient_checkpointing``, ``lora_rank``, ``lora_alpha``, ``lora_dropout`` and
            ``lora_target_modules``.
    Returns:
        ``model`` itself (full fine-tuning) or a peft model around it (LoRA): only the adapters and a scalar
        model's head require gradients then.
    """
    if model_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if model_cfg.lora_rank > 0:
        targets = model_cfg.lora_target_modules.strip()
        modules = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
        model = add_lora(
            model,
            rank=model_cfg.lora_rank,
            alpha=model_cfg.lora_alpha,
            dropout=model_cfg.lora_dropout,
            target_modules=modules,
        )
        fuse_lora_forward(model)  # the adapter's product added in place: fewer temporaries
        hold_frozen_linears(model)  # bf16 compute: the frozen base in bf16, its float32 originals on disk
        hold_tied_head_cast(model.get_base_model())  # and a bf16 copy of a tied, frozen output projection
    return model


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in the backward pass (non-reentrant checkpointing: no input needs a gradient)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(
            f"model.gradient_checkpointing: {type(model).__name__} does not support gradient "
            "checkpointing; set it to false"
        )
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def add_lora(
    model: torch.nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    adapter_name: str = "default",
) -> torch.nn.Module:
    """Wrap ``model`` in a peft model with one LoRA adapter (its base weights frozen, in place).

    A scalar (sequence-classification) model's ``score`` head is trained as well (peft keeps the original
    head beside the trained copy: the adapter switched off gives the original model back).

    Raises:
        UserError: no module of the model matches ``target_modules``.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    scalar = type(model).__name__.endswith("ForSequenceClassification")
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
        task_type=TaskType.SEQ_CLS if scalar else TaskType.CAUSAL_LM,
    )
    source = getattr(model, "name_or_path", "") or ""
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing for a user to do
        warnings.filterwarnings("ignore", category=FutureWarning)
        try:
            peft_model = get_peft_model(model, config, adapter_name=adapter_name)
        except ValueError as error:
            raise UserError(f"model.lora_target_modules={target_modules!r}: {error}") from None
    if os.path.isdir(source):  # so that the adapter folder finds its base from any working folder
        peft_model.peft_config[adapter_name].base_model_name_or_path = os.path.abspath(source)
    return peft_model


def fuse_lora_forward(model: torch.nn.Module) -> int:
    """Give every peft LoRA linear layer of ``model`` whose base is a plain ``nn.Linear`` the forward
    :func:`_fused_lora_forward`. Returns how many layers took it.

    Why: in the update's forward of a LoRA model every adapted layer made three temporaries the size of its
    output (``lora_B(...)``, ``* scaling``, ``result + ...``). Freed between allocations that live on (the
    activations the backward keeps), they fragment the heap, and the C allocator keeps the holes: measured on
    SmolLM2-135M with LoRA r16 (fp32, 8 x 88 tokens, four forward + backward passes), 2,410 -> 2,200 MiB peak
    resident and no slower (docs/performance.md). Layers that are anything else keep peft's forward."""
    from peft.tuners.lora import Linear as LoraLinear

    fused = 0
    for module in model.modules():
        if type(module) is LoraLinear and type(module.base_layer) is torch.nn.Linear:
            module.forward = types.MethodType(_fused_lora_forward, module)
            fused += 1
    return fused


def _fused_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's ``lora.Linear.forward`` for one active plain adapter (no DoRA or other variant, no bias on B),
    not merged, not disabled, without extra arguments: ``y = W x + b``, then ``y += scaling * (A x') B^T`` in
    place (x' = the adapter's dropout of x). In place is safe: ``y`` is the base layer's fresh output, which
    its backward does not keep (autograd would refuse otherwise). Every other case is peft's own forward.

    Under autocast the input is not cast to the adapter's float32 first (peft does, and autocast casts it back
    to bf16 for the product: the same values). Shapes: x (..., d_in) -> (..., d_out)."""
    active = self.active_adapters
    adapter = active[0] if len(active) == 1 else None
    base = self.base_layer
    if (
        args
        or kwargs
        or self.disable_adapters
        or self.merged
        or adapter not in self.lora_A
        or adapter in self.lora_variant
        or self.lora_B[adapter].bias is not None
        or base._forward_hooks
        or base._forward_pre_hooks
    ):
        return type(self).forward(self, x, *args, **kwargs)
    lora_a, lora_b = self.lora_A[adapter], self.lora_B[adapter]
    out = base(x)
    if not out.is_contiguous():
        out = out.contiguous()
    if not torch.is_autocast_enabled(x.device.type):
        x = self._cast_input_dtype(x, lora_a.weight.dtype)
    low = lora_a(self.lora_dropout[adapter](x))  # (..., r)
    out.view(-1, out.shape[-1]).addmm_(
        low.reshape(-1, low.shape[-1]).to(out.dtype),
        lora_b.weight.t().to(out.dtype),
        alpha=self.scaling[adapter],
    )
    return out


class AdapterDisabled(torch.nn.Module):
    """A frozen role that is a peft model with its adapters switched off: the base model, no copy.

    Its forward runs the wrapped model under ``disable_adapter()``; attributes it does not have (``config``,
    ``score``, ...) are the wrapped model's. ``train()`` / ``eval()`` do not reach the wrapped model (it is
    another role's, trained elsewhere), and gradients never flow (the forward runs under ``no_grad``).
    """

    def __init__(self, adapted: torch.nn.Module):
        super().__init__()
        if not is_peft_model(adapted):
            raise TypeError(f"AdapterDisabled needs a peft model, got {type(adapted).__name__}")
        self.adapted = adapted
        self.training = False

    def forward(self, *args, **kwargs):
        with torch.no_grad(), self.adapted.disable_adapter():
            return self.adapted(*args, **kwargs)

    def train(self, mode: bool = True) -> AdapterDisabled:
        self.training = mode
        return self

    def get_base_model(self) -> torch.nn.Module:
        return self.adapted.get_base_model()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["adapted"], name)


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain Hugging Face model with every adapter merged into its base weights (W + alpha / r * B A).

    The peft model itself is left as it is (it may go on training), so this briefly needs the memory of a
    second copy of the model.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        return restore_frozen_linears(copy.deepcopy(model)).merge_and_unload()  # into float32 weights


def merged_weights(model: torch.nn.Module):
    """The weights of a LoRA model with every adapter merged (W + alpha / r * B A), under the plain model's
    names (``merged_copy(model).state_dict()``'s, tensor for tensor), one tensor at a time: each merged weight
    is computed when it is taken and a held model's float32 originals are read back one by one, so no second
    copy of the model is made (:func:`merged_copy` makes one). What the vLLM engine's weight sync loads.

    A model with a layer that is not a plain LoRA linear layer with one active adapter (DoRA, several adapters,
    ``modules_to_save``) gives :func:`merged_copy`'s state dict instead."""
    from rlhfkit.models.precision import HELD

    layers = _mergeable_lora_layers(model)
    base = model.get_base_model() if layers is not None else None
    state = base.state_dict() if base is not None else {}
    if layers is None or any("modules_to_save." in k or "original_module." in k for k in state):
        for name, tensor in merged_copy(model).state_dict().items():
            yield name, tensor.detach()
        return
    names = {id(m): n for n, m in base.named_modules()}
    deltas = {f"{names[id(m)]}.base_layer.weight": (m, adapter) for m, adapter in layers}
    file, prefix = getattr(model, HELD, None), "base_model.model."
    with contextlib.ExitStack() as stack:
        held = None
        if file:
            from safetensors import safe_open

            held = stack.enter_context(safe_open(file, framework="pt"))
        held_names = set(held.keys()) if held is not None else set()
        for key, tensor in state.items():
            if ".lora_" in key:
                continue
            tensor = tensor.detach()
            if prefix + key in held_names:  # the float32 original of a weight held in bf16
                tensor = held.get_tensor(prefix + key).to(tensor.device)
            if key in deltas:  # W + s B A, as peft's merge adds it into the weight
                module, adapter = deltas[key]
                with torch.no_grad():
                    delta = module.get_delta_weight(adapter)  # (d_out, d_in)
                tensor = tensor + delta.to(tensor.dtype)
            yield key.replace(".base_layer.", "."), tensor


def _mergeable_lora_layers(model: torch.nn.Module) -> list | None:
    """The LoRA linear layers of a peft model, each with one plain adapter active (no DoRA or other variant)
    and a plain (not sharded) base weight, or None when any LoRA layer is not such (or there is none). Only a
    peft model itself: an :class:`AdapterDisabled` role samples from the base, not the adapted weights."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return None
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    layers = []
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        active = [a for a in module.active_adapters if a in module.lora_A]
        if (
            type(module) is not LoraLinear
            or len(active) != 1
            or module.lora_variant
            or module.merged
            or module.disable_adapters
            or type(module.base_layer.weight.data) is not torch.Tensor
        ):
            return None
        layers.append((module, active[0]))
    return layers or None


@contextlib.contextmanager
def merged_for_generation(model: torch.nn.Module):
    """Within this block a LoRA model's linear layers compute with ``W + alpha / r * B A`` merged into one
    weight (in the dtype the base weight has there: bf16 inside :func:`rlhfkit.models.precision.frozen_linears_cast`
    or when held, float32 otherwise) and the adapters switched off; the base weights are put back after,
    untouched (the merged weights are new tensors). For sampling only: no gradient flows, and the merged
    product differs from the adapter's ``W x + B (A x)`` by the rounding of the sum, so the trainer's log-probs
    (recomputed through the adapters) stay exact and the sampled tokens are drawn from the same distribution up
    to that rounding (the ``test_merged_generation`` tests bound it).

    A null context for any other model, and for a peft model with a layer that is not a plain LoRA linear
    layer with one active adapter (DoRA, several adapters, a sharded base weight)."""
    layers = _mergeable_lora_layers(model)
    if layers is None:
        yield model
        return
    held = []
    try:
        with torch.no_grad():
            for module, adapter in layers:
                weight = module.base_layer.weight
                held.append((weight, weight.data))
                delta = module.get_delta_weight(adapter)  # (d_out, d_in), float32 like the adapter
                weight.data = (weight.data.to(delta.dtype) + delta).to(weight.dtype)
        with model.disable_adapter():
            yield model
    finally:
        for weight, data in held:
            weight.data = data


def save_adapter(model: torch.nn.Module, tokenizer, path: str | os.PathLike) -> None:
    """Write the adapter alone in peft's format (safetensors) and the tokenizer into the folder ``path``."""
    with warnings.catch_warnings():  # peft warns when it cannot reach a hub base to compare vocabularies
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))


def save_rlhfkit_keys(config, path: str | os.PathLike) -> None:
    """Write the ``rlhfkit_*`` fields of a model config (a reward model's normalisation) to
    ``path/rlhfkit_config.json``, which an adapter folder needs: peft saves no model config."""
    keys = {k: v for k, v in config.to_dict().items() if k.startswith("rlhfkit_")}
    if keys:
        (Path(path) / RLHFKIT_KEYS).write_text(json.dumps(keys, indent=1))


def adapter_base(name_or_path: str | os.PathLike) -> str | None:
    """The base model of a local peft adapter folder (``adapter_config.json``), or None for anything else.

    Raises:
        UserError: an adapter folder without a base, or whose weights are not safetensors.
    """
    folder = Path(os.path.expanduser(os.fspath(name_or_path)))
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file():
        return None
    try:
        base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except ValueError as error:
        raise UserError(f"{config_file}: not valid JSON ({error})") from None
    if not base:
        raise UserError(
            f"{config_file}: no base_model_name_or_path; rlhfkit cannot tell which model it adapts"
        )
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise UserError(
            f"{folder}: an adapter folder without {ADAPTER_WEIGHTS} (rlhfkit loads safetensors weights only)"
        )
    return base


def merge_adapter_folder(model: torch.nn.Module, path: str | os.PathLike) -> torch.nn.Module:
    """Load the adapter in ``path`` onto ``model`` and merge it: the plain model the adapter stands for.

    Raises:
        UserError: the adapter's weights do not fit the model (a different architecture or size).
    """
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        try:
            adapted = PeftModel.from_pretrained(model, os.fspath(path), is_trainable=False)
        except (RuntimeError, ValueError, KeyError) as error:
            raise UserError(
                f"cannot load the adapter in '{path}' onto its base: {str(error).splitlines()[0]}"
            ) from None
        model = adapted.merge_and_unload()
    keys = Path(path) / RLHFKIT_KEYS
    if keys.is_file():
        for key, value in json.loads(keys.read_text()).items():
            setattr(model.config, key, value)
    return model
