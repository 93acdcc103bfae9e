"""The PostgreSQL unit store on a real server: the SQLite store's behaviour, shared by replicas.

Two UnitStores on one database stand for two retrieval replicas; each has its own data
directory (index files) and follows the other's writes through the change sequence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.store import DOCS, QUERIES, store_parts

from tessera.config import RetrievalConfig
from tessera.ha.servers import PostgresServer
from tessera.retrieval.embedder import Embedder
from tessera.retrieval.follow import IndexFollower
from tessera.retrieval.store.postgres import PgUnitRecords
from tessera.retrieval.store.unit_store import UnitStore
from tessera.units import UnitFactory


@pytest.fixture(scope="module")
def parts() -> tuple[UnitFactory, Embedder]:
    return store_parts()


def replica(parts: tuple[UnitFactory, Embedder], pg: PostgresServer, directory: Path) -> UnitStore:
    factory, embedder = parts
    return UnitStore(factory, embedder, RetrievalConfig(max_unit_tokens=64, data_dir=str(directory),
                                                         store="postgres", postgres_dsn=pg.dsn))


def follower(store: UnitStore) -> IndexFollower:
    assert isinstance(store.records, PgUnitRecords)
    return IndexFollower(store, store.records.last_change())


def ranking(store: UnitStore) -> list[list[str]]:
    return [[h.unit.unit_id for h in store.retrieve("kb", query=q, top_k=3)] for q in QUERIES]


def test_a_second_replica_serves_what_the_first_ingested(parts, postgres: PostgresServer, tmp_path: Path) -> None:
    """Units ingested through one replica are retrieved, with the same ranking, from another."""
    a = replica(parts, postgres, tmp_path / "a")
    b = replica(parts, postgres, tmp_path / "b")
    follow_b = follower(b)
    ids = [u.unit_id for u, _ in a.ingest(DOCS).units]
    assert follow_b.step() == len(DOCS)
    assert len(b) == len(DOCS) and ranking(b) == ranking(a)
    stored = b.get(ids[0])
    assert stored is not None and stored.metadata == {"topic": "reef"}
    a.close()
    b.close()


def test_a_delete_through_one_replica_leaves_every_replicas_index(parts, postgres: PostgresServer,
                                                                 tmp_path: Path) -> None:
    """A unit deleted through replica a is never retrieved from replica b, and is tombstoned for both."""
    a = replica(parts, postgres, tmp_path / "a")
    b = replica(parts, postgres, tmp_path / "b")
    follow_b = follower(b)
    ids = [u.unit_id for u, _ in a.ingest(DOCS).units]
    follow_b.step()
    done = a.delete([ids[0]])
    assert done.deleted == (ids[0],)
    assert follow_b.step() == 1
    assert all(ids[0] not in r for r in ranking(b))
    assert b.revoked() == {ids[0]}
    assert b.delete([ids[0]]).already == (ids[0],), "the tombstone is shared: the delete is idempotent on b"
    a.close()
    b.close()


def test_a_replica_with_no_index_files_rebuilds_from_the_database(parts, postgres: PostgresServer,
                                                                  tmp_path: Path) -> None:
    """A new replica (empty data directory) rebuilds its index from the stored embeddings."""
    a = replica(parts, postgres, tmp_path / "a")
    a.ingest(DOCS)
    expected = ranking(a)
    a.close()
    fresh = replica(parts, postgres, tmp_path / "fresh")
    assert fresh.rebuilt == ["kb"] and len(fresh) == len(DOCS)
    assert ranking(fresh) == expected
    fresh.close()


def test_an_older_leader_term_is_refused_once_a_newer_one_is_recorded(postgres: PostgresServer,
                                                                      tmp_path: Path) -> None:
    """record_term is monotonic: a deposed leader cannot write its older term back."""
    records = PgUnitRecords(postgres.dsn, tmp_path, "fp")
    assert records.record_term(7) and records.record_term(9)
    assert not records.record_term(8)
    assert records.term() == 9
    records.close()


def test_the_fingerprint_is_checked_against_the_shared_database(postgres: PostgresServer, tmp_path: Path) -> None:
    """A replica serving another model cannot open the database (its token ids would be wrong)."""
    from tessera.retrieval.store.records import StoreMismatch

    PgUnitRecords(postgres.dsn, tmp_path / "a", "fp-one").close()
    with pytest.raises(StoreMismatch, match="another serving fingerprint"):
        PgUnitRecords(postgres.dsn, tmp_path / "b", "fp-two")
