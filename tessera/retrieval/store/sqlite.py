"""Durable unit records: one SQLite database per data directory (the source of truth).

Tables:

* ``units``: one row per live unit: its usearch key (``key``, an AUTOINCREMENT rowid, so a
  key is never reused after a delete), id, scope, text, token ids (uint32 LE), metadata
  (JSON), embedding (float32 LE), the caller's optional ``external_id`` (unique per scope)
  and the unit's digest as KV block headers carry it (to recover a memory node's entries).
* ``revoked``: tombstones of deleted or replaced units. They make deletes idempotent (a
  unit deleted twice answers "already deleted", a never-seen id is unknown) and tell the
  control plane, after a restart, which unit ids must never be served from a cache.
* ``scopes``: per scope a ``version`` bumped in the same transaction as every change, and
  the version its saved ANN index reflects (``saved``); they differ after a crash, and the
  index is then rebuilt from the embeddings here.
* ``meta``: the serving fingerprint the token ids were made with, and the incarnation
  counter of the retrieval role (storage epochs are derived from it so they never repeat).

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
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import IntegrityError, TesseraError
from tessera.private_files import FILE_MODE, make_private, private_dir
from tessera.units import unit_key_hex

SCHEMA_VERSION = 1
DB_NAME = "units.sqlite3"
MAX_PROBLEMS = 5  # integrity-check findings named in the error

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS units (
    key INTEGER PRIMARY KEY AUTOINCREMENT,
    unit_id TEXT NOT NULL UNIQUE,
    scope TEXT NOT NULL,
    text TEXT NOT NULL,
    tokens BLOB NOT NULL,
    metadata TEXT NOT NULL,
    embedding BLOB NOT NULL,
    external_id TEXT,
    digest TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS units_scope ON units(scope);
CREATE INDEX IF NOT EXISTS units_digest ON units(digest);
CREATE UNIQUE INDEX IF NOT EXISTS units_external ON units(scope, external_id) WHERE external_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS revoked (unit_id TEXT PRIMARY KEY, scope TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS scopes (scope TEXT PRIMARY KEY, version INTEGER NOT NULL, saved INTEGER NOT NULL);
"""


class StoreMismatch(TesseraError):
    """The data directory was written for another model, tokenizer or schema."""


class StoreCorrupt(IntegrityError):
    """The database fails SQLite's integrity check (or is not a database); the message says how to recover."""


@dataclass(frozen=True, slots=True)
class Record:
    key: int  # the unit's key in its scope's ANN index
    unit_id: str
    scope: str
    text: str
    token_ids: tuple[int, ...]
    metadata: Mapping[str, Any]
    external_id: str | None


@dataclass(frozen=True, slots=True)
class NewRecord:
    unit_id: str
    scope: str
    text: str
    token_ids: tuple[int, ...]
    metadata: Mapping[str, Any]
    embedding: np.ndarray  # [dim] float32, unit norm
    external_id: str | None


@dataclass(frozen=True, slots=True)
class Existing:
    key: int
    scope: str
    external_id: str | None
    metadata: Mapping[str, Any]


_COLUMNS = "key, unit_id, scope, text, tokens, metadata, external_id"


def _record(row: tuple[Any, ...]) -> Record:
    key, unit_id, scope, text, tokens, metadata, external_id = row
    return Record(key, unit_id, scope, text, tuple(np.frombuffer(tokens, dtype="<u4").tolist()),
                  json.loads(metadata), external_id)


