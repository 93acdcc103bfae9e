"""A damaged or exposed data directory, from the fault's side, against real retrieval processes.

The fault writes bytes into the files a stopped retrieval role left in ``retrieval.data_dir``;
the role is then started on them and must rebuild what is a cache (an index file), refuse
what is the source of truth (the SQLite store) with the way to recover, and never crash.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import urllib3
from helpers.cluster import free_port, with_secret_file, write_config
from helpers.processes import RoleProcess

from tessera.config import ClusterConfig, ControlConfig, GenerationNodeConfig, KVPoolNodeConfig, RetrievalConfig
from tessera.retrieval.store.index import index_path
from tessera.retrieval.store.sqlite import DB_NAME
from tessera.wire import WIRE_VERSION

V = WIRE_VERSION
QUERY = {"version": V, "scope": "kb", "query": "Which record mentions the green heron?", "top_k": 3}
ANIMALS = ["heron", "otter", "lynx", "badger", "falcon", "newt", "marten", "ibis", "vole", "crane"]
COLORS = ["green", "grey", "red", "blue", "white", "black", "amber", "violet", "brown", "silver"]


def role(directory: Path, data: Path, cluster_secret: Path) -> tuple[RoleProcess, str]:
    """A retrieval process on fresh ports serving the units of ``data``."""
    port = free_port()
    config = ClusterConfig(
        block_tokens=4, control=ControlConfig(heartbeat_timeout_s=60.0),
        retrieval=RetrievalConfig(port=port, max_unit_tokens=64, data_dir=str(data)),
        kvpools=(KVPoolNodeConfig("kv0", port=free_port(), data_port=free_port(), capacity_blocks=64),),
        generation=(GenerationNodeConfig("gen0", port=free_port()),))
    directory.mkdir(parents=True, exist_ok=True)
    proc = RoleProcess("retrieval", write_config(directory, with_secret_file(config, cluster_secret)))
    return proc, f"http://127.0.0.1:{port}"


def post(url: str, path: str, body: Any) -> tuple[int, Any]:
    resp = urllib3.request("POST", url + path, body=orjson.dumps(body), timeout=60.0)
    return resp.status, orjson.loads(resp.data)


@dataclass(frozen=True)
class SavedStore:
    data: Path  # what a stopped role left: units.sqlite3 and index/*.usearch of scope "kb"
    ranking: list[str]  # unit ids QUERY retrieved before the role stopped


@pytest.fixture(scope="module")
def saved_store(tmp_path_factory: pytest.TempPathFactory, cluster_secret: Path) -> SavedStore:
    """200 units ingested into a data directory that existed before, world-readable (0755); role stopped."""
    directory = tmp_path_factory.mktemp("integrity")
    data = directory / "data"
    data.mkdir()
    data.chmod(0o755)
    proc, url = role(directory, data, cluster_secret)
    try:
        proc.wait_healthy(url, timeout=120)
        units = [{"scope": "kb", "text": f"Record {i}: the {COLORS[i % 10]} {ANIMALS[i // 10 % 10]} was seen at "
                                         f"station {i}."} for i in range(200)]
        status, out = post(url, "/v1/units", {"version": V, "units": units})
        assert status == 200 and len(out["units"]) == 200, out
        status, hits = post(url, "/v1/retrieve", QUERY)
        assert status == 200, hits
    finally:
        assert proc.stop() == 0, proc.log()
    return SavedStore(data, [u["unit_id"] for u in hits["units"]])


@pytest.fixture
def damaged(saved_store: SavedStore, tmp_path: Path) -> Iterator[Path]:
    """A copy of the saved data directory for one test to damage."""
    copy = tmp_path / "data"
    shutil.copytree(saved_store.data, copy)
    yield copy


def overwrite(path: Path, offset: int, n: int = 200, seed: int = 22) -> None:
    """Write ``n`` random bytes into ``path`` at ``offset`` (in place, same size)."""
    noise = bytes((seed * 7919 + i * 104729) % 251 for i in range(n))
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(noise)


def test_an_index_file_with_overwritten_bytes_is_rebuilt_not_loaded(saved_store: SavedStore, damaged: Path,
                                                                    tmp_path: Path, cluster_secret: Path) -> None:
    """Regression: 200 random bytes in an index file: loaded without a warning, SIGSEGV on retrieve."""
    index = index_path(damaged / "index", "kb")
    vectors = 200 * 384 * 4  # usearch writes the vectors first, then the HNSW graph
    overwrite(index, vectors + 6200)  # into the graph, where the old code died on a search (SIGSEGV)
    proc, url = role(tmp_path, damaged, cluster_secret)
    try:
        proc.wait_healthy(url, timeout=120)
        for animal in ANIMALS:  # searches that walk the damaged part of the graph, if it were loaded
            status, hits = post(url, "/v1/retrieve", {**QUERY, "query": f"Where was the {animal} seen?"})
            assert status == 200 and len(hits["units"]) == 3, hits
        status, hits = post(url, "/v1/retrieve", QUERY)
        assert status == 200 and [u["unit_id"] for u in hits["units"]] == saved_store.ranking, hits
    finally:
        code = proc.stop()
    assert code == 0, proc.log()
    assert f"index file {index} not loaded ({index} (" in proc.log()
    assert "rebuilding it from the unit store" in proc.log()


def test_a_corrupt_page_in_the_unit_store_is_refused_with_how_to_recover(damaged: Path, tmp_path: Path,
                                                                         cluster_secret: Path) -> None:
    """Regression: a broken SQLite page: the role started without a warning, 2 of 200 units were 500s."""
    db = damaged / DB_NAME
    with sqlite3.connect(db) as c:
        page_size = c.execute("PRAGMA page_size").fetchone()[0]
        leaves = [p for (p,) in c.execute("SELECT pageno FROM dbstat WHERE name = 'units' AND pagetype = 'leaf'")]
    c.close()
    assert len(leaves) > 10, leaves
    overwrite(db, (leaves[len(leaves) // 2] - 1) * page_size)  # the page's header and cell pointers
    proc, _ = role(tmp_path, damaged, cluster_secret)
    try:
        code = proc.proc.wait(90)
    finally:
        proc.stop()
    log = proc.log()
    assert code == 3, log
    assert f"{db} is corrupt (" in log and "Tessera will not serve units from it" in log
    assert f"restore {damaged} from a backup" in log and f"`sqlite3 {db} .recover | sqlite3" in log
    assert f"move {damaged} away to start empty" in log


def test_the_data_directory_is_readable_by_its_user_only(saved_store: SavedStore) -> None:
    """Regression: units.sqlite3 (every tenant's text) and the index files were world-readable."""
    seen = {}
    for path in [saved_store.data, *saved_store.data.rglob("*")]:
        seen[path.relative_to(saved_store.data).as_posix()] = stat.S_IMODE(os.stat(path).st_mode)
    assert {"index", DB_NAME} <= set(seen) and any(p.endswith(".usearch.sha256") for p in seen), seen
    loose = {p: f"{m:o}" for p, m in seen.items() if m & 0o077}
    assert not loose, loose
    assert seen["."] == 0o700 and seen["index"] == 0o700  # the data dir existed before as 0755: tightened
