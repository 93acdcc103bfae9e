"""The tree reads as the architecture: no module imports a package above it, no cycles.

Layers, lowest first (a module may import its own layer's modules and any lower layer):
the base modules at ``tessera/`` top level, ``composition``, ``kernels`` and ``engines``,
``transport``, ``control``, the roles (``kvpool``, ``generation``, ``retrieval``, which never
import each other), ``launcher`` (role processes on one machine) and ``benchmark``, ``hosts``
(the same across network namespaces: it builds on both) and ``simulate`` (the real control plane
over simulated nodes, with the bench's workloads and report), and the entry points (``roles``, ``cli``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tessera"
ENTRY = {"roles", "cli", "__main__"}
LAYERS = {"composition": 1, "kernels": 2, "engines": 2, "transport": 3, "control": 4,
          "kvpool": 5, "generation": 5, "retrieval": 5, "launcher": 6, "benchmark": 6,
          "hosts": 7, "simulate": 7}


def _part(module: str) -> str:
    """The package (or top-level module) a dotted ``tessera.*`` name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(part: str) -> int:
    if part in ENTRY:
        return 8
    return LAYERS.get(part, 0)


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    """``tessera/engines/base.py`` -> ``tessera.engines.base``; a package is its ``__init__``."""
    return ".".join(("tessera", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


MODULES = {_name(p) for p in _modules()}


def _imports_in(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every ``tessera`` module the source of module ``name`` imports, wherever the import stands:
    module level, inside a function, under ``if TYPE_CHECKING:``. ``from tessera.pkg import mod``
    names ``tessera.pkg.mod`` and relative imports are resolved, so no spelling of an import
    escapes the tests below."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y: relative to this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t == "tessera" or t.startswith("tessera."))
    return out


def _imports(path: Path) -> set[str]:
    return _imports_in(path.read_text(), _name(path), path.name == "__init__.py")


def test_the_import_reader_sees_every_spelling_of_an_import() -> None:
    """Regression: the cycle test read module-level ``from`` imports only, so the loops closed by
    an import inside a function or under ``if TYPE_CHECKING:`` went unseen."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import tessera.units\n"
        "from tessera.retrieval import api\n"
        "from . import plane\n"
        "if TYPE_CHECKING:\n"
        "    from tessera.engines.paged import PagedEngine\n"
        "def later():\n"
        "    from .stats import StatsWindow\n"
    )
    assert _imports_in(source, "tessera.control.planner") == {
        "tessera.units", "tessera.retrieval.api", "tessera.control.plane", "tessera.engines.paged",
        "tessera.control.stats"}


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_package_above_it(path: Path) -> None:
    """Every ``tessera`` import (lazy ones included) goes to the same or a lower layer."""
    rel = path.relative_to(PACKAGE)
    own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
    bad = []
    for target in _imports(path):
        part = _part(target)
        if part == own:
            continue
        if _layer(part) > _layer(own) or (_layer(part) == _layer(own) == 5):
            bad.append(target)
    assert not bad, f"{rel} imports {bad}, above (or beside, for roles) its layer"


def test_the_control_plane_never_imports_a_role() -> None:
    """``control/`` knows nothing of retrieval, generation or the KV pool's memory node."""
    for path in (PACKAGE / "control").rglob("*.py"):
        roles = [t for t in _imports(path) if _part(t) in ("retrieval", "generation", "kvpool", "serving")]
        assert not roles, f"{path.name} imports {roles}"


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_no_import_cycles_between_modules() -> None:
    """No import loop at all, counting lazy and ``TYPE_CHECKING`` imports (a loop means two
    modules own one concept; hiding one edge in a function only hides that)."""
    graph = {_name(p): (_imports(p) & MODULES) - {_name(p)} for p in _modules()}
    reach = {m: _reachable(graph, m) for m in graph}
    loops = {frozenset(n for n in reach[m] if m in reach[n]) for m in graph if m in reach[m]}
    assert not loops, "import cycles: " + "; ".join(sorted(" <-> ".join(sorted(c)) for c in loops))
