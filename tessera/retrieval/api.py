"""Typed request/response bodies of the retrieval role's HTTP API.

The control RPCs (route, plan, complete, publish, ...) live in :mod:`tessera.messages`;
this module holds the bodies only the retrieval API speaks.
Every body carries ``version`` (see :func:`tessera.messages.check_version`); on the three
request bodies a client sends by hand (ingest, delete, retrieve) it may be left out and means
the current version, as OpenAI-style APIs carry no version field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.wire import WIRE_VERSION


@dataclass(frozen=True, slots=True)
class IngestUnit:
    scope: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    # a precomputed embedding (the embedder's dimension); computed here when absent
    embedding: tuple[float, ...] | None = None
    # caller's key, unique per scope: new text under a known key replaces (revokes) its old unit
    external_id: str | None = None


@dataclass(frozen=True, slots=True)
class IngestRequest:
    version: int = field(default=WIRE_VERSION, kw_only=True)  # optional: missing = current
    units: tuple[IngestUnit, ...]


@dataclass(frozen=True, slots=True)
class IngestedUnit:
    unit_id: str
    scope: str
    n_tokens: int
    new: bool  # False: the same unit (same scope and tokens) was already indexed


@dataclass(frozen=True, slots=True)
class IngestResponse:
    version: int
    units: tuple[IngestedUnit, ...]
    revoked: tuple[str, ...] = ()  # units replaced by a new text under their external_id


@dataclass(frozen=True, slots=True)
class StoredUnitBody:
    """``GET /v1/units/{unit_id}``."""

    version: int
    unit_id: str
    scope: str
    text: str
    n_tokens: int
    metadata: dict[str, Any] = field(default_factory=dict)
    external_id: str | None = None


@dataclass(frozen=True, slots=True)
class DeleteRequest:
    """``POST /v1/units/delete``: every unit of ``scope`` whose metadata has all of ``filter``."""

    version: int = field(default=WIRE_VERSION, kw_only=True)  # optional: missing = current
    scope: str
    filter: dict[str, Any] = field(default_factory=dict)  # {} deletes the whole scope


@dataclass(frozen=True, slots=True)
class DeleteResponse:
    version: int
    deleted: tuple[str, ...]  # revoked by this call
    already: tuple[str, ...] = ()  # revoked earlier (deletes are idempotent)


@dataclass(frozen=True, slots=True)
class RetrieveRequest:
    version: int = field(default=WIRE_VERSION, kw_only=True)  # optional: missing = current
    scope: str
    query: str | None = None  # exactly one of query and embedding
    embedding: tuple[float, ...] | None = None
    top_k: int = 0  # 0: retrieval.top_k


@dataclass(frozen=True, slots=True)
class RetrievedUnit:
    unit_id: str
    scope: str
    text: str
    n_tokens: int
    score: float  # cosine similarity, higher is closer
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RetrieveResponse:
    version: int
    scope: str
    units: tuple[RetrievedUnit, ...]


@dataclass(frozen=True, slots=True)
class Health:
    version: int
    status: str  # "ready" | "loading"
    role: str = "retrieval"
