"""The tree reads as the architecture: no module imports a package above it, no cycles.

Layers of ``tessera``, lowest first (a module may import its own layer's modules and any lower
layer): the base modules at ``tessera/`` top level, ``composition``, ``kernels`` and ``engines``,
``transport``, ``control``, the roles (``kvpool``, ``generation``, ``retrieval``, which never
import each other), ``launcher`` (role processes on one machine) and ``benchmark`` (workloads,
the load client, ``tessera bench`` and ``verify``), and the entry points (``roles``, ``cli``).

``tessera_lab`` (simulator, chaos harnesses, many hosts, eval) is one layer above all of that:
it may import any of ``tessera``, and ``tessera`` never imports it, except that a ``cli``
command that runs lab code imports it inside its own body, so ``import tessera.cli`` and every
serving process load none of the lab.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tessera", "tessera_lab")
ENTRY = {"roles", "cli", "__main__"}
LAYERS = {"composition": 1, "kernels": 2, "engines": 2, "transport": 3, "control": 4,
          "kvpool": 5, "generation": 5, "retrieval": 5, "launcher": 6, "benchmark": 6}
LAB = 9  # above the entry points (8)
# inside the lab: the answer scorer, then the harnesses, then many hosts (built on the chaos run)
LAB_LAYERS = {"eval": 1, "chaos": 1, "simulate": 1, "hosts": 2}


def _ours(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PACKAGES)


def _part(module: str) -> str:
    """The package (or top-level module) a dotted ``tessera.*`` name belongs to; ``tessera_lab``
    for every lab module."""
    parts = module.split(".")
    if parts[0] == "tessera_lab":
        return "tessera_lab"
    return parts[1] if len(parts) > 1 else ""


def _layer(part: str) -> int:
    if part == "tessera_lab":
        return LAB
    if part in ENTRY:
        return 8
    return LAYERS.get(part, 0)


def _modules(package: str = "tessera") -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _name(path: Path) -> str:
    """``tessera/engines/base.py`` -> ``tessera.engines.base``; a package is its ``__init__``."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_name(p) for package in PACKAGES for p in _modules(package)}


def _imports_in(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every ``tessera`` or ``tessera_lab`` module the source of module ``name`` imports, wherever it stands:
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
        out.update(t for t in targets if _ours(t))
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
        "import tessera_lab.simulate.run\n"
        "if TYPE_CHECKING:\n"
        "    from tessera.engines.paged import PagedEngine\n"
        "def later():\n"
        "    from .stats import StatsWindow\n"
    )
    assert _imports_in(source, "tessera.control.planner") == {
        "tessera.units", "tessera.retrieval.api", "tessera.control.plane", "tessera.engines.paged",
        "tessera.control.stats", "tessera_lab.simulate.run"}


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_package_above_it(path: Path) -> None:
    """Every ``tessera`` import (lazy ones included) goes to the same or a lower layer; the lab's
    own rule is the test below."""
    rel = path.relative_to(ROOT / "tessera")
    own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
    bad = []
    for target in _imports(path):
        part = _part(target)
        if part == own or part == "tessera_lab":
            continue
        if _layer(part) > _layer(own) or (_layer(part) == _layer(own) == 5):
            bad.append(target)
    assert not bad, f"{rel} imports {bad}, above (or beside, for roles) its layer"


def _lab_imports(source: str, name: str) -> tuple[set[str], set[str]]:
    """The ``tessera_lab`` modules ``name`` imports at module level, and those it imports only
    inside a function body."""
    tree = ast.parse(source)
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
              for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)}
    top, lazy = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found = {t for t in _imports_in(ast.unparse(node), name) if _part(t) == "tessera_lab"}
            (lazy if id(node) in nested else top).update(found)
    return top, lazy


def test_the_lab_reader_tells_a_command_body_from_module_level() -> None:
    """A lab import inside a function counts as lazy; at module level or under TYPE_CHECKING, not."""
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from tessera_lab.chaos.harness import ChaosRun\n"
              "def chaos():\n    from tessera_lab.hosts.chaos import run_on_hosts\n")
    assert _lab_imports(source, "tessera.cli") == ({"tessera_lab.chaos.harness"}, {"tessera_lab.hosts.chaos"})


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_tessera_never_imports_the_lab(path: Path) -> None:
    """No ``tessera`` module imports ``tessera_lab``, save the CLI's lab commands, each inside its body."""
    top, lazy = _lab_imports(path.read_text(), _name(path))
    assert not top, f"{path.relative_to(ROOT)} imports {sorted(top)} at module level"
    if _name(path) != "tessera.cli":
        assert not lazy, f"{path.relative_to(ROOT)} imports the lab: {sorted(lazy)}"


@pytest.mark.parametrize("path", _modules("tessera_lab"), ids=lambda p: str(p.relative_to(ROOT)))
def test_lab_modules_import_no_lab_package_above_them(path: Path) -> None:
    """Inside the lab, too, imports go down: hosts builds on chaos, and chaos, eval and the
    simulator never import one another."""
    rel = path.relative_to(ROOT / "tessera_lab")
    own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
    assert own in LAB_LAYERS or own == "__init__", f"tessera_lab/{own} has no layer in LAB_LAYERS"
    bad = []
    for target in _imports(path):
        if _part(target) != "tessera_lab" or len(target.split(".")) < 2:
            continue
        part = target.split(".")[1]
        if part != own and LAB_LAYERS.get(part, 0) >= LAB_LAYERS.get(own, 0) and own != "__init__":
            bad.append(target)
    assert not bad, f"tessera_lab/{rel} imports {bad}, above or beside its layer"


def test_the_control_plane_never_imports_a_role() -> None:
    """``control/`` knows nothing of retrieval, generation or the KV pool's memory node."""
    for path in (ROOT / "tessera" / "control").rglob("*.py"):
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
    graph = {_name(p): (_imports(p) & MODULES) - {_name(p)} for package in PACKAGES for p in _modules(package)}
    reach = {m: _reachable(graph, m) for m in graph}
    loops = {frozenset(n for n in reach[m] if m in reach[n]) for m in graph if m in reach[m]}
    assert not loops, "import cycles: " + "; ".join(sorted(" <-> ".join(sorted(c)) for c in loops))
