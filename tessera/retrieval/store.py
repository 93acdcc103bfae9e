"""The retrieval pool: ingest units, retrieve the top-k units of a scope for a query.

Ingest turns (scope, text, metadata) into identified units: tokenized with the *served*
model's tokenizer (cached), identified by (scope, token ids, serving fingerprint), embedded
with MiniLM and indexed in the scope's HNSW index. Re-ingesting the same text in the same
scope yields the same unit id and indexes nothing new.

Requests may also bring their units directly (agent memory recalled by an external store):
:meth:`UnitStore.identify` gives them the same identity without indexing them, so the
control plane tracks their demand exactly like retrieved units.

Not thread-safe: the service runs every call on one worker thread. Bad input raises
:class:`BadRequest` naming the field, before anything is indexed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera.config import RetrievalConfig
from tessera.errors import BadRequest
from tessera.retrieval.embedder import Embedder
from tessera.retrieval.index import UnitIndex, check_scope
from tessera.units import ContextUnit, UnitFactory

MAX_TOP_K = 1000


def index_key(tenant: str, scope: str) -> str:
    """The index's name of a tenant's scope (the separator cannot occur in a scope name)."""
    return f"{tenant}\x1f{scope}" if tenant else scope


@dataclass(frozen=True, slots=True)
class StoredUnit:
    unit: ContextUnit
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Hit:
    unit: ContextUnit
    score: float  # cosine similarity to the query
    metadata: Mapping[str, Any]


class UnitStore:
    """Units, their embeddings and the per-scope index. Verbs: ``ingest``, ``retrieve``, ``identify``."""

    def __init__(self, factory: UnitFactory, embedder: Embedder, config: RetrievalConfig) -> None:
        self.factory = factory
        self.embedder = embedder
        self.config = config
        self.index = UnitIndex(embedder.dim, config.hnsw_connectivity, config.hnsw_expansion_search)
        self._units: dict[str, StoredUnit] = {}

    def __len__(self) -> int:
        return len(self._units)

    def get(self, unit_id: str) -> StoredUnit | None:
        return self._units.get(unit_id)

    def identify(self, scope: str, text: str, field: str = "unit", tenant: str = "") -> ContextUnit:
        """Tokenize and identify one unit of ``tenant``; validates scope, emptiness and length."""
        check_scope(scope, f"{field}.scope")
        if not isinstance(text, str) or not text.strip():
            raise BadRequest(f"{field}.text is empty; a unit needs some text")
        unit = self.factory.make(scope, text, tenant)
        if unit.n_tokens == 0:
            raise BadRequest(f"{field}.text has no tokens")
        if unit.n_tokens > self.config.max_unit_tokens:
            raise BadRequest(
                f"{field}.text is {unit.n_tokens} tokens, more than retrieval.max_unit_tokens = "
                f"{self.config.max_unit_tokens}; split it into smaller units", 413
            )
        return unit

    def ingest(self, items: Sequence[tuple[str, str, Mapping[str, Any]]],
               embeddings: Sequence[Sequence[float] | None] | None = None,
               tenant: str = "") -> list[tuple[ContextUnit, bool]]:
        """Add (scope, text, metadata) units; returns (unit, newly indexed) per item, in order.

        ``embeddings`` may bring precomputed vectors (None entries are embedded here).
        """
        if embeddings is not None and len(embeddings) != len(items):
            raise BadRequest(f"{len(embeddings)} embeddings for {len(items)} units")
        units = [self.identify(scope, text, f"units[{i}]", tenant) for i, (scope, text, _) in enumerate(items)]
        fresh: dict[str, int] = {}  # unit id -> first row needing an embedding
        for row, unit in enumerate(units):
            if unit.unit_id not in self._units and unit.unit_id not in fresh:
                fresh[unit.unit_id] = row
        if fresh:
            rows = list(fresh.values())
            vectors = self._vectors(units, rows, embeddings)  # [len(rows), dim]
            by_scope: dict[str, list[int]] = {}
            for i, r in enumerate(rows):
                by_scope.setdefault(index_key(tenant, units[r].scope), []).append(i)
            for scope, picks in by_scope.items():
                self.index.add(scope, [units[rows[i]].unit_id for i in picks], vectors[picks])
            for r in rows:
                self._units[units[r].unit_id] = StoredUnit(units[r], dict(items[r][2]))
        out: list[tuple[ContextUnit, bool]] = []
        for row, unit in enumerate(units):
            out.append((unit, fresh.get(unit.unit_id) == row))
        return out

    def retrieve(self, scope: str, *, query: str | None = None, embedding: Sequence[float] | None = None,
                 top_k: int | None = None, tenant: str = "") -> list[Hit]:
        """Top-k units of ``tenant``'s ``scope`` for a query text or a precomputed embedding, best first."""
        check_scope(scope)
        k = self.config.top_k if top_k is None or top_k == 0 else top_k
        if not 1 <= k <= MAX_TOP_K:
            raise BadRequest(f"top_k = {top_k} is out of range: expected 1..{MAX_TOP_K} (0 = the default)")
        vector = self._query_vector(query, embedding)
        return [Hit(self._units[u].unit, score, self._units[u].metadata)
                for u, score in self.index.search(index_key(tenant, scope), vector, k)]

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
