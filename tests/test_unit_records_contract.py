"""Both unit-record stores keep the one contract: the same verbs give the same answers.

The same batch of writes, updates, replacements and deletes goes to the embedded SQLite store
and to the PostgreSQL store (a real server; skipped where none is installed), and every read
verb of :class:`~tessera.retrieval.store.records.UnitRecordStore` must answer alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tessera.ha.servers import PostgresServer
from tessera.retrieval.store.postgres import PgUnitRecords
from tessera.retrieval.store.records import NewRecord, StoreMismatch, UnitRecordStore
from tessera.retrieval.store.sqlite import UnitRecords
from tessera.units import unit_key_hex

DIM = 4


def record(unit_id: str, scope: str, external_id: str | None = None) -> NewRecord:
    vector = np.arange(DIM, dtype=np.float32) + len(unit_id)
    return NewRecord(unit_id, scope, f"text of {unit_id}", (1, 2, len(unit_id)), {"id": unit_id},
                     vector / np.linalg.norm(vector), external_id)


def answers(records: UnitRecordStore) -> dict[str, Any]:
    """Write one history through ``records``; what every read verb says afterwards."""
    first = records.write([record("a1", "a", "doc"), record("a2", "a"), record("b1", "b")], [], [])
    records.write([], [("a2", {"id": "a2", "edited": True}, "other")], [])
    # a new version of "doc" replaces a1 in the same batch
    replaced = records.write([record("a3", "a", "doc")], [], ["a1"])
    records.revoke(["b1", "never-seen"])
    records.mark_saved("a", 2)
    keys = [*first, *replaced]
    return {
        "keys": keys,
        "get": [records.get(u) for u in ("a1", "a2", "a3", "b1")],
        "by_keys": records.by_keys(keys),
        "existing": records.existing(["a1", "a2", "a3", "b1"]),
        "by_external": [records.by_external("a", "doc"), records.by_external("a", "other"),
                        records.by_external("b", "doc")],
        "by_digest": records.by_digest([unit_key_hex(u) for u in ("a1", "a2", "a3")]),
        "revoked": (records.revoked(), records.revoked(["a1", "a2"])),
        "tombstones": records.tombstones(["a1", "b1", "a2"]),
        "select": sorted(records.select("a")),
        "scopes": records.scopes(),
        "sizes": [records.scope_size(s) for s in ("a", "b")],
        "embeddings": [a.tolist() for a in records.embeddings("a", DIM)],
        "keys_of_a": sorted(records.keys("a").tolist()),
        "embeddings_of": [a.tolist() for a in records.embeddings_of(keys, DIM)],
        "unit_ids": sorted(records.unit_ids()),
        "len": len(records),
    }


def test_the_sqlite_store_answers_what_the_contract_says(tmp_path: Path) -> None:
    """Replacement, update, revocation and the saved index version, read back through every verb."""
    records = UnitRecords(tmp_path / "data", "fp")
    got = answers(records)
    a2, a3 = got["get"][1], got["get"][2]
    assert got["get"][0] is None and got["get"][3] is None  # replaced and revoked
    assert a2 is not None and a2.metadata == {"id": "a2", "edited": True} and a2.external_id == "other"
    assert a3 is not None and a3.external_id == "doc" and a3.token_ids == (1, 2, 2)
    assert got["by_external"] == ["a3", "a2", None]
    assert got["revoked"] == ({"a1", "b1"}, {"a1"}) and got["tombstones"] == {"a1": "a", "b1": "b"}
    assert got["scopes"] == {"a": (2, 2), "b": (2, -1)}  # a metadata update leaves the index as it is
    assert got["sizes"] == [2, 0] and got["len"] == 2
    assert set(got["by_keys"]) == set(got["keys_of_a"]) == {got["keys"][1], got["keys"][3]}
    assert got["by_digest"] == {unit_key_hex("a2"): ("a2", 3), unit_key_hex("a3"): ("a3", 3)}
    records.close()


def test_both_stores_answer_every_verb_alike(tmp_path: Path, postgres: PostgresServer) -> None:
    """The same history through SQLite and PostgreSQL: every read verb gives the same answer."""
    sqlite = UnitRecords(tmp_path / "sqlite", "fp")
    pg = PgUnitRecords(postgres.dsn, tmp_path / "pg", "fp")
    assert answers(sqlite) == answers(pg)
    assert sqlite.incarnation == pg.incarnation == 1
    sqlite.close()
    pg.close()


def test_both_stores_count_openings_and_refuse_another_fingerprint(tmp_path: Path, postgres: PostgresServer) -> None:
    """Each opening bumps the incarnation; a store of another serving fingerprint is refused."""
    def sqlite(fp: str) -> UnitRecordStore:
        return UnitRecords(tmp_path / "sqlite", fp, label=f"model {fp}")

    def pg(fp: str) -> UnitRecordStore:
        return PgUnitRecords(postgres.dsn, tmp_path / "pg", fp, label=f"model {fp}")

    for open_store in (sqlite, pg):
        incarnations = []
        for _ in range(3):
            store = open_store("fp")
            incarnations.append(store.incarnation)
            store.close()
        assert incarnations == [1, 2, 3]
        with pytest.raises(StoreMismatch, match=r"model fp.*model other"):
            open_store("other")
