"""Vector index of unit embeddings: one usearch HNSW index (cosine) per sharing scope.

A scope is a namespace: a query only ever sees the units of its own scope, and the same
text in two scopes is two units. A unit id is indexed once per scope however often it is
ingested.

The index stores ids and vectors only; texts and metadata live in the retrieval pool.
"""

from __future__ import annotations

import re

import numpy as np
from usearch.index import Index

from tessera.errors import BadRequest

# letters, digits and . _ - : / ; starts with a letter or digit; at most 128 characters
SCOPE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def check_scope(scope: str, field: str = "scope") -> None:
    if not isinstance(scope, str) or SCOPE_PATTERN.fullmatch(scope) is None:
        raise BadRequest(
            f"{field} = {scope!r} is not a valid scope name: use 1-128 letters, digits or . _ - : / "
            "starting with a letter or digit"
        )


class ScopeIndex:
    """HNSW index of one scope. Keys are dense ints; ``unit_ids[key]`` maps back."""

    def __init__(self, dim: int, connectivity: int, expansion_search: int) -> None:
        self.dim = dim
        self._index = Index(ndim=dim, metric="cos", dtype="f32", connectivity=connectivity,
                            expansion_search=expansion_search)
        self.unit_ids: list[str] = []
        self._keys: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.unit_ids)

    def __contains__(self, unit_id: object) -> bool:
        return unit_id in self._keys

    def add(self, unit_ids: list[str], vectors: np.ndarray) -> int:
        """Index the units not indexed yet; returns how many were new. vectors: [N, dim]."""
        assert vectors.shape == (len(unit_ids), self.dim), (vectors.shape, len(unit_ids), self.dim)
        fresh: list[int] = []
        for row, u in enumerate(unit_ids):
            if u not in self._keys:
                self._keys[u] = len(self.unit_ids)
                self.unit_ids.append(u)
                fresh.append(row)
        if fresh:
            keys = np.array([self._keys[unit_ids[r]] for r in fresh], dtype=np.uint64)
            self._index.add(keys, np.ascontiguousarray(vectors[fresh], dtype=np.float32))
        return len(fresh)

    def search(self, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        """Top-k (unit id, cosine similarity), best first."""
        if not self.unit_ids:
            return []
        matches = self._index.search(np.ascontiguousarray(vector, dtype=np.float32), min(k, len(self.unit_ids)))
        return [(self.unit_ids[int(key)], 1.0 - float(dist))
                for key, dist in zip(matches.keys, matches.distances, strict=True)]


class UnitIndex:
    """Every scope's index. Verbs: ``add``, ``search``."""

    def __init__(self, dim: int, connectivity: int = 16, expansion_search: int = 64) -> None:
        self.dim = dim
        self.connectivity = connectivity
        self.expansion_search = expansion_search
        self._scopes: dict[str, ScopeIndex] = {}

    @property
    def scopes(self) -> list[str]:
        return sorted(self._scopes)

    def __len__(self) -> int:
        return sum(len(s) for s in self._scopes.values())

    def contains(self, scope: str, unit_id: str) -> bool:
        index = self._scopes.get(scope)
        return index is not None and unit_id in index

    def add(self, scope: str, unit_ids: list[str], vectors: np.ndarray) -> int:
        index = self._scopes.get(scope)
        if index is None:
            index = self._scopes[scope] = ScopeIndex(self.dim, self.connectivity, self.expansion_search)
        return index.add(unit_ids, vectors)

    def search(self, scope: str, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        index = self._scopes.get(scope)
        if index is None:
            # never list the known scopes: they are other tenants' names (issue 14)
            raise BadRequest(f"unknown scope {scope!r}: nothing was ingested into it", 404)
        return index.search(vector, k)
