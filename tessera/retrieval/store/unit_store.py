"""The retrieval pool: ingest, update, delete and retrieve the units of a scope.

Ingest turns (scope, text, metadata) into identified units: tokenized with the *served*
model's tokenizer (cached), identified by (scope, token ids, serving fingerprint), embedded
with MiniLM and indexed in the scope's HNSW index. Re-ingesting the same text in the same
scope yields the same unit id and indexes nothing new (its metadata is replaced).

Durability: the unit records (:mod:`tessera.retrieval.store.records`) are the source of
truth and every batch is committed before the call returns; the per-scope indexes are caches
of them, saved by ``save_indexes``, caught up at start-up when stale and rebuilt when missing.

Update and delete: a unit may carry a caller-chosen ``external_id`` (unique per scope).
Ingesting new text under an existing external id creates the new unit and revokes the old
one in the same transaction; :meth:`UnitStore.delete` and :meth:`UnitStore.delete_where`
revoke units. Revoked ids leave the index at once; telling the caches is the caller's job
(see RetrievalNode.revoke).

Requests may also bring their units directly (agent memory recalled by an external store):
:meth:`UnitStore.identify` gives them the same identity without indexing them, so the
control plane tracks their demand exactly like retrieved units.

Not thread-safe: the service runs every call on one worker thread. Bad input raises
:class:`BadRequest` naming the field, before anything is written.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tessera.config import RetrievalConfig
from tessera.errors import BadRequest
from tessera.private_files import private_dir
from tessera.retrieval.embedder import Embedder
from tessera.retrieval.prompt_path import identify_unit
from tessera.retrieval.store.backends import open_records
from tessera.retrieval.store.index import IndexCorrupt, UnitIndex, check_scope, index_path
from tessera.retrieval.store.postgres import PgUnitRecords
from tessera.retrieval.store.records import Existing, NewRecord, Record
from tessera.units import ContextUnit, UnitFactory

log = logging.getLogger(__name__)
MAX_TOP_K = 1000
MAX_EXTERNAL_ID = 256


SEP = "\x1f"  # between tenant and scope in storage scopes; check_scope refuses control characters


def index_key(tenant: str, scope: str) -> str:
    """The storage (records and index) name of a tenant's scope."""
    return f"{tenant}{SEP}{scope}" if tenant else scope


@dataclass(frozen=True, slots=True)
class StoredUnit:
    unit: ContextUnit
    metadata: Mapping[str, Any] = field(default_factory=dict)
    external_id: str | None = None


@dataclass(frozen=True, slots=True)
class Hit:
    unit: ContextUnit
    score: float  # cosine similarity to the query
    metadata: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Ingested:
    """What an ingest batch did: (unit, newly indexed) per item, and the units it replaced."""

    units: list[tuple[ContextUnit, bool]]
    revoked: tuple[str, ...] = ()  # old units of updated external ids


@dataclass(frozen=True, slots=True)
class Deleted:
    deleted: tuple[str, ...]  # live units revoked now
    already: tuple[str, ...] = ()  # revoked earlier (deletes are idempotent)
    unknown: tuple[str, ...] = ()  # never stored here (or, given an owner, not the caller's)


def split_key(key: str) -> tuple[str, str]:
    """(tenant, scope) of a storage scope (the inverse of :func:`index_key`)."""
    tenant, sep, scope = key.rpartition(SEP)
    return (tenant, scope) if sep else ("", key)


def _unit(r: Record) -> ContextUnit:
    tenant, scope = split_key(r.scope)
    return ContextUnit(r.unit_id, scope, r.text, r.token_ids, tenant)


Owner = Callable[[str, str], bool]  # (tenant, scope) -> whether the caller owns units there


