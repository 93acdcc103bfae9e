"""The tree reads as the architecture: no module imports a package above it, no cycles.

Layers, lowest first (a module may import its own layer's modules and any lower layer):
the base modules at ``tessera/`` top level, ``composition``, ``kernels`` and ``engines``,
``transport``, ``control``, the roles (``kvpool``, ``generation``, ``retrieval``, which never
import each other), ``launcher`` (role processes on one machine) and ``benchmark``, ``hosts``
(the same across network namespaces: it builds on both), and the entry points (``roles``, ``cli``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tessera"
ENTRY = {"roles", "cli", "__main__"}
LAYERS = {"composition": 1, "kernels": 2, "engines": 2, "transport": 3, "control": 4,
          "kvpool": 5, "generation": 5, "retrieval": 5, "launcher": 6, "benchmark": 6,
          "hosts": 7}


def _part(module: str) -> str:
    """The package (or top-level module) a dotted ``tessera.*`` name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(part: str) -> int:
    if part in ENTRY:
        return 8
    return LAYERS.get(part, 0)


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tessera"):
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("tessera")]
    return out


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


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


def test_no_import_cycles_between_modules() -> None:
    """Module-level imports form no cycle (a cycle means two modules own one concept)."""
    graph: dict[str, set[str]] = {}
    for path in _modules():
        name = "tessera." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        deps = set()
        for node in tree.body:  # module level only: lazy imports inside functions break cycles
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tessera"):
                deps.add(node.module)
        graph[name] = deps
    seen: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(n: str, trail: list[str]) -> None:
        state = seen.get(n)
        if state == 2 or n not in graph:
            return
        assert state != 1, f"import cycle: {' -> '.join([*trail, n])}"
        seen[n] = 1
        for d in graph[n]:
            visit(d, [*trail, n])
        seen[n] = 2

    for n in graph:
        visit(n, [])
