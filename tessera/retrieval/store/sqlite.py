"""Durable unit records in SQLite: one database per data directory (the source of truth).

The tables and verbs are :mod:`~tessera.retrieval.store.sql`'s; here ``units.key`` is an
AUTOINCREMENT rowid (so a key is never reused after a delete), and ``scopes`` also holds the
version each scope's saved ANN index reflects (``saved``); the two differ after a crash, and the
index is then rebuilt from the embeddings here.

Integrity: the whole database passes ``PRAGMA integrity_check`` at every opening, or the
role refuses to start (:class:`StoreCorrupt`, naming the ways to recover); SQLite keeps no
checksums of its own, so this finds broken pages and indexes, not a flipped byte in a text.
The directory is 0700 and the database files 0600: they hold every tenant's text.

Durability: WAL journal with ``synchronous=FULL``. In WAL mode NORMAL may lose the last
transactions on power loss (the WAL is not fsynced at each commit), and the contract is
that a unit acknowledged by ``POST /v1/units`` survives; FULL fsyncs the WAL per commit,
which costs one fsync per ingest *batch*, not per unit. Each ingest or delete batch is one
transaction: all of it or none of it is on disk.

This module knows nothing about embeddings models, tokenizers or the control plane; it is
only called from the retrieval worker thread (one connection, one thread at a time).
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from tessera.errors import IntegrityError
from tessera.private_files import FILE_MODE, make_private, private_dir
from tessera.retrieval.store.records import NewRecord
from tessera.retrieval.store.sql import INSERT_UNIT, SqlUnitRecords, schema, unit_row

DB_NAME = "units.sqlite3"
MAX_PROBLEMS = 5  # integrity-check findings named in the error

_SCHEMA = schema(serial_key="INTEGER PRIMARY KEY AUTOINCREMENT", blob="BLOB", real="REAL") + """
CREATE TABLE IF NOT EXISTS scopes (scope TEXT PRIMARY KEY, version INTEGER NOT NULL, saved INTEGER NOT NULL);
"""


class StoreCorrupt(IntegrityError):
    """The database fails SQLite's integrity check (or is not a database); the message says how to recover."""


class UnitRecords(SqlUnitRecords):
    """The SQLite database of one data directory.

    The verbs of :class:`~tessera.retrieval.store.records.UnitRecordStore`.
    """

    _db: sqlite3.Connection

    _IN = "IN (SELECT value FROM json_each(?))"
    _BUMP = "INSERT INTO scopes VALUES (?, 1, -1) ON CONFLICT(scope) DO UPDATE SET version = version + 1"

    def __init__(self, directory: Path, fingerprint: str, *, label: str = "") -> None:
        self.directory = private_dir(directory)  # 0700: the units' text is every tenant's
        self.path = directory / DB_NAME
        self._name = str(self.path)
        self._elsewhere = "Point retrieval.data_dir at another directory"
        if not self.path.exists():  # created 0600; SQLite gives the -wal and -shm files the same mode
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
        for suffix in ("", "-wal", "-shm"):  # a store made before files were private
            make_private(self.path.with_name(DB_NAME + suffix))
        # one worker thread uses it, but not always the thread that opened it
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._check_integrity()
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
            self._db.close()
            raise StoreCorrupt(self._corrupt(str(exc))) from None
        except StoreCorrupt:
            self._db.close()
            raise
        self._open(fingerprint, label)

    def _check_integrity(self) -> None:
        """Every page and index of the database, before anything is served from it.

        ``integrity_check``, not ``quick_check``: it also checks that every index matches its
        table (a unique index out of step answers wrong lookups without an error), and the extra
        cost is small next to loading the tokenizer and embedder (see docs/durability.md).
        """
        problems = [str(row[0]) for row in self._db.execute(f"PRAGMA integrity_check({MAX_PROBLEMS})")]
        if problems != ["ok"]:
            raise StoreCorrupt(self._corrupt("; ".join(problems)))

    def _corrupt(self, problems: str) -> str:
        d = self.directory
        return (f"{self.path} is corrupt ({problems}); Tessera will not serve units from it. Stop Tessera, then "
                f"either restore {d} from a backup; or salvage what SQLite can still read: "
                f"`sqlite3 {self.path} .recover | sqlite3 {d}/recovered.sqlite3`, then move the old "
                f"{DB_NAME}, {DB_NAME}-wal and {DB_NAME}-shm away and rename recovered.sqlite3 to {DB_NAME} "
                f"(the index files are rebuilt from it); or move {d} away to start empty (every unit must then "
                "be ingested again)")

    # --- the dialect ---------------------------------------------------------------------

    def _list(self, values: list[Any]) -> str:
        return json.dumps(values)

    def _transaction(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN ourselves; the connection's context manager
        # commits on success and rolls back on an exception
        self._db.execute("BEGIN IMMEDIATE")
        return self._db

    def _lock_meta(self) -> None:
        """Nothing more to take: ``BEGIN IMMEDIATE`` already holds the database's one write lock."""

    def _insert(self, r: NewRecord, now: float) -> int:
        key = self._db.execute(INSERT_UNIT, unit_row(r)).lastrowid
        assert key is not None, r.unit_id
        return key

    def _delete(self, unit_ids: list[str], now: float) -> list[tuple[str, str]]:
        ids = self._list(unit_ids)
        rows = self._db.execute(f"SELECT unit_id, scope FROM units WHERE unit_id {self._IN}", (ids,)).fetchall()
        self._db.execute(f"DELETE FROM units WHERE unit_id {self._IN}", (ids,))
        return [(str(u), str(s)) for u, s in rows]

    # --- the saved index versions --------------------------------------------------------

    def mark_saved(self, scope: str, version: int) -> None:
        """The scope's index file on disk now reflects ``version``."""
        with self._transaction():
            self._db.execute("UPDATE scopes SET saved = ? WHERE scope = ?", (version, scope))

    def scopes(self) -> dict[str, tuple[int, int]]:
        """scope -> (version, saved version of its index file)."""
        return {s: (v, saved) for s, v, saved in self._db.execute("SELECT scope, version, saved FROM scopes")}
