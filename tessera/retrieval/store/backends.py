"""Which unit-record store a retrieval process opens: embedded SQLite (default) or PostgreSQL.

Both implement :class:`~tessera.retrieval.store.records.UnitRecordStore`; only the PostgreSQL
one has a change sequence that other replicas follow (:mod:`tessera.retrieval.follow`).
"""

from __future__ import annotations

from pathlib import Path

from tessera.config import RetrievalConfig
from tessera.retrieval.store.postgres import PgUnitRecords, dsn_with_secret
from tessera.retrieval.store.records import UnitRecordStore
from tessera.retrieval.store.sqlite import UnitRecords


def open_records(config: RetrievalConfig, directory: Path, fingerprint: str, label: str) -> UnitRecordStore:
    """The records of ``retrieval.store``; ``directory`` holds the SQLite file or the replica's index state."""
    if config.store == "postgres":
        return PgUnitRecords(dsn_with_secret(config), directory, fingerprint, label=label)
    return UnitRecords(directory, fingerprint, label=label)
