"""Vector index of unit embeddings: one usearch HNSW index (cosine) per sharing scope.

A scope is a namespace: a query only ever sees the units of its own scope, and the same
text in two scopes is two units. A unit id is indexed once per scope however often it is
ingested.

The index stores record keys and vectors only; texts and metadata live in the unit records
(records.py), which are the source of truth: an index file is a cache of them, saved
atomically and rebuilt from the stored embeddings when it is missing or stale.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path

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
    """HNSW index of one scope, keyed by the units' record keys (see records.py)."""

    def __init__(self, dim: int, connectivity: int, expansion_search: int) -> None:
        self.dim = dim
        self._index = Index(ndim=dim, metric="cos", dtype="f32", connectivity=connectivity,
                            expansion_search=expansion_search)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and key in self._index

    def add(self, keys: Sequence[int], vectors: np.ndarray) -> None:
        """Index new keys. vectors: [N, dim]."""
        assert vectors.shape == (len(keys), self.dim), (vectors.shape, len(keys), self.dim)
        if len(keys):
            self._index.add(np.asarray(keys, dtype=np.uint64), np.ascontiguousarray(vectors, dtype=np.float32))

    def remove(self, keys: Sequence[int]) -> None:
        for key in keys:
            if key in self._index:
                self._index.remove(key)

    def search(self, vector: np.ndarray, k: int) -> list[tuple[int, float]]:
        """Top-k (key, cosine similarity), best first."""
        if not len(self._index):
            return []
        matches = self._index.search(np.ascontiguousarray(vector, dtype=np.float32), min(k, len(self._index)))
        return [(int(key), 1.0 - float(dist)) for key, dist in zip(matches.keys, matches.distances, strict=True)]

    def save(self, path: Path) -> None:
        """Write atomically: a crash leaves the old file or the new one, never a torn one."""
        tmp = path.with_name(path.name + ".tmp")
        self._index.save(str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        self._index.load(str(path))

    def keys(self) -> np.ndarray:
        """Every indexed key, [N] uint64."""
        return np.asarray(self._index.keys, dtype=np.uint64)


class UnitIndex:
    """Every scope's index. Verbs: ``add``, ``remove``, ``search``, ``save``/``load``."""

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

    def scope(self, scope: str) -> ScopeIndex:
        """The scope's index, created empty if it has none yet."""
        index = self._scopes.get(scope)
        if index is None:
            index = self._scopes[scope] = ScopeIndex(self.dim, self.connectivity, self.expansion_search)
        return index

    def scope_reset(self, scope: str) -> ScopeIndex:
        """A new empty index for the scope (its loaded file did not match the records)."""
        self._scopes.pop(scope, None)
        return self.scope(scope)

    def add(self, scope: str, keys: Sequence[int], vectors: np.ndarray) -> None:
        self.scope(scope).add(keys, vectors)

    def remove(self, scope: str, keys: Sequence[int]) -> None:
        index = self._scopes.get(scope)
        if index is not None:
            index.remove(keys)

    def search(self, scope: str, vector: np.ndarray, k: int) -> list[tuple[int, float]]:
        index = self._scopes.get(scope)
        if index is None:
            # never list the known scopes: they are other tenants' names (issue 14)
            raise BadRequest(f"unknown scope {scope!r}: nothing was ingested into it", 404)
        return index.search(vector, k)


def index_path(directory: Path, scope: str) -> Path:
    """File of a scope's saved index: scope names may hold '/' and ':', so the name is a digest."""
    return directory / f"{hashlib.blake2b(scope.encode(), digest_size=12).hexdigest()}.usearch"
