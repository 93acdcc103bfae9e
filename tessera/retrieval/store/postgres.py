"""Durable unit records in PostgreSQL: one database that every retrieval replica reads.

The same verbs and tables as the embedded SQLite store (both are
:class:`~tessera.retrieval.store.sql.SqlUnitRecords`), so
:class:`~tessera.retrieval.store.unit_store.UnitStore` runs on either, plus:

* ``changes``: the change sequence. Every inserted or revoked unit appends ``(seq, scope,
  key, added)`` in the transaction that changed it; ``seq`` is a ``BIGSERIAL``, so a replica
  that applied every change up to ``seq`` brings its ANN index (a cache) up to date with
  :meth:`PgUnitRecords.changes_since` (see :mod:`tessera.retrieval.follow`). Two transactions
  may commit in the other order than their ``seq``s; a reader therefore never moves its cursor
  past a ``seq`` gap that is younger than :data:`GAP_GRACE_S` (the gap's writer may still commit).
* ``meta.term``: the highest leader term that ever took office (:meth:`PgUnitRecords.record_term`);
  a deposed leader's "I lead" is refused here too.
* the "index saved at version" bookkeeping is per replica (each replica has its own index
  files), so it stays in a small JSON file in the replica's data directory.

Only called from the retrieval worker thread, one connection per process.
"""

from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from tessera.config import RetrievalConfig
from tessera.errors import ConfigError
from tessera.private_files import check_private
from tessera.retrieval.store.records import NewRecord
from tessera.retrieval.store.sql import INSERT_UNIT, SqlUnitRecords, schema, unit_row

GAP_GRACE_S = 5.0  # a seq gap older than this is a rolled-back transaction, not one still committing
PASSWORD_ENV = "TESSERA_PG_PASSWORD"
SAVED_FILE = "pg-index-saved.json"

_SCHEMA = schema(serial_key="BIGSERIAL PRIMARY KEY", blob="BYTEA", real="DOUBLE PRECISION") + """
CREATE TABLE IF NOT EXISTS scopes (scope TEXT PRIMARY KEY, version BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS changes (
    seq BIGSERIAL PRIMARY KEY,
    scope TEXT NOT NULL,
    key BIGINT NOT NULL,
    added BOOLEAN NOT NULL,
    at DOUBLE PRECISION NOT NULL
);
"""
_LOG_CHANGE = "INSERT INTO changes (scope, key, added, at) VALUES (?, ?, ?, ?)"


def dsn_with_secret(config: RetrievalConfig) -> str:
    """The configured DSN plus the password from ``postgres_password_file`` or $TESSERA_PG_PASSWORD."""
    password = os.environ.get(PASSWORD_ENV, "")
    if config.postgres_password_file:
        path = Path(config.postgres_password_file).expanduser()
        check_private(path, "retrieval.postgres_password_file")
        try:
            password = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"retrieval.postgres_password_file = {str(path)!r} cannot be read ({exc})") from None
    if not password:
        return config.postgres_dsn
    from psycopg.conninfo import make_conninfo

    return make_conninfo(config.postgres_dsn, password=password)


class PgUnitRecords(SqlUnitRecords):
    """The PostgreSQL database of a replicated retrieval role.

    The verbs of :class:`~tessera.retrieval.store.records.UnitRecordStore`, plus leader terms and
    the change sequence.
    """

    _IN = "= ANY(?)"
    _BUMP = "INSERT INTO scopes VALUES (?, 1) ON CONFLICT (scope) DO UPDATE SET version = scopes.version + 1"

    def __init__(self, dsn: str, directory: Path, fingerprint: str, *, label: str = "") -> None:
        import psycopg

        self.directory = directory
        self._name = "the PostgreSQL store"
        self._elsewhere = "Point retrieval.postgres_dsn at another database"
        directory.mkdir(parents=True, exist_ok=True)
        self._saved_path = directory / SAVED_FILE
        self._db = psycopg.connect(dsn, autocommit=True)
        try:
            with self._db.transaction():
                # one schema creator at a time: replicas starting together would race on CREATE
                self._db.execute("SELECT pg_advisory_xact_lock(7213)")
                self._db.execute(_SCHEMA)
            self._open(fingerprint, label)
        except BaseException:
            self._db.close()
            raise

    # --- the dialect ---------------------------------------------------------------------

    def _sql(self, query: str) -> str:
        return query.replace("?", "%s")

    def _list(self, values: list[Any]) -> list[Any]:
        return values

    def _transaction(self) -> AbstractContextManager[Any]:
        transaction: AbstractContextManager[Any] = self._db.transaction()
        return transaction

    def _lock_meta(self) -> None:
        self._db.execute("LOCK TABLE meta IN EXCLUSIVE MODE")

    def _insert(self, r: NewRecord, now: float) -> int:
        """A unit another replica inserted since this one looked keeps that replica's key."""
        row = self._execute(INSERT_UNIT + " ON CONFLICT (unit_id) DO NOTHING RETURNING key", unit_row(r)).fetchone()
        if row is None:
            row = self._execute("SELECT key FROM units WHERE unit_id = ?", (r.unit_id,)).fetchone()
            assert row is not None, r.unit_id
        else:
            self._execute(_LOG_CHANGE, (r.scope, row[0], True, now))
        return int(row[0])

    def _delete(self, unit_ids: list[str], now: float) -> list[tuple[str, str]]:
        rows = self._execute(f"DELETE FROM units WHERE unit_id {self._IN} RETURNING unit_id, scope, key",
                             (unit_ids,)).fetchall()
        for _, s, k in rows:
            self._execute(_LOG_CHANGE, (s, k, False, now))
        return [(str(u), str(s)) for u, s, _ in rows]

    # --- leader terms --------------------------------------------------------------------

    def record_term(self, term: int) -> bool:
        """Store ``term`` as the newest leader term; False if a newer one was recorded already."""
        row = self._execute(
            "INSERT INTO meta VALUES ('term', ?) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value "
            "WHERE meta.value::bigint <= EXCLUDED.value::bigint RETURNING value", (str(term),)).fetchone()
        return row is not None

    def term(self) -> int:
        return int(self._meta("term") or 0)

    # --- the saved index versions (this replica's files) ---------------------------------

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

    def scopes(self) -> dict[str, tuple[int, int]]:
        """scope -> (version, the version this replica's saved index file reflects, -1 if none)."""
        saved = self._saved()
        return {s: (int(v), saved.get(s, -1)) for s, v in self._execute("SELECT scope, version FROM scopes").fetchall()}

    # --- the change sequence -------------------------------------------------------------

    def changes_since(self, seq: int, limit: int = 10_000) -> list[tuple[int, str, int, bool, float]]:
        """(seq, scope, key, added, at) of the changes after ``seq``, in seq order."""
        rows = self._execute("SELECT seq, scope, key, added, at FROM changes WHERE seq > ? ORDER BY seq LIMIT ?",
                             (seq, limit)).fetchall()
        return [(int(q), str(s), int(k), bool(a), float(t)) for q, s, k, a, t in rows]

    def last_change(self) -> int:
        row = self._execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()
        assert row is not None
        return int(row[0])
