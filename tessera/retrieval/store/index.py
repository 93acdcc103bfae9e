"""Vector index of unit embeddings: one usearch HNSW index (cosine) per sharing scope.

A scope is a namespace: a query only ever sees the units of its own scope, and the same
text in two scopes is two units. A unit id is indexed once per scope however often it is
ingested.

The index stores record keys and vectors only; texts and metadata live in the unit records
(:mod:`tessera.retrieval.store.records`), which are the source of truth: an index file is a
cache of them, saved atomically and rebuilt from the stored embeddings when it is missing,
stale or corrupt.

Every saved file ``X.usearch`` has a sidecar ``X.usearch.sha256`` holding its SHA-256,
written (temp file, fsync, rename) after the index file is in place. A file is checked
against it before usearch reads a byte of it: usearch trusts its input, and 200 random bytes
in an index file made it dereference garbage (SIGSEGV on the first search, a crash loop
under ``tessera up``). A crash between the two renames leaves a new index beside the old
checksum: a mismatch, so the scope is rebuilt, never loaded unchecked.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from usearch.index import Index

from tessera.errors import BadRequest, IntegrityError
from tessera.private_files import FILE_MODE

# letters, digits and . _ - : / ; starts with a letter or digit; at most 128 characters
SCOPE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


class IndexCorrupt(IntegrityError):
    """A saved index file does not match its recorded checksum (or has none)."""


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically with ``data`` (0600, fsynced before the rename)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def check_scope(scope: str, field: str = "scope") -> None:
    if not isinstance(scope, str) or SCOPE_PATTERN.fullmatch(scope) is None:
        raise BadRequest(
            f"{field} = {scope!r} is not a valid scope name: use 1-128 letters, digits or . _ - : / "
            "starting with a letter or digit"
        )


class ScopeIndex:
    """HNSW index of one scope, keyed by the units' record keys (see :mod:`tessera.retrieval.store.records`)."""

    def __init__(self, dim: int, connectivity: int, expansion_search: int, threads: int = 0) -> None:
        self.dim = dim
        self.threads = threads  # inserting threads (0: every core; 1: the same graph every time)
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
            self._index.add(np.asarray(keys, dtype=np.uint64), np.ascontiguousarray(vectors, dtype=np.float32),
                            threads=self.threads)

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
        """Write atomically (0600), then its checksum: a crash never leaves a torn file that loads."""
        tmp = path.with_name(path.name + ".tmp")
        self._index.save(str(tmp))
        os.chmod(tmp, FILE_MODE)  # the vectors are derived from every tenant's text
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        digest = _sha256(tmp)
        os.replace(tmp, path)
        _write_durably(checksum_path(path), f"{digest}\n".encode())

    def load(self, path: Path) -> None:
        """Load a saved file; IndexCorrupt, before usearch reads it, unless it matches its checksum."""
        recorded = checksum_path(path)
        try:
            expected = recorded.read_text().strip()
        except FileNotFoundError:
            raise IndexCorrupt(f"{path} has no checksum file {recorded.name} (saved by an older Tessera, or "
                               "the checksum was lost); it is not loaded unchecked") from None
        actual = _sha256(path)
        if actual != expected:
            raise IndexCorrupt(f"{path} ({path.stat().st_size} bytes) has SHA-256 {actual[:16]}..., its checksum "
                               f"file records {expected[:16]}...: the file was changed or damaged after it was saved")
        self._index.load(str(path))

    def keys(self) -> np.ndarray:
        """Every indexed key, [N] uint64."""
        return np.asarray(self._index.keys, dtype=np.uint64)


class UnitIndex:
    """Every scope's index. Verbs: ``add``, ``remove``, ``search``, ``save``/``load``."""

    def __init__(self, dim: int, connectivity: int = 16, expansion_search: int = 64, threads: int = 0) -> None:
        self.dim = dim
        self.connectivity = connectivity
        self.expansion_search = expansion_search
        self.threads = threads
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
            index = self._scopes[scope] = ScopeIndex(self.dim, self.connectivity, self.expansion_search, self.threads)
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
            # never list the known scopes: they are other tenants' names
            raise BadRequest(f"unknown scope {scope!r}: nothing was ingested into it", 404)
        return index.search(vector, k)


def index_path(directory: Path, scope: str) -> Path:
    """File of a scope's saved index: scope names may hold '/' and ':', so the name is a digest."""
    return directory / f"{hashlib.blake2b(scope.encode(), digest_size=12).hexdigest()}.usearch"
