"""Import a script of ``examples/`` as a module (the examples are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def load_example(name: str, folder: Path = EXAMPLES) -> ModuleType:
    """``examples/<name>.py`` (or ``<folder>/<name>.py``) as a module named after the file
    (``experiments/temperature`` -> ``temperature``), registered in ``sys.modules``: dataclasses look it up."""
    spec = importlib.util.spec_from_file_location(Path(name).name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def smoke_seed(script: ModuleType, out: Path) -> dict:
    """Seed 0 of a registered runner (``main`` with ``--smoke``) into ``out``: its ``figures.json``, whose
    4-sample reads are checked to be 4 samples of each of 8 held-out prompts."""
    assert script.main(["--out", str(out), "--seeds", "0", "--smoke"]) == 0
    figures = json.loads((out / "seed-0" / "figures.json").read_text())
    for read in figures["reads"].values():
        assert read["prompts"] == 8 and read["samples_per_prompt"] == 4 and read["responses"] == 32
        assert -10 < read["gold"] < 10
    return figures


def spy_generate(monkeypatch) -> tuple[list[list[int]], list[tuple[list[int], tuple[int, ...]]]]:
    """Record every ``generate_responses`` call of the online trainer, wherever a module of
    ``rlhfkit.trainers`` imported it: per call, the responses' lengths and (stop ids, suppressed ids)."""
    import importlib
    import pkgutil

    import rlhfkit.trainers
    from rlhfkit.rollout import generation

    lengths, stops = [], []
    generate = generation.generate_responses

    def spy(*args, **kwargs):
        out = generate(*args, **kwargs)
        lengths.append(out.mask.sum(1).tolist())
        stops.append((list(kwargs["stop_token_ids"]), tuple(kwargs["sampling"].suppress_ids)))
        return out

    for info in pkgutil.walk_packages(rlhfkit.trainers.__path__, "rlhfkit.trainers."):
        module = importlib.import_module(info.name)
        if getattr(module, "generate_responses", None) is generate:
            monkeypatch.setattr(module, "generate_responses", spy)
    return lengths, stops