class UnitStore:
    """Units, their embeddings and the per-scope index.

    Verbs: ``ingest``, ``retrieve``, ``identify``, ``delete``/``delete_where``, ``save_indexes``, ``close``.
    """

    def __init__(self, factory: UnitFactory, embedder: Embedder, config: RetrievalConfig) -> None:
        self.factory = factory
        self.embedder = embedder
        self.config = config
        self._temporary = not config.data_dir
        self.directory = Path(tempfile.mkdtemp(prefix="tessera-units-") if self._temporary
                              else Path(config.data_dir).expanduser())
        # a temporary store is removed when closed, or when dropped unclosed (renderers, tests)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True) if self._temporary else None
        fp = factory.fingerprint
        self.records = open_records(config, self.directory, fp.digest.hex(),
                                    f"model {fp.model}, tokenizer {fp.tokenizer}, kv {fp.kv_dtype}")
        # where a follower of the PostgreSQL change sequence starts: read before the indexes are
        # opened, so every change they miss comes after it (applying one twice is harmless)
        self.change_cursor = self.records.last_change() if isinstance(self.records, PgUnitRecords) else 0
        self.index = UnitIndex(embedder.dim, config.hnsw_connectivity, config.hnsw_expansion_search,
                               config.index_threads)
        self._index_dir = private_dir(self.directory / "index")
        self._dirty: set[str] = set()  # scopes whose index changed since it was saved
        self.rebuilt: list[str] = []  # scopes whose index was rebuilt from the records at start
        self.caught_up: dict[str, int] = {}  # scope -> units a stale saved index was brought up to date with
        self._open_indexes()

    def __len__(self) -> int:
        return len(self.index)

    @property
    def incarnation(self) -> int:
        """How many times this data directory was opened (this opening included)."""
        return self.records.incarnation

    def close(self) -> None:
        """Save the changed indexes and close the database (a temporary directory is removed)."""
        if not self._temporary:
            self.save_indexes()
        self.records.close()
        if self._cleanup is not None:
            self._cleanup()

    # --- indexes -------------------------------------------------------------------------

    def _open_indexes(self) -> None:
        """Load each scope's saved index and bring it up to the records.

        Saved at the records' current version: loaded as is. Saved earlier (a crash before the
        next periodic save): loaded, then the units added since are indexed from their stored
        embeddings and the deleted ones removed, so recovery costs what changed, not the
        whole scope. No file, or one that fails its checksum or does not load: rebuilt from the
        stored embeddings, with a warning naming the file.
        """
        for scope, (version, saved) in self.records.scopes().items():
            path = index_path(self._index_dir, scope)
            index = self.index.scope(scope)
            t0 = time.perf_counter()
            if path.exists():
                try:
                    index.load(path)
                except (IndexCorrupt, RuntimeError, ValueError) as exc:
                    log.warning("scope %s: index file %s not loaded (%s); rebuilding it from the unit store",
                                scope, path, exc)
                    index = self.index.scope_reset(scope)
                else:
                    if saved == version and len(index) == self.records.scope_size(scope):
                        continue
                    changed = self._catch_up(scope)
                    self.caught_up[scope] = changed
                    self._dirty.add(scope)
                    log.info("scope %s: saved index caught up with %d changed units in %.2fs", scope, changed,
                             time.perf_counter() - t0)
                    continue
            keys, vectors = self.records.embeddings(scope, self.embedder.dim)
            index.add(keys.tolist(), vectors)
            self._dirty.add(scope)
            self.rebuilt.append(scope)
            log.info("scope %s: index rebuilt from %d stored embeddings in %.1fs", scope, len(keys),
                     time.perf_counter() - t0)

    def _catch_up(self, scope: str) -> int:
        """Index the scope's units missing from its loaded index, remove the deleted ones."""
        index = self.index.scope(scope)
        live = self.records.keys(scope)
        indexed = index.keys()
        extra = np.setdiff1d(indexed, live, assume_unique=True)
        missing = np.setdiff1d(live, indexed, assume_unique=True)
        index.remove(extra.tolist())
        keys, vectors = self.records.embeddings_of(missing.tolist(), self.embedder.dim)
        index.add(keys.tolist(), vectors)
        return len(extra) + len(keys)

    def changed(self, scope: str) -> None:
        """The scope's index was changed from outside (a replica following the change sequence)."""
        self._dirty.add(scope)

    def save_indexes(self) -> int:
        """Write the changed scopes' indexes (atomically); returns how many were written."""
        if not self._dirty:
            return 0
        versions = self.records.scopes()
        written = 0
        for scope in sorted(self._dirty):
            version = versions.get(scope, (0, 0))[0]
            self.index.scope(scope).save(index_path(self._index_dir, scope))
            self.records.mark_saved(scope, version)
            written += 1
        self._dirty.clear()
        return written

    # --- units ---------------------------------------------------------------------------

    def get(self, unit_id: str) -> StoredUnit | None:
        r = self.records.get(unit_id)
        return None if r is None else StoredUnit(_unit(r), r.metadata, r.external_id)

    def by_digest(self, digests: Sequence[str]) -> dict[str, tuple[str, int]]:
        """Block-header digest (hex) -> (unit_id, n_tokens) of live units: recovery of the shared tier."""
        return self.records.by_digest(digests)

    def revoked(self) -> set[str]:
        """Every unit id deleted or replaced (and not ingested again) in this data directory."""
        return self.records.revoked()

    def identify(self, scope: str, text: str, field: str = "unit", tenant: str = "") -> ContextUnit:
        """Tokenize and identify one unit of ``tenant``; validates scope, emptiness and length."""
        return identify_unit(self.factory, self.config.max_unit_tokens, scope, text, field, tenant)

    def ingest(self, items: Sequence[tuple[str, str, Mapping[str, Any]]],
               embeddings: Sequence[Sequence[float] | None] | None = None,
               external_ids: Sequence[str | None] | None = None, tenant: str = "") -> Ingested:
        """Add or update (scope, text, metadata) units of ``tenant`` as one transaction.

        ``embeddings`` may bring precomputed vectors (None entries are embedded here).
        ``external_ids``: a unit whose external id names another live unit of its scope
        replaces it (the old one is revoked). The last row of a unit sets its metadata.
        """
        n = len(items)
        if embeddings is not None and len(embeddings) != n:
            raise BadRequest(f"{len(embeddings)} embeddings for {n} units")
        externals = list(external_ids) if external_ids is not None else [None] * n
        if len(externals) != n:
            raise BadRequest(f"{len(externals)} external ids for {n} units")
        units = [self.identify(scope, text, f"units[{i}]", tenant) for i, (scope, text, _) in enumerate(items)]
        claims: dict[tuple[str, str], str] = {}  # (scope, external id) -> unit id, within the batch
        for i, (unit, ext) in enumerate(zip(units, externals, strict=True)):
            if ext is None:
                continue
            if not isinstance(ext, str) or not 0 < len(ext) <= MAX_EXTERNAL_ID:
                raise BadRequest(f"units[{i}].external_id must be a string of 1-{MAX_EXTERNAL_ID} characters")
            if claims.setdefault((unit.scope, ext), unit.unit_id) != unit.unit_id:
                raise BadRequest(f"units[{i}].external_id = {ext!r} names two different texts in one batch; "
                                 "send one text per external id")
        existing = self.records.existing(u.unit_id for u in units)
        first: dict[str, int] = {}  # unit id -> its first row (embedded from it)
        last: dict[str, int] = {}  # unit id -> its last row (metadata and external id from it)
        for row, unit in enumerate(units):
            first.setdefault(unit.unit_id, row)
            last[unit.unit_id] = row
        fresh_rows = [r for u, r in first.items() if u not in existing]
        vectors = self._vectors(units, fresh_rows, embeddings) if fresh_rows else None  # [len, dim]
        # old units of the external ids this batch moves to another text; an old holder that
        # the batch ingests again stays (it only loses the id): revoking it answered a unit
        # listed in the reply with 404 (found by tests/test_api_fuzz.py)
        replaced: dict[str, tuple[str, int]] = {}
        in_batch = {u.unit_id for u in units}
        for (scope, ext), unit_id in claims.items():
            old = self.records.by_external(index_key(tenant, scope), ext)
            if old is not None and old != unit_id and old not in in_batch:
                gone = self.records.existing([old])[old]
                replaced[old] = (gone.scope, gone.key)
        updates: list[tuple[str, Mapping[str, Any], str | None]] = []
        for unit_id, row in last.items():
            found = existing.get(unit_id)
            if found is None or unit_id in replaced:
                continue
            metadata, ext = dict(items[row][2]), externals[row]
            if metadata != found.metadata or (ext is not None and ext != found.external_id):
                updates.append((unit_id, metadata, ext))
        # records and indexes are kept per (tenant, scope): the storage scope is index_key(tenant, scope)
        fresh = [NewRecord(units[r].unit_id, index_key(tenant, units[r].scope), units[r].text, units[r].token_ids,
                           dict(items[last[units[r].unit_id]][2]), vectors[i], externals[last[units[r].unit_id]])
                 for i, r in enumerate(fresh_rows) if vectors is not None]
        keys = self.records.write(fresh, updates, list(replaced))
        # the batch is durable: now the in-memory indexes follow
        for scope, key in replaced.values():
            self.index.remove(scope, [key])
            self._dirty.add(scope)
        by_scope: dict[str, list[int]] = {}
        for i, record in enumerate(fresh):
            by_scope.setdefault(record.scope, []).append(i)
        for scope, rows in by_scope.items():
            assert vectors is not None
            self.index.add(scope, [keys[i] for i in rows], vectors[rows])
            self._dirty.add(scope)
        new = {units[r].unit_id: r for r in fresh_rows}
        return Ingested([(unit, new.get(unit.unit_id) == row) for row, unit in enumerate(units)],
                        tuple(replaced))

    def delete(self, unit_ids: Sequence[str], owns: Owner | None = None) -> Deleted:
        """Revoke these units (one transaction); ids already revoked or unknown are reported.

        ``owns(tenant, scope)``: the caller's units; a unit or tombstone of anyone else is left
        alone and reported unknown, so a delete never confirms that another tenant's id exists.
        """
        live = self.records.existing(unit_ids)
        gone = self.records.tombstones([u for u in unit_ids if u not in live])
        if owns is not None:
            live = {u: found for u, found in live.items() if owns(*split_key(found.scope))}
            gone = {u: scope for u, scope in gone.items() if owns(*split_key(scope))}
        self._revoke(live)
        return Deleted(tuple(u for u in dict.fromkeys(unit_ids) if u in live),
                       tuple(u for u in dict.fromkeys(unit_ids) if u in gone),
                       tuple(u for u in dict.fromkeys(unit_ids) if u not in live and u not in gone))

    def delete_where(self, scope: str, where: Mapping[str, Any] | None = None, tenant: str = "") -> Deleted:
        """Revoke every unit of ``tenant``'s ``scope`` whose metadata has all the ``where`` key/value pairs."""
        check_scope(scope)
        match = dict(where or {})
        ids = [u for u, metadata in self.records.select(index_key(tenant, scope))
               if all(k in metadata and metadata[k] == v for k, v in match.items())]
        self._revoke(self.records.existing(ids))
        return Deleted(tuple(ids))

    def _revoke(self, live: Mapping[str, Existing]) -> None:
        if not live:
            return
        self.records.revoke(list(live))
        by_scope: dict[str, list[int]] = {}
        for found in live.values():
            by_scope.setdefault(found.scope, []).append(found.key)
        for scope, keys in by_scope.items():
            self.index.remove(scope, keys)
            self._dirty.add(scope)

    def retrieve(self, scope: str, *, query: str | None = None, embedding: Sequence[float] | None = None,
                 top_k: int | None = None, tenant: str = "") -> list[Hit]:
        """Top-k units of ``tenant``'s ``scope`` for a query text or a precomputed embedding, best first."""
        check_scope(scope)
        k = self.config.top_k if top_k is None or top_k == 0 else top_k
        if not 1 <= k <= MAX_TOP_K:
            raise BadRequest(f"top_k = {top_k} is out of range: expected 1..{MAX_TOP_K} (0 = the default)")
        vector = self._query_vector(query, embedding)
        try:
            found = self.index.search(index_key(tenant, scope), vector, k)
        except BadRequest as exc:
            if exc.status != 404:
                raise
            # name the caller's scope, never the storage key (it would show the tenant's name)
            raise BadRequest(f"unknown scope {scope!r}: nothing was ingested into it", 404) from None
        records = self.records.by_keys([key for key, _ in found])
        return [Hit(_unit(records[key]), score, records[key].metadata) for key, score in found if key in records]

    def _vectors(self, units: Sequence[ContextUnit], rows: list[int],
                 embeddings: Sequence[Sequence[float] | None] | None) -> np.ndarray:
        given = [None if embeddings is None else embeddings[r] for r in rows]
        out = np.empty((len(rows), self.embedder.dim), dtype=np.float32)
        todo = [i for i, v in enumerate(given) if v is None]
        if todo:
            out[todo] = self.embedder.embed([units[rows[i]].text for i in todo])
        for i, v in enumerate(given):
            if v is not None:
                out[i] = self._normalized(v, f"units[{rows[i]}].embedding")
        return out

    def _normalized(self, embedding: Sequence[float], field: str = "embedding") -> np.ndarray:
        if len(embedding) != self.embedder.dim:
            raise BadRequest(f"{field} has {len(embedding)} dimensions; the embedder's have {self.embedder.dim}")
        vector = np.asarray(embedding, dtype=np.float32)
        norm = float(np.linalg.norm(vector))
        if not math.isfinite(norm) or norm == 0.0:
            raise BadRequest(f"{field} must be finite and non-zero")
        return vector / norm

    def _query_vector(self, query: str | None, embedding: Sequence[float] | None) -> np.ndarray:
        if (query is None) == (embedding is None):
            raise BadRequest("give exactly one of query (text) or embedding (a vector)")
        if query is not None:
            if not query.strip():
                raise BadRequest("query is empty")
            return self.embedder.embed_one(query)
        assert embedding is not None
        return self._normalized(embedding)
