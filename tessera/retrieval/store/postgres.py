"""Durable unit records in PostgreSQL: one database that every retrieval replica reads.

The same verbs and tables as :class:`tessera.retrieval.records.UnitRecords` (the embedded
SQLite store), so :class:`~tessera.retrieval.store.UnitStore` runs on either, plus:

* ``changes``: the change sequence. Every inserted or revoked unit appends ``(seq, scope,
  key, added)`` in the transaction that changed it; ``seq`` is a ``BIGSERIAL``, so a replica
  that applied every change up to ``seq`` brings its ANN index (a cache) up to date with
  :meth:`changes_since` (see :mod:`tessera.retrieval.follow`). Two transactions may commit in
  the other order than their ``seq``s; a reader therefore never moves its cursor past a
  ``seq`` gap that is younger than :data:`GAP_GRACE_S` (the gap's writer may still commit).
* ``meta.term``: the highest leader term that ever took office (:meth:`record_term`); a
  deposed leader's "I lead" is refused here too.
* the "index saved at version" bookkeeping is per replica (each replica has its own index
  files), so it stays in a small JSON file in the replica's data directory.

Only called from the retrieval worker thread, one connection per process.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.config import RetrievalConfig
from tessera.errors import ConfigError
from tessera.retrieval.records import SCHEMA_VERSION, Existing, NewRecord, Record, StoreMismatch
from tessera.units import unit_key_hex

GAP_GRACE_S = 5.0  # a seq gap older than this is a rolled-back transaction, not one still committing
PASSWORD_ENV = "TESSERA_PG_PASSWORD"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS units (
    key BIGSERIAL PRIMARY KEY,
    unit_id TEXT NOT NULL UNIQUE,
    scope TEXT NOT NULL,
    text TEXT NOT NULL,
    tokens BYTEA NOT NULL,
    metadata TEXT NOT NULL,
    embedding BYTEA NOT NULL,
    external_id TEXT,
    digest TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS units_scope ON units(scope);
CREATE INDEX IF NOT EXISTS units_digest ON units(digest);
CREATE UNIQUE INDEX IF NOT EXISTS units_external ON units(scope, external_id) WHERE external_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS revoked (unit_id TEXT PRIMARY KEY, scope TEXT NOT NULL, at DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS scopes (scope TEXT PRIMARY KEY, version BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS changes (
    seq BIGSERIAL PRIMARY KEY,
    scope TEXT NOT NULL,
    key BIGINT NOT NULL,
    added BOOLEAN NOT NULL,
    at DOUBLE PRECISION NOT NULL
);
"""
_COLUMNS = "key, unit_id, scope, text, tokens, metadata, external_id"
SAVED_FILE = "pg-index-saved.json"


def dsn_with_secret(config: RetrievalConfig) -> str:
    """The configured DSN plus the password from ``postgres_password_file`` or $TESSERA_PG_PASSWORD."""
    password = os.environ.get(PASSWORD_ENV, "")
    if config.postgres_password_file:
        path = Path(config.postgres_password_file).expanduser()
        try:
            password = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"retrieval.postgres_password_file = {str(path)!r} cannot be read ({exc})") from None
    if not password:
        return config.postgres_dsn
    from psycopg.conninfo import make_conninfo

    return make_conninfo(config.postgres_dsn, password=password)


def _record(row: tuple[Any, ...]) -> Record:
    key, unit_id, scope, text, tokens, metadata, external_id = row
    return Record(key, unit_id, scope, text, tuple(np.frombuffer(bytes(tokens), dtype="<u4").tolist()),
                  json.loads(metadata), external_id)