class UnitRecords:
    """The SQLite database of one data directory. Verbs: ``write``, ``revoke``, ``get``/``select``."""

    def __init__(self, directory: Path, fingerprint: str, *, label: str = "") -> None:
        self.directory = private_dir(directory)  # 0700: the units' text is every tenant's
        self.path = directory / DB_NAME
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
        self._check_fingerprint(fingerprint, label)
        self.incarnation = self._next_incarnation()

    def close(self) -> None:
        self._db.close()

    # --- start-up ------------------------------------------------------------------------

    def _check_integrity(self) -> None:
        """Every page and index of the database, before anything is served from it.

        ``integrity_check``, not ``quick_check``: it also checks that every index matches its
        table (a unique index out of step answers wrong lookups without an error), and on a
        100k-unit store (497 MiB) it took 0.34 s against quick_check's 0.13-0.22 s (README).
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

    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _check_fingerprint(self, fingerprint: str, label: str) -> None:
        with self._transaction():
            schema = self._meta("schema")
            if schema is not None and int(schema) != SCHEMA_VERSION:
                raise StoreMismatch(f"{self.path} has schema version {schema}, this Tessera reads {SCHEMA_VERSION}; "
                                    "point retrieval.data_dir at a new directory")
            stored = self._meta("fingerprint")
            if stored is None:
                self._db.executemany("INSERT INTO meta VALUES (?, ?)", [
                    ("schema", str(SCHEMA_VERSION)), ("fingerprint", fingerprint), ("fingerprint_label", label)])
            elif stored != fingerprint:
                raise StoreMismatch(
                    f"{self.path} holds units tokenized for another serving fingerprint "
                    f"({self._meta('fingerprint_label') or stored}), not for this one ({label or fingerprint}): their "
                    "ids and token ids would be wrong. Set retrieval.data_dir to another directory (and ingest "
                    "again), or serve the model the store was written with")

    def _next_incarnation(self) -> int:
        with self._transaction():
            n = int(self._meta("incarnation") or 0) + 1
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('incarnation', ?)", (str(n),))
        return n

    # --- writes (one transaction each) ---------------------------------------------------

    def _transaction(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN ourselves; the connection's context manager
        # commits on success and rolls back on an exception
        self._db.execute("BEGIN IMMEDIATE")
        return self._db

    def write(self, fresh: Sequence[NewRecord], updates: Sequence[tuple[str, Mapping[str, Any], str | None]],
              replaced: Sequence[str]) -> list[int]:
        """One ingest batch: revoke ``replaced``, update (unit_id, metadata, external_id), insert ``fresh``.

        Returns the index keys of ``fresh``, in order. All or nothing.
        """
        keys: list[int] = []
        db = self._transaction()
        with db:
            touched = set(self._revoke(replaced))
            for unit_id, metadata, external_id in updates:
                if external_id is not None:
                    self._release_external(unit_id, external_id)
                db.execute("UPDATE units SET metadata = ?, external_id = COALESCE(?, external_id) WHERE unit_id = ?",
                           (json.dumps(dict(metadata)), external_id, unit_id))
            for r in fresh:
                if r.external_id is not None:
                    self._release_external(r.unit_id, r.external_id, r.scope)
                cur = db.execute(
                    "INSERT INTO units (unit_id, scope, text, tokens, metadata, embedding, external_id, digest) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (r.unit_id, r.scope, r.text, np.asarray(r.token_ids, dtype="<u4").tobytes(),
                     json.dumps(dict(r.metadata)), np.asarray(r.embedding, dtype="<f4").tobytes(), r.external_id,
                     unit_key_hex(r.unit_id)))
                assert cur.lastrowid is not None
                keys.append(cur.lastrowid)
                touched.add(r.scope)
            db.execute("DELETE FROM revoked WHERE unit_id IN (SELECT value FROM json_each(?))",
                       (json.dumps([r.unit_id for r in fresh]),))
            self._bump(touched)
        return keys

    def _release_external(self, unit_id: str, external_id: str, scope: str | None = None) -> None:
        """Another live unit of the scope may not keep this external id (it was revoked already)."""
        if scope is None:
            row = self._db.execute("SELECT scope FROM units WHERE unit_id = ?", (unit_id,)).fetchone()
            scope = row[0]
        self._db.execute("UPDATE units SET external_id = NULL WHERE scope = ? AND external_id = ? AND unit_id != ?",
                         (scope, external_id, unit_id))

    def revoke(self, unit_ids: Iterable[str]) -> None:
        """Delete these live units (tombstoned). All or nothing."""
        with self._transaction():
            self._bump(self._revoke(unit_ids))

    def _revoke(self, unit_ids: Iterable[str]) -> list[str]:
        ids = json.dumps(list(unit_ids))
        now = time.time()
        rows = self._db.execute("SELECT unit_id, scope FROM units WHERE unit_id IN (SELECT value FROM json_each(?))",
                                (ids,)).fetchall()
        self._db.executemany("INSERT OR REPLACE INTO revoked VALUES (?, ?, ?)", [(u, s, now) for u, s in rows])
        self._db.execute("DELETE FROM units WHERE unit_id IN (SELECT value FROM json_each(?))", (ids,))
        return sorted({s for _, s in rows})

    def _bump(self, scopes: Iterable[str]) -> None:
        self._db.executemany("INSERT INTO scopes VALUES (?, 1, -1) "
                             "ON CONFLICT(scope) DO UPDATE SET version = version + 1", [(s,) for s in scopes])

    def mark_saved(self, scope: str, version: int) -> None:
        """The scope's index file on disk now reflects ``version``."""
        with self._transaction():
            self._db.execute("UPDATE scopes SET saved = ? WHERE scope = ?", (version, scope))

    # --- reads ---------------------------------------------------------------------------

    def get(self, unit_id: str) -> Record | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM units WHERE unit_id = ?", (unit_id,)).fetchone()
        return None if row is None else _record(row)

    def by_keys(self, keys: Sequence[int]) -> dict[int, Record]:
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM units WHERE key IN (SELECT value FROM json_each(?))",
                                (json.dumps(list(keys)),)).fetchall()
        return {row[0]: _record(row) for row in rows}

    def existing(self, unit_ids: Iterable[str]) -> dict[str, Existing]:
        """The live ones among ``unit_ids``."""
        rows = self._db.execute("SELECT unit_id, key, scope, external_id, metadata FROM units "
                                "WHERE unit_id IN (SELECT value FROM json_each(?))", (json.dumps(list(unit_ids)),))
        return {u: Existing(k, s, e, json.loads(m)) for u, k, s, e, m in rows}

    def by_external(self, scope: str, external_id: str) -> str | None:
        row = self._db.execute("SELECT unit_id FROM units WHERE scope = ? AND external_id = ?",
                               (scope, external_id)).fetchone()
        return None if row is None else str(row[0])

    def by_digest(self, digests: Iterable[str]) -> dict[str, tuple[str, int]]:
        """digest (hex) -> (unit_id, n_tokens) of the live units among ``digests``."""
        rows = self._db.execute("SELECT digest, unit_id, length(tokens) / 4 FROM units "
                                "WHERE digest IN (SELECT value FROM json_each(?))", (json.dumps(list(digests)),))
        return {d: (u, int(n)) for d, u, n in rows}

    def revoked(self, unit_ids: Iterable[str] | None = None) -> set[str]:
        """The tombstoned ids (all of them, or those among ``unit_ids``)."""
        if unit_ids is None:
            return {u for (u,) in self._db.execute("SELECT unit_id FROM revoked")}
        return {u for (u,) in self._db.execute("SELECT unit_id FROM revoked WHERE unit_id IN "
                                               "(SELECT value FROM json_each(?))", (json.dumps(list(unit_ids)),))}

    def tombstones(self, unit_ids: Iterable[str]) -> dict[str, str]:
        """unit_id -> scope of the tombstoned ids among ``unit_ids``."""
        return dict(self._db.execute("SELECT unit_id, scope FROM revoked WHERE unit_id IN "
                                     "(SELECT value FROM json_each(?))", (json.dumps(list(unit_ids)),)))

    def select(self, scope: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        """(unit_id, metadata) of every live unit of a scope."""
        for unit_id, metadata in self._db.execute("SELECT unit_id, metadata FROM units WHERE scope = ?", (scope,)):
            yield unit_id, json.loads(metadata)

    def scopes(self) -> dict[str, tuple[int, int]]:
        """scope -> (version, saved version of its index file)."""
        return {s: (v, saved) for s, v, saved in self._db.execute("SELECT scope, version, saved FROM scopes")}

    def scope_size(self, scope: str) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM units WHERE scope = ?", (scope,)).fetchone()[0])

    def embeddings(self, scope: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys [N] uint64, vectors [N, dim] float32) of a scope, to rebuild its index."""
        rows = self._db.execute("SELECT key, embedding FROM units WHERE scope = ? ORDER BY key", (scope,)).fetchall()
        keys = np.fromiter((k for k, _ in rows), dtype=np.uint64, count=len(rows))
        vectors = np.frombuffer(b"".join(e for _, e in rows), dtype="<f4").reshape(len(rows), dim)
        return keys, vectors

    def keys(self, scope: str) -> np.ndarray:
        """Index keys of a scope's live units, [N] uint64."""
        rows = self._db.execute("SELECT key FROM units WHERE scope = ?", (scope,)).fetchall()
        return np.fromiter((k for (k,) in rows), dtype=np.uint64, count=len(rows))

    def embeddings_of(self, keys: Sequence[int], dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys [N] uint64, vectors [N, dim] float32) of these units (missing ones skipped)."""
        rows = self._db.execute("SELECT key, embedding FROM units WHERE key IN (SELECT value FROM json_each(?))",
                                (json.dumps([int(k) for k in keys]),)).fetchall()
        found = np.fromiter((k for k, _ in rows), dtype=np.uint64, count=len(rows))
        return found, np.frombuffer(b"".join(e for _, e in rows), dtype="<f4").reshape(len(rows), dim)

    def unit_ids(self) -> list[str]:
        return [u for (u,) in self._db.execute("SELECT unit_id FROM units")]

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM units").fetchone()[0])
