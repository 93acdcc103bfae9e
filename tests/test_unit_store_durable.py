"""The durable unit store: SQLite records + saved usearch indexes in a data directory.

Real SQLite, real usearch, the served model's tokenizer and the real MiniLM embedder.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.cluster import child_env
from helpers.store import DOCS, QUERIES, store_parts

from tessera.config import RetrievalConfig
from tessera.errors import BadRequest
from tessera.retrieval.embedder import Embedder
from tessera.retrieval.store.records import NewRecord, StoreMismatch
from tessera.retrieval.store.sqlite import UnitRecords
from tessera.retrieval.store.unit_store import UnitStore
from tessera.units import ServingFingerprint, UnitFactory


@pytest.fixture(scope="module")
def parts() -> tuple[UnitFactory, Embedder]:
    return store_parts()


def open_store(parts: tuple[UnitFactory, Embedder], directory: Path) -> UnitStore:
    factory, embedder = parts
    return UnitStore(factory, embedder, RetrievalConfig(max_unit_tokens=64, data_dir=str(directory)))


def ranking(store: UnitStore) -> list[list[tuple[str, dict[str, object]]]]:
    return [[(h.unit.unit_id, dict(h.metadata)) for h in store.retrieve("kb", query=q, top_k=3)] for q in QUERIES]


def test_units_and_rankings_survive_a_reopen_with_the_saved_index(parts, tmp_path: Path) -> None:
    """Closed cleanly, a store reopens from its saved index (no rebuild) with identical results."""
    store = open_store(parts, tmp_path)
    ids = [u.unit_id for u, _ in store.ingest(DOCS).units]
    before = ranking(store)
    store.close()
    again = open_store(parts, tmp_path)
    assert again.rebuilt == [] and len(again) == len(DOCS)
    assert ranking(again) == before
    stored = again.get(ids[0])
    assert stored is not None and stored.unit.text == DOCS[0][1] and stored.metadata == {"topic": "reef"}
    assert stored.unit.token_ids == parts[0].make("kb", DOCS[0][1]).token_ids
    assert again.incarnation == 2
    again.close()


def test_an_unsaved_index_is_rebuilt_from_the_stored_embeddings(parts, tmp_path: Path) -> None:
    """Without a save (a crash), the index is rebuilt from SQLite and ranks the same."""
    store = open_store(parts, tmp_path)
    store.ingest(DOCS)
    before = ranking(store)
    store.records.close()  # no index save: what kill -9 leaves behind
    again = open_store(parts, tmp_path)
    assert again.rebuilt == ["kb"]
    assert ranking(again) == before
    again.close()


def test_a_stale_saved_index_is_caught_up_with_what_changed_since(parts, tmp_path: Path) -> None:
    """Saved before later ingests and deletes (a crash before the next save): only the changes are replayed."""
    store = open_store(parts, tmp_path)
    ids = [u.unit_id for u, _ in store.ingest(DOCS[:3]).units]
    assert store.save_indexes() == 1
    store.ingest(DOCS[3:])
    store.delete([ids[0]])
    expected = ranking(store)
    store.records.close()
    again = open_store(parts, tmp_path)
    assert again.rebuilt == [] and again.caught_up == {"kb": 2} and len(again) == len(DOCS) - 1
    assert ranking(again) == expected
    again.close()


def test_a_store_of_another_fingerprint_is_refused_with_the_fix(parts, tmp_path: Path) -> None:
    """Token ids made by another tokenizer/model must not be served: start-up refuses the store."""
    open_store(parts, tmp_path).close()
    factory, embedder = parts
    other = dataclasses.replace(factory.fingerprint, tokenizer="another-vocabulary")
    with pytest.raises(StoreMismatch, match=r"retrieval\.data_dir") as info:
        UnitStore(UnitFactory(other, factory.tokens), embedder, RetrievalConfig(data_dir=str(tmp_path)))
    assert "another-vocabulary" in str(info.value)


def test_reingesting_a_text_replaces_its_metadata(parts, tmp_path: Path) -> None:
    """Same text again: same unit, not new, and the newest metadata is what retrieval returns."""
    store = open_store(parts, tmp_path)
    [(unit, _)] = store.ingest([DOCS[0]]).units
    [(again, new)] = store.ingest([("kb", DOCS[0][1], {"topic": "reef", "rev": 2})]).units
    assert again.unit_id == unit.unit_id and not new
    assert store.retrieve("kb", query=QUERIES[0], top_k=1)[0].metadata == {"topic": "reef", "rev": 2}
    store.close()


def test_new_text_under_an_external_id_replaces_and_revokes_the_old_unit(parts, tmp_path: Path) -> None:
    """Update by external_id: a new unit identity, the old one revoked and gone from retrieval."""
    store = open_store(parts, tmp_path)
    [(old, _)] = store.ingest([DOCS[0]], external_ids=["doc-1"]).units
    done = store.ingest([("kb", "The Great Barrier Reef has lost half its coral since 1995.", {})],
                        external_ids=["doc-1"])
    [(new, fresh)] = done.units
    assert fresh and new.unit_id != old.unit_id and done.revoked == (old.unit_id,)
    assert store.get(old.unit_id) is None and old.unit_id in store.revoked()
    assert [h.unit.unit_id for h in store.retrieve("kb", query=QUERIES[0], top_k=5)] == [new.unit_id]
    stored = store.get(new.unit_id)
    assert stored is not None and stored.external_id == "doc-1"
    with pytest.raises(BadRequest, match="two different texts"):
        store.ingest([("kb", "a", {}), ("kb", "b", {})], external_ids=["x", "x"])
    store.close()


def test_a_unit_the_batch_ingests_again_survives_losing_its_external_id(parts, tmp_path: Path) -> None:
    """Regression (found by tests/test_api_fuzz.py): a batch that re-ingested unit X and moved X's
    external id to a new text revoked X, so the reply's own units[0] answered GET with 404; and a
    batch swapping two units' external ids revoked both."""
    store = open_store(parts, tmp_path)
    [(x, _)] = store.ingest([DOCS[0]], external_ids=["doc-1"]).units
    done = store.ingest([DOCS[0], DOCS[1]], external_ids=[None, "doc-1"])
    assert done.revoked == () and store.get(x.unit_id) is not None
    y = done.units[1][0]
    assert store.get(x.unit_id).external_id is None and store.get(y.unit_id).external_id == "doc-1"
    store.ingest([DOCS[2]], external_ids=["doc-2"])
    swapped = store.ingest([DOCS[1], DOCS[2]], external_ids=["doc-2", "doc-1"])
    assert swapped.revoked == ()
    assert [store.get(u.unit_id).external_id for u, _ in swapped.units] == ["doc-2", "doc-1"]
    assert len(store) == 3
    store.close()