class PgUnitRecords:
    """The PostgreSQL database of a replicated retrieval role; verbs as :class:`UnitRecords`."""

    def __init__(self, dsn: str, directory: Path, fingerprint: str, *, label: str = "") -> None:
        import psycopg

        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._saved_path = directory / SAVED_FILE
        self._db = psycopg.connect(dsn, autocommit=True)
        try:
            with self._db.transaction():
                # one schema creator at a time: replicas starting together would race on CREATE
                self._db.execute("SELECT pg_advisory_xact_lock(7213)")
                self._db.execute(_SCHEMA)
            self._check_fingerprint(fingerprint, label)
            self.incarnation = self._next_incarnation()
        except BaseException:
            self._db.close()
            raise

    def close(self) -> None:
        self._db.close()

    # --- start-up ------------------------------------------------------------------------

    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = %s", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _check_fingerprint(self, fingerprint: str, label: str) -> None:
        with self._db.transaction():
            self._db.execute("LOCK TABLE meta IN EXCLUSIVE MODE")
            schema = self._meta("schema")
            if schema is not None and int(schema) != SCHEMA_VERSION:
                raise StoreMismatch(f"the PostgreSQL store has schema version {schema}, this Tessera reads "
                                    f"{SCHEMA_VERSION}; point retrieval.postgres_dsn at a new database")
            stored = self._meta("fingerprint")
            if stored is None:
                for k, v in (("schema", str(SCHEMA_VERSION)), ("fingerprint", fingerprint),
                             ("fingerprint_label", label)):
                    self._db.execute("INSERT INTO meta VALUES (%s, %s)", (k, v))
            elif stored != fingerprint:
                raise StoreMismatch(
                    f"the PostgreSQL store holds units tokenized for another serving fingerprint "
                    f"({self._meta('fingerprint_label') or stored}), not for this one ({label or fingerprint}); "
                    "point retrieval.postgres_dsn at another database, or serve the model it was written with")

    def _next_incarnation(self) -> int:
        row = self._db.execute(
            "INSERT INTO meta VALUES ('incarnation', '1') ON CONFLICT (key) DO UPDATE "
            "SET value = (meta.value::bigint + 1)::text RETURNING value").fetchone()
        assert row is not None
        return int(row[0])

    def record_term(self, term: int) -> bool:
        """Store ``term`` as the newest leader term; False if a newer one was recorded already."""
        row = self._db.execute(
            "INSERT INTO meta VALUES ('term', %s) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value "
            "WHERE meta.value::bigint <= EXCLUDED.value::bigint RETURNING value", (str(term),)).fetchone()
        return row is not None

    def term(self) -> int:
        return int(self._meta("term") or 0)

    # --- writes (one transaction each) ---------------------------------------------------

    def write(self, fresh: Sequence[NewRecord], updates: Sequence[tuple[str, Mapping[str, Any], str | None]],
              replaced: Sequence[str]) -> list[int]:
        """One ingest batch: revoke ``replaced``, update (unit_id, metadata, external_id), insert ``fresh``.

        Returns the index keys of ``fresh``, in order (a unit another replica inserted meanwhile
        keeps that replica's key). All or nothing.
        """
        keys: list[int] = []
        db = self._db
        with db.transaction():
            touched = set(self._revoke(replaced))
            for unit_id, metadata, external_id in updates:
                if external_id is not None:
                    self._release_external(unit_id, external_id)
                db.execute("UPDATE units SET metadata = %s, external_id = COALESCE(%s, external_id) "
                           "WHERE unit_id = %s", (json.dumps(dict(metadata)), external_id, unit_id))
            now = time.time()
            for r in fresh:
                if r.external_id is not None:
                    self._release_external(r.unit_id, r.external_id, r.scope)
                row = db.execute(
                    "INSERT INTO units (unit_id, scope, text, tokens, metadata, embedding, external_id, digest) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (unit_id) DO NOTHING RETURNING key",
                    (r.unit_id, r.scope, r.text, np.asarray(r.token_ids, dtype="<u4").tobytes(),
                     json.dumps(dict(r.metadata)), np.asarray(r.embedding, dtype="<f4").tobytes(), r.external_id,
                     unit_key_hex(r.unit_id))).fetchone()
                if row is None:  # inserted by another replica since we looked
                    row = db.execute("SELECT key FROM units WHERE unit_id = %s", (r.unit_id,)).fetchone()
                    assert row is not None, r.unit_id
                else:
                    db.execute("INSERT INTO changes (scope, key, added, at) VALUES (%s, %s, true, %s)",
                               (r.scope, row[0], now))
                keys.append(int(row[0]))
                touched.add(r.scope)
            db.execute("DELETE FROM revoked WHERE unit_id = ANY(%s)", ([r.unit_id for r in fresh],))
            self._bump(touched)
        return keys

    def _release_external(self, unit_id: str, external_id: str, scope: str | None = None) -> None:
        if scope is None:
            row = self._db.execute("SELECT scope FROM units WHERE unit_id = %s", (unit_id,)).fetchone()
            assert row is not None, unit_id
            scope = str(row[0])
        self._db.execute("UPDATE units SET external_id = NULL WHERE scope = %s AND external_id = %s "
                         "AND unit_id != %s", (scope, external_id, unit_id))

    def revoke(self, unit_ids: Iterable[str]) -> None:
        """Delete these live units (tombstoned). All or nothing."""
        with self._db.transaction():
            self._bump(self._revoke(unit_ids))

    def _revoke(self, unit_ids: Iterable[str]) -> list[str]:
        ids = list(unit_ids)
        if not ids:
            return []
        now = time.time()
        rows = self._db.execute("DELETE FROM units WHERE unit_id = ANY(%s) RETURNING unit_id, scope, key",
                                (ids,)).fetchall()
        for u, s, k in rows:
            self._db.execute("INSERT INTO revoked VALUES (%s, %s, %s) ON CONFLICT (unit_id) DO UPDATE "
                             "SET at = EXCLUDED.at", (u, s, now))
            self._db.execute("INSERT INTO changes (scope, key, added, at) VALUES (%s, %s, false, %s)", (s, k, now))
        return sorted({s for _, s, _ in rows})

    def _bump(self, scopes: Iterable[str]) -> None:
        for s in sorted(scopes):  # sorted: two batches lock their scopes' rows in one order
            self._db.execute("INSERT INTO scopes VALUES (%s, 1) ON CONFLICT (scope) DO UPDATE "
                             "SET version = scopes.version + 1", (s,))

    def mark_saved(self, scope: str, version: int) -> None:
        """This replica's index file of ``scope`` now reflects ``version``."""
        saved = self._saved()
        saved[scope] = version
        tmp = self._saved_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(saved))
        tmp.replace(self._saved_path)

    def _saved(self) -> dict[str, int]:
        try:
            return {str(k): int(v) for k, v in json.loads(self._saved_path.read_text()).items()}
        except (OSError, ValueError):
            return {}

    # --- the change sequence -------------------------------------------------------------

    def changes_since(self, seq: int, limit: int = 10_000) -> list[tuple[int, str, int, bool, float]]:
        """(seq, scope, key, added, at) of the changes after ``seq``, in seq order."""
        rows = self._db.execute("SELECT seq, scope, key, added, at FROM changes WHERE seq > %s ORDER BY seq "
                                "LIMIT %s", (seq, limit)).fetchall()
        return [(int(q), str(s), int(k), bool(a), float(t)) for q, s, k, a, t in rows]

    def last_change(self) -> int:
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()
        assert row is not None
        return int(row[0])

    # --- reads ---------------------------------------------------------------------------

    def get(self, unit_id: str) -> Record | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM units WHERE unit_id = %s", (unit_id,)).fetchone()
        return None if row is None else _record(row)

    def by_keys(self, keys: Sequence[int]) -> dict[int, Record]:
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM units WHERE key = ANY(%s)",
                                ([int(k) for k in keys],)).fetchall()
        return {int(row[0]): _record(row) for row in rows}

    def existing(self, unit_ids: Iterable[str]) -> dict[str, Existing]:
        rows = self._db.execute("SELECT unit_id, key, scope, external_id, metadata FROM units "
                                "WHERE unit_id = ANY(%s)", (list(unit_ids),)).fetchall()
        return {u: Existing(int(k), s, e, json.loads(m)) for u, k, s, e, m in rows}

    def by_external(self, scope: str, external_id: str) -> str | None:
        row = self._db.execute("SELECT unit_id FROM units WHERE scope = %s AND external_id = %s",
                               (scope, external_id)).fetchone()
        return None if row is None else str(row[0])

    def by_digest(self, digests: Iterable[str]) -> dict[str, tuple[str, int]]:
        rows = self._db.execute("SELECT digest, unit_id, length(tokens) / 4 FROM units WHERE digest = ANY(%s)",
                                (list(digests),)).fetchall()
        return {d: (u, int(n)) for d, u, n in rows}

    def revoked(self, unit_ids: Iterable[str] | None = None) -> set[str]:
        if unit_ids is None:
            return {u for (u,) in self._db.execute("SELECT unit_id FROM revoked").fetchall()}
        return {u for (u,) in self._db.execute("SELECT unit_id FROM revoked WHERE unit_id = ANY(%s)",
                                               (list(unit_ids),)).fetchall()}

    def tombstones(self, unit_ids: Iterable[str]) -> dict[str, str]:
        """unit_id -> scope of the tombstoned ids among ``unit_ids``."""
        return dict(self._db.execute("SELECT unit_id, scope FROM revoked WHERE unit_id = ANY(%s)",
                                     (list(unit_ids),)).fetchall())

    def select(self, scope: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        rows = self._db.execute("SELECT unit_id, metadata FROM units WHERE scope = %s", (scope,)).fetchall()
        for unit_id, metadata in rows:
            yield unit_id, json.loads(metadata)

    def scopes(self) -> dict[str, tuple[int, int]]:
        """scope -> (version, the version this replica's saved index file reflects, -1 if none)."""
        saved = self._saved()
        return {s: (int(v), saved.get(s, -1)) for s, v in self._db.execute("SELECT scope, version FROM scopes")}

    def scope_size(self, scope: str) -> int:
        row = self._db.execute("SELECT COUNT(*) FROM units WHERE scope = %s", (scope,)).fetchone()
        assert row is not None
        return int(row[0])

    def embeddings(self, scope: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self._db.execute("SELECT key, embedding FROM units WHERE scope = %s ORDER BY key",
                                (scope,)).fetchall()
        keys = np.fromiter((k for k, _ in rows), dtype=np.uint64, count=len(rows))
        vectors = np.frombuffer(b"".join(bytes(e) for _, e in rows), dtype="<f4").reshape(len(rows), dim)
        return keys, vectors

    def keys(self, scope: str) -> np.ndarray:
        rows = self._db.execute("SELECT key FROM units WHERE scope = %s", (scope,)).fetchall()
        return np.fromiter((k for (k,) in rows), dtype=np.uint64, count=len(rows))

    def embeddings_of(self, keys: Sequence[int], dim: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self._db.execute("SELECT key, embedding FROM units WHERE key = ANY(%s)",
                                ([int(k) for k in keys],)).fetchall()
        found = np.fromiter((k for k, _ in rows), dtype=np.uint64, count=len(rows))
        return found, np.frombuffer(b"".join(bytes(e) for _, e in rows), dtype="<f4").reshape(len(rows), dim)

    def unit_ids(self) -> list[str]:
        return [u for (u,) in self._db.execute("SELECT unit_id FROM units").fetchall()]

    def __len__(self) -> int:
        row = self._db.execute("SELECT COUNT(*) FROM units").fetchone()
        assert row is not None
        return int(row[0])
