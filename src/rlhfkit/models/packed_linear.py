"""Sampling with linear layers whose bf16 weights are laid out once for oneDNN (a CPU with bf16 instructions).

A bf16 product ``x @ W.T`` on a CPU goes to oneDNN, which first reorders ``W`` into its blocked layout, at every
call: at each decoding step every weight of the model is read and rewritten once before it is multiplied.
Within :func:`packed_linears` (a block of no-grad forwards whose weights do not change: a sampling call, after
its LoRA merge) each bf16 linear layer multiplies with its weight reordered once
(``torch.ops.mkldnn._reorder_linear_weight``, then ``torch.ops.mkldnn._linear_pointwise``, the kernels
torch.compile's CPU backend uses for frozen bf16 weights). The same oneDNN product, so the same values bit for
bit (``tests/models/test_packed_linear.py``); 15-30% less time a product at 32 rows of SmolLM2's shapes
(docs/performance.md). The vLLM CPU backend keeps its weights packed the same way.

Taken: a plain ``nn.Linear`` (a merged LoRA layer's base layer too) with a bf16 weight, or the tied output
projection :func:`rlhfkit.models.precision.hold_tied_head_cast` multiplies in bf16, on a CPU whose oneDNN has
bf16; a forward that records a graph or runs outside bf16 autocast with float inputs takes the layer's own
forward.
"""

from __future__ import annotations

import contextlib
import types

import torch

from rlhfkit.models.precision import HALF_HEAD


def available() -> bool:
    """Whether this torch's oneDNN packs and multiplies bf16 weights on this CPU."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(
            torch.backends.mkldnn.is_available()
            and mkldnn is not None
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def _bf16_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The bf16 weight ``module`` multiplies by under bf16 autocast, or None for a layer left as it is."""
    if type(module) is not torch.nn.Linear or type(module.weight.data) is not torch.Tensor:
        return None
    weight = module.weight
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.dtype == torch.bfloat16:
        return weight.detach()
    if weight.dtype == torch.float32 and hasattr(module, HALF_HEAD):  # the tied head's bf16 copy, made here
        return weight.detach().to(torch.bfloat16)
    return None


def _packed_forward(module: torch.nn.Module, weight: torch.Tensor, packed: torch.Tensor, own):
    bias = None if module.bias is None else module.bias.detach().to(torch.bfloat16)
    out_features, in_features = weight.shape

    def forward(self, x):
        autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        recording = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if recording or x.device.type != "cpu" or not (x.dtype == torch.bfloat16 or autocast):
            return own(x)
        if x.dtype != torch.bfloat16:
            if not x.is_floating_point():
                return own(x)
            x = x.to(torch.bfloat16)  # autocast's own cast of the input
        flat = x.reshape(-1, in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out_features)

    return types.MethodType(forward, module)


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int):
    """Within this block the bf16 linear layers of ``model`` multiply with weights reordered for oneDNN once
    (module docstring); their forwards are put back after. ``rows``: the rows of a decoding step (the layout's
    hint). A null context where oneDNN has no bf16. The weights must not change inside the block."""
    if not available():
        yield model
        return
    patched = []
    try:
        with torch.no_grad():
            for module in model.modules():
                weight = _bf16_weight(module)
                if weight is None:
                    continue
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, max(1, int(rows)))
                had_own = "forward" in vars(module)
                patched.append((module, had_own, vars(module).get("forward")))
                module.forward = _packed_forward(module, weight, packed, module.forward)
        yield model
    finally:
        for module, had_own, own in patched:
            if had_own:
                module.forward = own
            else:
                del module.forward
