"""The unit-record contract: the verbs every durable unit store answers, and the rows it returns.

The records are the source of truth of the retrieval role; the per-scope ANN indexes are caches
of them. :class:`UnitRecordStore` is what :class:`~tessera.retrieval.store.unit_store.UnitStore`
calls; the embedded SQLite store (:mod:`~tessera.retrieval.store.sqlite`) and the shared
PostgreSQL store (:mod:`~tessera.retrieval.store.postgres`) both implement it, over the common
SQL of :mod:`~tessera.retrieval.store.sql`.

This module knows no database: no SQL, no connection, no file.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tessera.errors import TesseraError

SCHEMA_VERSION = 1
Update = tuple[str, Mapping[str, Any], str | None]  # (unit_id, new metadata, new external id or None to keep)


class StoreMismatch(TesseraError):
    """The store was written for another model, tokenizer or schema."""


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


class UnitRecordStore(Protocol):
    """The durable unit records of a retrieval role.

    Writes (``write``, ``revoke``) are one transaction each, all or nothing, and bump the version
    of every scope they touch in that transaction. A unit key is never reused after a delete.
    Reads see only live units, except ``revoked``/``tombstones``, which see the deleted ones.
    Opening a store raises :class:`StoreMismatch` when it was written for another serving
    fingerprint or schema. Called from one thread at a time.
    """

    directory: Path  # where this process keeps its files (the database, or a replica's index state)
    incarnation: int  # bumped at every opening; storage epochs derive from it so they never repeat

    def close(self) -> None: ...

    def write(self, fresh: Sequence[NewRecord], updates: Sequence[Update], replaced: Sequence[str]) -> list[int]:
        """One ingest batch: revoke ``replaced``, apply ``updates``, insert ``fresh``.

        Returns the index keys of ``fresh``, in order. An external id given to a unit is taken
        from any other live unit of its scope.
        """
        ...

    def revoke(self, unit_ids: Iterable[str]) -> None:
        """Delete these live units, leaving a tombstone each; unknown ids are ignored."""
        ...

    def mark_saved(self, scope: str, version: int) -> None:
        """This process's index file of ``scope`` now reflects ``version``."""
        ...

    def get(self, unit_id: str) -> Record | None: ...

    def by_keys(self, keys: Sequence[int]) -> dict[int, Record]:
        """key -> record of the live units among ``keys``."""
        ...

    def existing(self, unit_ids: Iterable[str]) -> dict[str, Existing]:
        """The live ones among ``unit_ids``."""
        ...

    def by_external(self, scope: str, external_id: str) -> str | None:
        """The live unit of ``scope`` holding ``external_id``."""
        ...

    def by_digest(self, digests: Iterable[str]) -> dict[str, tuple[str, int]]:
        """digest (hex) -> (unit_id, n_tokens) of the live units among ``digests``."""
        ...

    def revoked(self, unit_ids: Iterable[str] | None = None) -> set[str]:
        """The tombstoned ids (all of them, or those among ``unit_ids``)."""
        ...

    def tombstones(self, unit_ids: Iterable[str]) -> dict[str, str]:
        """unit_id -> scope of the tombstoned ids among ``unit_ids``."""
        ...

    def select(self, scope: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        """(unit_id, metadata) of every live unit of a scope."""
        ...

    def scopes(self) -> dict[str, tuple[int, int]]:
        """scope -> (version, the version this process's saved index file reflects, -1 if none)."""
        ...

    def scope_size(self, scope: str) -> int: ...

    def embeddings(self, scope: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys [N] uint64, vectors [N, dim] float32) of a scope in key order, to rebuild its index."""
        ...

    def keys(self, scope: str) -> np.ndarray:
        """Index keys of a scope's live units, [N] uint64."""
        ...

    def embeddings_of(self, keys: Sequence[int], dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys [N] uint64, vectors [N, dim] float32) of these units (missing ones skipped)."""
        ...

    def unit_ids(self) -> list[str]: ...

    def __len__(self) -> int: ...
