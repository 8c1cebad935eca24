"""The package's layers, read from its source (``ast``; no module is imported): no import cycle and no import
against the layer order of docs/design.md ("The layers"), counting function-level and ``TYPE_CHECKING``
imports, plus the shape of the tree that the design page draws (the package root, file sizes, one basename
per module).

The checker itself is tested on small synthetic trees first, so that a broken checker cannot pass the real
tree: an upward import and a cycle must each be reported.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "rlhfkit"

# Highest first. A module may import from its own layer or any layer below it, never above. Layers that
# share a line are one layer (they may import each other, without a cycle). The root package's
# ``__init__`` (the version) sits with types and errors; ``__main__`` with the command line.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli", "__main__"),
    ("commands",),
    ("quickstart",),
    ("trainers",),
    ("reporting",),
    ("rollout",),
    ("models", "data", "tasks"),
    ("engine",),
    ("config",),
    ("algos",),
    ("types", "errors", ""),
)
ROOT_MODULES = {"cli.py", "commands.py", "errors.py", "types.py", "__init__.py", "__main__.py"}
# The one import that goes up: the root's ``train`` (the Python entry point ``rlhfkit.train``, docs/design.md)
# imports rlhfkit.commands inside its body, when it is called. The root stays in the bottom layer for every
# module that reads ``__version__``; test_the_root_imports_upward_only_inside_its_entry_point keeps the
# exception to that one function and that one module.
ROOT_ENTRY_POINT = ("train", "rlhfkit.commands")
MAX_LINES = 450
MAX_TRAINER_FILES = 10  # in trainers/, besides the online/ package


def module_files(package: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``) for every ``.py`` file under ``package``."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its file (module level, inside functions, under
    ``if TYPE_CHECKING:``). ``from a.b import c`` counts as importing ``a.b.c`` when that is a module, else
    ``a.b``; a name that is no module of the package is read as its nearest enclosing module."""
    root = package.name
    modules = module_files(package)

    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(nearest(a.name) for a in node.names if a.name.split(".")[0] == root)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from . import x / from ..a import b
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != root:
                    continue
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    targets.add(full if full in modules else nearest(source))
        targets.discard(None)
        targets.discard(name)
        graph[name] = {t for t in targets if t is not None}
    return graph


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (0 is the top)."""
    first = module.split(".")[1] if "." in module else ""
    for index, names in enumerate(LAYERS):
        if first in names:
            return index
    raise AssertionError(f"{module}: not in any layer of LAYERS; add its folder to the order")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module from a layer above its own, as ``a -> b``."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) < layer_of(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds an import cycle), Tarjan's."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "rlhfkit"
    for rel, text in {"__init__.py": "", **files}.items():
        path = package / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_checker_reports_an_upward_import(tmp_path):
    package = _tree(
        tmp_path,
        {
            "algos/__init__.py": "",
            "algos/losses.py": "def f():\n    from rlhfkit.trainers.sft import train\n",  # function level
            "trainers/__init__.py": "",
            "trainers/sft.py": "from rlhfkit.algos import losses\n",
        },
    )
    graph = import_graph(package)
    assert upward_imports(graph) == ["rlhfkit.algos.losses -> rlhfkit.trainers.sft"]
    assert cycles(graph) == [["rlhfkit.algos.losses", "rlhfkit.trainers.sft"]]


def test_checker_reports_a_cycle_inside_one_layer(tmp_path):
    package = _tree(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/a.py": "from rlhfkit.engine.b import x\n",
            "engine/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlhfkit.engine import a\n",
            "engine/c.py": "from . import a\n",  # relative imports count too
        },
    )
    graph = import_graph(package)
    assert graph["rlhfkit.engine.c"] == {"rlhfkit.engine.a"}
    assert upward_imports(graph) == []
    assert cycles(graph) == [["rlhfkit.engine.a", "rlhfkit.engine.b"]]


def test_checker_refuses_a_folder_outside_the_order(tmp_path):
    package = _tree(tmp_path, {"extras/__init__.py": "", "extras/thing.py": "import rlhfkit.types\n"})
    with pytest.raises(AssertionError, match="not in any layer"):
        upward_imports(import_graph(package))


def package_graph() -> dict[str, set[str]]:
    """The package's import graph without the root entry point's call-time import (:data:`ROOT_ENTRY_POINT`)."""
    graph = import_graph(PACKAGE)
    graph["rlhfkit"] = graph["rlhfkit"] - {ROOT_ENTRY_POINT[1]}
    return graph


def test_the_root_imports_upward_only_inside_its_entry_point():
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    function, module = ROOT_ENTRY_POINT
    inside = set()
    for node in tree.body:
        found = {
            n.module
            for n in ast.walk(node)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("rlhfkit")
        }
        found |= {a.name for n in ast.walk(node) if isinstance(n, ast.Import) for a in n.names}
        found = {name for name in found if name.startswith("rlhfkit")}
        if isinstance(node, ast.FunctionDef) and node.name == function:
            inside |= found
        else:
            assert not found, f"the root package imports {found} outside its {function}()"
    assert inside == {module}


def test_the_package_has_no_import_cycle():
    assert cycles(package_graph()) == []


def test_no_import_points_up_the_layers():
    assert upward_imports(package_graph()) == []


def test_the_tree_keeps_its_shape():
    root = {p.name for p in PACKAGE.glob("*.py")}
    assert root <= ROOT_MODULES, (
        f"modules at the package root beyond {sorted(ROOT_MODULES)}: {root - ROOT_MODULES}"
    )
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"source files over {MAX_LINES} lines: {long}"
    trainers = [p.name for p in (PACKAGE / "trainers").glob("*.py")]
    assert len(trainers) <= MAX_TRAINER_FILES, sorted(trainers)
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert not [n for n, k in names.items() if k > 1], (
        f"basenames used twice: {[n for n, k in names.items() if k > 1]}"
    )
