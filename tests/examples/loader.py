"""Import a script of ``examples/`` as a module (the examples are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module named after the file (``experiments/temperature`` -> ``temperature``),
    registered in ``sys.modules``: dataclasses look it up."""
    spec = importlib.util.spec_from_file_location(Path(name).name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
