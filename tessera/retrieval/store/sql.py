"""The SQL both unit stores share: the tables, every read, and the shape of every write.

:class:`SqlUnitRecords` implements :class:`~tessera.retrieval.store.records.UnitRecordStore`
once; a store subclasses it with what its database does differently:

* the parameter style (queries here are written with ``?``; :meth:`SqlUnitRecords._sql`
  rewrites them) and how one parameter carries a list (:attr:`SqlUnitRecords._IN`, ``_list``);
* how a transaction starts and ends (``_transaction``);
* how a unit row is inserted and deleted (``_insert``, ``_delete``): PostgreSQL appends to its
  change sequence there, and tolerates another replica's insert of the same unit;
* where the "index saved at version" bookkeeping lives (``mark_saved``, ``scopes``).

Tables (the column types are the dialect's, see :func:`schema`):

* ``units``: one row per live unit: its ANN key (``key``, never reused after a delete), id,
  scope, text, token ids (uint32 LE), metadata (JSON), embedding (float32 LE), the caller's
  optional ``external_id`` (unique per scope) and the unit's digest as KV block headers carry
  it (to recover a memory node's entries).
* ``revoked``: tombstones of deleted or replaced units. They make deletes idempotent (a unit
  deleted twice answers "already deleted", a never-seen id is unknown) and tell the control
  plane, after a restart, which unit ids must never be served from a cache.
* ``scopes``: per scope a ``version`` bumped in the same transaction as every change.
* ``meta``: the schema version, the serving fingerprint the token ids were made with, and the
  incarnation counter of the retrieval role (storage epochs derive from it so they never repeat).

This module opens no connection and knows no file: a subclass hands it ``_db``.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from tessera.retrieval.store.records import SCHEMA_VERSION, Existing, NewRecord, Record, StoreMismatch, Update
from tessera.units import unit_key_hex

_COLUMNS = "key, unit_id, scope, text, tokens, metadata, external_id"
INSERT_UNIT = ("INSERT INTO units (unit_id, scope, text, tokens, metadata, embedding, external_id, digest) "
               "VALUES (?, ?, ?, ?, ?, ?, ?, ?)")


def schema(*, serial_key: str, blob: str, real: str) -> str:
    """The tables both stores hold, in a dialect's column types (``scopes`` and extras are its own)."""
    return f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS units (
    key {serial_key},
    unit_id TEXT NOT NULL UNIQUE,
    scope TEXT NOT NULL,
    text TEXT NOT NULL,
    tokens {blob} NOT NULL,
    metadata TEXT NOT NULL,
    embedding {blob} NOT NULL,
    external_id TEXT,
    digest TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS units_scope ON units(scope);
CREATE INDEX IF NOT EXISTS units_digest ON units(digest);
CREATE UNIQUE INDEX IF NOT EXISTS units_external ON units(scope, external_id) WHERE external_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS revoked (unit_id TEXT PRIMARY KEY, scope TEXT NOT NULL, at {real} NOT NULL);
"""


def unit_row(r: NewRecord) -> tuple[Any, ...]:
    """The parameters of :data:`INSERT_UNIT` for one new unit."""
    return (r.unit_id, r.scope, r.text, np.asarray(r.token_ids, dtype="<u4").tobytes(), json.dumps(dict(r.metadata)),
            np.asarray(r.embedding, dtype="<f4").tobytes(), r.external_id, unit_key_hex(r.unit_id))


def _record(row: Sequence[Any]) -> Record:
    key, unit_id, scope, text, tokens, metadata, external_id = row
    return Record(int(key), unit_id, scope, text, tuple(np.frombuffer(bytes(tokens), dtype="<u4").tolist()),
                  json.loads(metadata), external_id)


def _keyed_vectors(rows: Sequence[Sequence[Any]], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys [N] uint64, vectors [N, dim] float32) of (key, embedding) rows."""
    keys = np.fromiter((k for k, _ in rows), dtype=np.uint64, count=len(rows))
    return keys, np.frombuffer(b"".join(bytes(e) for _, e in rows), dtype="<f4").reshape(len(rows), dim)


class SqlUnitRecords(ABC):
    """The verbs of :class:`~tessera.retrieval.store.records.UnitRecordStore` over one connection."""

    _IN: ClassVar[str]  # "<column> {_IN}" keeps the rows whose column is in the one list parameter
    _BUMP: ClassVar[str]  # bumps one scope's version (the row is created at version 1)

    directory: Path
    incarnation: int
    _db: Any  # the DB-API connection: sqlite3 and psycopg both answer execute() with a cursor
    _name: str  # the store, as errors name it
    _elsewhere: str  # a sentence: how to point this Tessera at another store, for errors

    # --- the dialect ---------------------------------------------------------------------

    def _sql(self, query: str) -> str:
        """``query`` in this database's parameter style (written with ``?``)."""
        return query

    @abstractmethod
    def _list(self, values: list[Any]) -> Any:
        """``values`` as the one parameter that :attr:`_IN` reads."""

    @abstractmethod
    def _transaction(self) -> AbstractContextManager[Any]:
        """A transaction that commits on success and rolls back on an exception."""

    @abstractmethod
    def _insert(self, r: NewRecord, now: float) -> int:
        """Insert one new unit (inside a write's transaction); its index key."""

    @abstractmethod
    def _delete(self, unit_ids: list[str], now: float) -> list[tuple[str, str]]:
        """Delete these live units (inside a transaction); (unit_id, scope) of those that were live."""

    @abstractmethod
    def _lock_meta(self) -> None:
        """Hold ``meta`` against other openings of the store until the transaction ends."""

    def _execute(self, query: str, params: Sequence[Any] = ()) -> Any:
        return self._db.execute(self._sql(query), params)

    def close(self) -> None:
        self._db.close()

    # --- start-up ------------------------------------------------------------------------

    def _meta(self, key: str) -> str | None:
        row = self._execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _open(self, fingerprint: str, label: str) -> None:
        """Refuse a store of another schema or fingerprint (or claim an empty one); count this opening."""
        with self._transaction():
            self._lock_meta()
            schema_version = self._meta("schema")
            if schema_version is not None and int(schema_version) != SCHEMA_VERSION:
                raise StoreMismatch(f"{self._name} has schema version {schema_version}, this Tessera reads "
                                    f"{SCHEMA_VERSION}. {self._elsewhere}")
            stored = self._meta("fingerprint")
            if stored is None:
                for k, v in (("schema", str(SCHEMA_VERSION)), ("fingerprint", fingerprint),
                             ("fingerprint_label", label)):
                    self._execute("INSERT INTO meta VALUES (?, ?)", (k, v))
            elif stored != fingerprint:
                raise StoreMismatch(
                    f"{self._name} holds units tokenized for another serving fingerprint "
                    f"({self._meta('fingerprint_label') or stored}), not for this one ({label or fingerprint}): their "
                    f"ids and token ids would be wrong. {self._elsewhere} (and ingest again), or serve the model the "
                    "store was written with")
        with self._transaction():
            self._execute("INSERT INTO meta VALUES ('incarnation', '1') ON CONFLICT (key) DO UPDATE "
                          "SET value = CAST(CAST(meta.value AS BIGINT) + 1 AS TEXT)")
            self.incarnation = int(self._meta("incarnation") or 0)

    # --- writes (one transaction each) ---------------------------------------------------

    def write(self, fresh: Sequence[NewRecord], updates: Sequence[Update], replaced: Sequence[str]) -> list[int]:
        """One ingest batch: revoke ``replaced``, update (unit_id, metadata, external_id), insert ``fresh``.

        Returns the index keys of ``fresh``, in order. All or nothing.
        """
        keys: list[int] = []
        with self._transaction():
            now = time.time()
            touched = set(self._revoke(replaced, now))
            for unit_id, metadata, external_id in updates:
                if external_id is not None:
                    self._release_external(unit_id, external_id)
                self._execute("UPDATE units SET metadata = ?, external_id = COALESCE(?, external_id) "
                              "WHERE unit_id = ?", (json.dumps(dict(metadata)), external_id, unit_id))
            for r in fresh:
                if r.external_id is not None:
                    self._release_external(r.unit_id, r.external_id, r.scope)
                keys.append(self._insert(r, now))
                touched.add(r.scope)
            self._execute(f"DELETE FROM revoked WHERE unit_id {self._IN}", (self._list([r.unit_id for r in fresh]),))
            self._bump(touched)
        return keys

    def _release_external(self, unit_id: str, external_id: str, scope: str | None = None) -> None:
        """Another live unit of the scope may not keep this external id (it was revoked already)."""
        if scope is None:
            row = self._execute("SELECT scope FROM units WHERE unit_id = ?", (unit_id,)).fetchone()
            assert row is not None, unit_id
            scope = str(row[0])
        self._execute("UPDATE units SET external_id = NULL WHERE scope = ? AND external_id = ? AND unit_id != ?",
                      (scope, external_id, unit_id))

    def revoke(self, unit_ids: Iterable[str]) -> None:
        """Delete these live units (tombstoned). All or nothing."""
        with self._transaction():
            self._bump(self._revoke(unit_ids, time.time()))

    def _revoke(self, unit_ids: Iterable[str], now: float) -> list[str]:
        """Delete and tombstone the live ones among ``unit_ids``; the scopes they were in."""
        ids = list(unit_ids)
        if not ids:
            return []
        rows = self._delete(ids, now)
        for u, s in rows:
            self._execute("INSERT INTO revoked VALUES (?, ?, ?) ON CONFLICT (unit_id) DO UPDATE "
                          "SET scope = EXCLUDED.scope, at = EXCLUDED.at", (u, s, now))
        return sorted({s for _, s in rows})

    def _bump(self, scopes: Iterable[str]) -> None:
        for s in sorted(scopes):  # sorted: two batches lock their scopes' rows in one order
            self._execute(self._BUMP, (s,))

    # --- reads ---------------------------------------------------------------------------

    def get(self, unit_id: str) -> Record | None:
        row = self._execute(f"SELECT {_COLUMNS} FROM units WHERE unit_id = ?", (unit_id,)).fetchone()
        return None if row is None else _record(row)

    def by_keys(self, keys: Sequence[int]) -> dict[int, Record]:
        rows = self._execute(f"SELECT {_COLUMNS} FROM units WHERE key {self._IN}",
                             (self._list([int(k) for k in keys]),)).fetchall()
        return {int(row[0]): _record(row) for row in rows}

    def existing(self, unit_ids: Iterable[str]) -> dict[str, Existing]:
        """The live ones among ``unit_ids``."""
        rows = self._execute(f"SELECT unit_id, key, scope, external_id, metadata FROM units WHERE unit_id {self._IN}",
                             (self._list(list(unit_ids)),)).fetchall()
        return {u: Existing(int(k), s, e, json.loads(m)) for u, k, s, e, m in rows}

    def by_external(self, scope: str, external_id: str) -> str | None:
        row = self._execute("SELECT unit_id FROM units WHERE scope = ? AND external_id = ?",
                            (scope, external_id)).fetchone()
        return None if row is None else str(row[0])

    def by_digest(self, digests: Iterable[str]) -> dict[str, tuple[str, int]]:
        """digest (hex) -> (unit_id, n_tokens) of the live units among ``digests``."""
        rows = self._execute(f"SELECT digest, unit_id, length(tokens) / 4 FROM units WHERE digest {self._IN}",
                             (self._list(list(digests)),)).fetchall()
        return {d: (u, int(n)) for d, u, n in rows}

    def revoked(self, unit_ids: Iterable[str] | None = None) -> set[str]:
        """The tombstoned ids (all of them, or those among ``unit_ids``)."""
        if unit_ids is None:
            return {u for (u,) in self._execute("SELECT unit_id FROM revoked").fetchall()}
        return {u for (u,) in self._execute(f"SELECT unit_id FROM revoked WHERE unit_id {self._IN}",
                                            (self._list(list(unit_ids)),)).fetchall()}

    def tombstones(self, unit_ids: Iterable[str]) -> dict[str, str]:
        """unit_id -> scope of the tombstoned ids among ``unit_ids``."""
        return dict(self._execute(f"SELECT unit_id, scope FROM revoked WHERE unit_id {self._IN}",
                                  (self._list(list(unit_ids)),)).fetchall())

    def select(self, scope: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        """(unit_id, metadata) of every live unit of a scope."""
        rows = self._execute("SELECT unit_id, metadata FROM units WHERE scope = ?", (scope,)).fetchall()
        for unit_id, metadata in rows:
            yield unit_id, json.loads(metadata)

    def scope_size(self, scope: str) -> int:
        row = self._execute("SELECT COUNT(*) FROM units WHERE scope = ?", (scope,)).fetchone()
        assert row is not None
        return int(row[0])

    def embeddings(self, scope: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys [N] uint64, vectors [N, dim] float32) of a scope, to rebuild its index."""
        return _keyed_vectors(self._execute("SELECT key, embedding FROM units WHERE scope = ? ORDER BY key",
                                            (scope,)).fetchall(), dim)

    def keys(self, scope: str) -> np.ndarray:
        """Index keys of a scope's live units, [N] uint64."""
        rows = self._execute("SELECT key FROM units WHERE scope = ?", (scope,)).fetchall()
        return np.fromiter((k for (k,) in rows), dtype=np.uint64, count=len(rows))

    def embeddings_of(self, keys: Sequence[int], dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys [N] uint64, vectors [N, dim] float32) of these units (missing ones skipped)."""
        return _keyed_vectors(self._execute(f"SELECT key, embedding FROM units WHERE key {self._IN}",
                                            (self._list([int(k) for k in keys]),)).fetchall(), dim)

    def unit_ids(self) -> list[str]:
        return [u for (u,) in self._execute("SELECT unit_id FROM units").fetchall()]

    def __len__(self) -> int:
        row = self._execute("SELECT COUNT(*) FROM units").fetchone()
        assert row is not None
        return int(row[0])
