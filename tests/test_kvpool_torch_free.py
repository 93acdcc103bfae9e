"""A memory node only moves bytes: neither its modules nor a running node import torch.

torch costs a memory node a second of start-up and hundreds of MB of memory for nothing: it
sizes its arena from config.json and serves slots, it never touches a tensor. Both tests read
the child's ``-X importtime`` log, which names every module the process imported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cluster import child_env
from helpers.kvpool import PoolConfig
from helpers.processes import StartMemoryNode

# what ``tessera run --role kvpool`` imports: the role dispatcher and the memory node
ENTRY_MODULES = ("tessera.roles", "tessera.kvpool.node")


def _imports(log: str) -> list[tuple[int, str]]:
    """(depth, module) of each ``import time: self | cumulative | name`` line, in log order."""
    out = []
    for line in log.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1]
            out.append((len(name) - len(name.lstrip()), name.strip()))
    return out


def assert_never_imported(log: str, module: str) -> None:
    """``module`` is absent from an importtime log; else say which chain of imports pulled it in."""
    entries = _imports(log)
    assert any(name == "tessera.kvpool.node" for _, name in entries), "no import log: was importtime on?"
    hit = next((i for i, (_, name) in enumerate(entries) if name == module), None)
    if hit is None:
        return
    chain, depth = [module], entries[hit][0]
    for d, name in entries[hit + 1:]:  # a module is logged after what it imports, one level out
        if d < depth:
            chain.append(name)
            depth = d
    pytest.fail(f"{module} was imported: {' <- '.join(chain)}")


def test_the_kvpool_roles_modules_import_without_torch() -> None:
    """A fresh interpreter that imports the kvpool role's entry modules has not loaded torch."""
    code = "".join(f"import {m}\n" for m in ENTRY_MODULES)
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                            env=child_env(), timeout=60, check=True)
    assert_never_imported(result.stderr, "torch")


def test_a_running_memory_node_never_imports_torch(tmp_path: Path, pool_config: PoolConfig,
                                                   memory_node: StartMemoryNode,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``tessera run --role kvpool``: start-up checks, arena, /info and a clean stop, all without torch."""
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # the child logs every import it makes
    node = memory_node(pool_config(tmp_path), tmp_path)
    node.endpoint()
    assert node.stop() == 0
    assert_never_imported(node.proc.log(), "torch")
