"""Import a script of ``examples/`` as a module (the examples are scripts, not a package)."""

from __future__ import annotations

import importlib.util
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