def test_deletes_are_idempotent_and_unknown_ids_are_reported(parts, tmp_path: Path) -> None:
    """A deleted unit leaves retrieval; deleting it again is 'already'; a never-seen id is 'unknown'."""
    store = open_store(parts, tmp_path)
    ids = [u.unit_id for u, _ in store.ingest(DOCS).units]
    first = store.delete([ids[0], "0" * 32])
    assert first.deleted == (ids[0],) and first.unknown == ("0" * 32,)
    assert store.delete([ids[0]]).already == (ids[0],)
    assert ids[0] not in {h.unit.unit_id for h in store.retrieve("kb", query=QUERIES[0], top_k=10)}
    store.close()
    again = open_store(parts, tmp_path)  # tombstones persist: still idempotent after a restart
    assert again.delete([ids[0]]).already == (ids[0],) and len(again) == len(DOCS) - 1
    again.close()


def test_delete_by_metadata_filter_and_by_scope(parts, tmp_path: Path) -> None:
    """A filter deletes exactly the matching units of its scope; an empty filter deletes the scope."""
    store = open_store(parts, tmp_path)
    ids = [u.unit_id for u, _ in store.ingest([*DOCS, ("other", DOCS[0][1], {"topic": "reef"})]).units]
    assert store.delete_where("kb", {"topic": "coffee"}).deleted == (ids[2],)
    assert {h.unit.unit_id for h in store.retrieve("kb", query="coffee", top_k=10)} == {ids[0], ids[1], ids[3]}
    assert set(store.delete_where("kb").deleted) == {ids[0], ids[1], ids[3]}
    assert store.retrieve("kb", query="coffee") == []
    assert [h.unit.unit_id for h in store.retrieve("other", query="reef")] == [ids[4]]
    store.close()


def test_reingesting_a_deleted_text_brings_the_unit_back(parts, tmp_path: Path) -> None:
    """The same text ingested after its delete is the same unit, live again and no longer revoked."""
    store = open_store(parts, tmp_path)
    [(unit, _)] = store.ingest([DOCS[1]]).units
    store.delete([unit.unit_id])
    [(again, new)] = store.ingest([DOCS[1]]).units
    assert again.unit_id == unit.unit_id and new and unit.unit_id not in store.revoked()
    store.close()


_CRASHER = """
import sys, time
from pathlib import Path
import numpy as np
from tessera.retrieval.store.records import NewRecord
from tessera.retrieval.store.sqlite import UnitRecords

directory, ready = Path(sys.argv[1]), Path(sys.argv[2])

class Batch(list):
    def __iter__(self):
        for i, r in enumerate(list.__iter__(self)):
            if i == 50:  # half the batch is in the open transaction: signal and wait for the kill
                ready.write_text("go")
                time.sleep(60)
            yield r

records = UnitRecords(directory, "fp")
vec = np.ones(4, dtype=np.float32) / 2
records.write(Batch(NewRecord(f"u{i}", "s", f"text {i}", (1, 2, i), {}, vec, None) for i in range(100)), [], [])
"""


@pytest.mark.integration
def test_a_crash_in_the_middle_of_an_ingest_batch_leaves_none_of_it(tmp_path: Path) -> None:
    """kill -9 while a batch's transaction is half written: after reopening, none of it is there."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _CRASHER, str(tmp_path / "data"), str(ready)], env=child_env())
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the writer never reached mid-batch"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    records = UnitRecords(tmp_path / "data", "fp")
    assert len(records) == 0 and records.scopes() == {}
    records.write([NewRecord("a", "s", "t", (1,), {}, np.full(4, 0.5, dtype=np.float32), None)], [], [])
    assert len(records) == 1  # the database is usable after the crash
    records.close()


def test_the_incarnation_counts_every_opening(tmp_path: Path) -> None:
    """Each start of a data directory gets a larger incarnation (epochs are derived from it)."""
    seen = []
    for _ in range(3):
        records = UnitRecords(tmp_path, ServingFingerprint("m", "t", "float16").digest.hex())
        seen.append(records.incarnation)
        records.close()
    assert seen == [1, 2, 3]
