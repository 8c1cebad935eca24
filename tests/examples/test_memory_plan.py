"""benchmarks/memory_plan.py and docs/performance.md's "Memory at scale": the parameter counts are the models'
own, and every computed figure of the section's tables is the formula's (the tables are parsed from the page
and recomputed, so an edit of the page or of the formula that makes them disagree fails here)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.examples.loader import ROOT, load_example

plan_module = load_example("memory_plan", ROOT / "benchmarks")
PAGE = ROOT / "docs" / "performance.md"
SECTION = "## Memory at scale: sharded PPO with the vLLM engine"


def section_tables() -> dict[str, list[list[str]]]:
    """The section's tables by the first cell of their header row, each as its rows of cells (header and
    separator left out)."""
    text = PAGE.read_text()
    assert SECTION in text, f"{PAGE.name} has no section {SECTION!r}"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    tables: dict[str, list[list[str]]] = {}
    current = None
    for line in body.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if current is None:
            current = tables.setdefault(cells[0], [])
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        current.append(cells)
    return tables


def number(cell: str) -> float:
    """The first number of a cell (thousands' commas and bold marks dropped)."""
    found = re.search(r"-?[\d,]*\.?\d+", cell.replace("**", ""))
    assert found, f"no number in {cell!r}"
    return float(found.group().replace(",", ""))


def half_unit(cell: str) -> float:
    """Half a unit of the last decimal place a cell's number shows (0.005 for "4.37", 0.5 for "46,053")."""
    found = re.search(r"-?[\d,]*\.?\d+", cell.replace("**", ""))
    assert found, f"no number in {cell!r}"
    decimals = len(found.group().split(".")[1]) if "." in found.group() else 0
    return 0.5 * 10**-decimals


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_counts_are_the_models_own(tied):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

    shape = dict(plan_module.LLAMA_8B, hidden_size=64, intermediate_size=96, num_hidden_layers=3)
    shape.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=101)
    shape["tie_word_embeddings"] = tied
    config = LlamaConfig(**shape)
    counts = plan_module.parameter_counts(config)
    config.num_labels = 1
    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(config)
        scalar = AutoModelForSequenceClassification.from_config(config)
    assert counts["causal"] == sum(p.numel() for p in causal.parameters())
    assert counts["scalar"] == sum(p.numel() for p in scalar.parameters())
    assert counts["layer"] == sum(p.numel() for p in causal.model.layers[0].parameters())
    assert counts["root"] == counts["causal"] - 3 * counts["layer"]


def test_llama_8b_shape_is_8b():
    counts = plan_module.parameter_counts(plan_module.llama_config())
    assert counts["causal"] == 8_030_261_248  # Llama-3.1-8B's published count


def test_bytes_per_parameter_table_is_measured_over_counted():
    rows = section_tables()["part"]
    assert len(rows) >= 5
    for part, measured, counted, per, *_ in rows:
        # The page rounds to the decimals it shows; the measured MiB have one decimal, so allow its rounding too.
        expected = number(measured) * 2**20 / number(counted)
        shown = half_unit(per) + expected * 0.05 / number(measured)
        assert number(per) == pytest.approx(expected, abs=shown), part


def test_the_8b_plans_are_the_formulas():
    tables = section_tables()
    settings = tables["plan"]
    parts = tables["per GPU (GiB)"]
    names = {"trained": "trained", "frozen": "frozen", "engine weights": "engine_weights"}
    names.update({"KV cache": "kv_cache", "activations": "activations", "gathered": "gathered"})
    names.update({"total": "total", "margin": "margin"})
    config = plan_module.llama_config()
    assert len(settings) >= 3
    for column, (label, gpus, frozen, kv_tokens, rows, sequence, scores) in enumerate(settings, start=1):
        plan = plan_module.Plan(
            gpus=int(number(gpus)),
            frozen_sharded={"shard": True, "replicate": False}[frozen.strip("`")],
            kv_cache_tokens=int(number(kv_tokens)),
            micro_batch_rows=int(number(rows)),
            sequence=int(number(sequence)),
            attention_scores={"yes": True, "no": False}[scores],
        )
        expected = plan_module.per_gpu_gib(plan, config)
        seen = set()
        for row in parts:
            key = next(v for k, v in names.items() if row[0].replace("**", "").startswith(k))
            seen.add(key)
            shown = half_unit(row[column]) + 1e-9
            assert number(row[column]) == pytest.approx(expected[key], abs=shown), (label, row[0])
        assert seen == set(names.values()), seen
