"""What every trainer's run shares, offline and online: the run's tokenizer, the router loss weight of a
mixture of experts, the data order (a stateless function of (seed, step)), micro-batching, and the end of a
run (``final/``, ``summary.json``, the report)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhfkit.config import RunConfig
from rlhfkit.engine.folder import RunDir
from rlhfkit.errors import ConfigError
from rlhfkit.models import load_tokenizer, save_hf_folder, unwrap_model
from rlhfkit.reporting.report import write_report


def run_tokenizer(cfg: RunConfig):
    """The run's tokenizer: ``model.name_or_path``'s, with ``model.missing_pad`` and ``data.chat_template``."""
    return load_tokenizer(
        cfg.model.name_or_path,
        trust_remote_code=cfg.model.trust_remote_code,
        missing_pad=cfg.model.missing_pad,
        chat_template=cfg.data.chat_template,
    )


def router_aux_coef(model: torch.nn.Module, configured: float | None) -> float:
    """The weight of a mixture-of-experts' router load-balancing loss (Fedus et al. 2022, Switch Transformer
    eq. 4, as transformers computes it): ``configured``, or when None the model config's own
    ``router_aux_loss_coef``; 0 for a model without a router.

    Raises:
        ConfigError: a positive ``configured`` weight for a model that has no router.
    """
    config = unwrap_model(model).config
    has_router = hasattr(config, "output_router_logits")
    if configured is None:
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if has_router else 0.0
    if configured > 0 and not has_router:
        raise ConfigError(
            f"model.router_aux_loss_coef={configured}, but {type(unwrap_model(model)).__name__} is "
            "not a mixture of experts (it has no router); remove the key"
        )
    return float(configured)


def batch_indices(
    num_examples: int, batch_size: int, step: int, seed: int, shuffle: bool = True
) -> list[int]:
    """The example indices of optimizer step ``step`` (1-based): a stateless function of (seed, step).

    The data is one endless stream of epochs, each a permutation seeded by (seed, epoch); step k takes
    items [(k-1)*batch_size, k*batch_size) of that stream, so a batch may span two epochs.
    """
    start = (step - 1) * batch_size
    out: list[int] = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_examples)
        order = _epoch_order(num_examples, seed, epoch, shuffle)
        out.extend(order[offset : offset + batch_size - len(out)])
    return out


def _epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def micro_batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    """Consecutive chunks of ``items`` of at most ``size``."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def finish_run(
    run: RunDir,
    accelerator,
    summary: dict[str, Any],
    tokenizer,
    model: torch.nn.Module,
    dtype: str = "float32",
    more: dict[Any, torch.nn.Module] | None = None,
) -> None:
    """The end of every trainer's run: on the main process, save ``model`` to ``run.final_dir`` (and each of
    ``more``, folder -> model) as a Hugging Face folder in ``dtype`` and write ``summary.json``; close the run
    on every process; then write the run's report (main process)."""
    if accelerator.is_main_process:
        for folder, saved in {run.final_dir: model, **(more or {})}.items():
            save_hf_folder(saved, tokenizer, folder, dtype=dtype)
        run.write_summary(summary)
    run.close()
    if accelerator.is_main_process:
        write_report(run.path)
