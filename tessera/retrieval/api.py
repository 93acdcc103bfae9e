"""Typed request/response bodies of the retrieval role's HTTP API.

The control RPCs (route, plan, complete, publish, ...) live in :mod:`tessera.messages`;
this module holds the bodies only the retrieval API speaks.
Every body carries ``version`` (see :func:`tessera.messages.common.check_version`); on the three
request bodies a client sends by hand (ingest, delete, retrieve) it may be left out and means
the current version, as OpenAI-style APIs carry no version field.

The request bodies are decoded closed (:func:`tessera.wire.from_wire`): a field they do not
have is refused with a 400 naming it (``retrieval.allow_unknown_fields`` lets it through), and
their schemas say ``additionalProperties: false`` (:data:`CLOSED`).

The ``Annotated`` constraints (pydantic ``Field``) describe what the handlers accept, for
the served OpenAPI document (:mod:`tessera.retrieval.openapi`); the wire decoder reads the
plain types only and the handlers check the rest, so the two must be kept in step
(``tests/test_api_fuzz.py`` fuzzes the served document against the running role).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from tessera.retrieval.store.index import SCOPE_PATTERN
from tessera.retrieval.store.unit_store import MAX_EXTERNAL_ID, MAX_TOP_K
from tessera.wire import WIRE_VERSION

Version = Annotated[int, Field(ge=WIRE_VERSION, le=WIRE_VERSION, description="wire version of the body")]
Scope = Annotated[str, Field(pattern=f"^{SCOPE_PATTERN.pattern}$", description="the sharing scope (tenant-owned)")]
# a text with something besides whitespace in it (a blank unit is refused)
Text = Annotated[str, Field(pattern=r"\S")]
ExternalId = Annotated[str, Field(min_length=1, max_length=MAX_EXTERNAL_ID)]
TopK = Annotated[int, Field(ge=0, le=MAX_TOP_K, description="units to return; 0 = retrieval.top_k")]
Embedding = Annotated[tuple[float, ...], Field(description="a vector of the embedder's dimension, finite, non-zero")]
CLOSED = ConfigDict(extra="forbid")  # the schema of a request body: unknown fields are refused


@dataclass(frozen=True, slots=True)
class IngestUnit:
    __pydantic_config__ = CLOSED
    scope: Scope
    text: Text
    metadata: dict[str, Any] = field(default_factory=dict)
    # a precomputed embedding (the embedder's dimension); computed here when absent
    embedding: Embedding | None = None
    # caller's key, unique per scope: new text under a known key replaces (revokes) its old unit
    external_id: ExternalId | None = None


@dataclass(frozen=True, slots=True)
class IngestRequest:
    __pydantic_config__ = CLOSED
    version: Version = field(default=WIRE_VERSION, kw_only=True)  # optional: missing = current
    units: Annotated[tuple[IngestUnit, ...], Field(min_length=1)]  # at most routes.MAX_INGEST


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

    __pydantic_config__ = CLOSED
    version: Version = field(default=WIRE_VERSION, kw_only=True)  # optional: missing = current
    scope: Scope
    filter: dict[str, Any] = field(default_factory=dict)  # {} deletes the whole scope


@dataclass(frozen=True, slots=True)
class DeleteResponse:
    version: int
    deleted: tuple[str, ...]  # revoked by this call
    already: tuple[str, ...] = ()  # revoked earlier (deletes are idempotent)


@dataclass(frozen=True, slots=True)
class RetrieveRequest:
    # exactly one of query and embedding, for the OpenAPI document (the store checks it)
    __pydantic_config__ = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["query"], "properties": {"query": {"type": "string"}, "embedding": {"type": "null"}}},
        {"required": ["embedding"], "properties": {"embedding": {"type": "array"}, "query": {"type": "null"}}}]})
    version: Version = field(default=WIRE_VERSION, kw_only=True)  # optional: missing = current
    scope: Scope
    query: Text | None = None  # exactly one of query and embedding
    embedding: Embedding | None = None
    top_k: TopK = 0  # 0: retrieval.top_k


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
    """``GET /health/live`` (status "live") and ``GET /health``, ``/health/ready`` ("ready", or "unready")."""

    version: int
    status: str  # "live" | "ready" | "unready"
    role: str = "retrieval"
    reason: str = ""  # why not ready: what chat would answer now
