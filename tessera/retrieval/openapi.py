"""The OpenAPI 3.1 document of the retrieval role's public API (``GET /openapi.json``).

Each public endpoint is one :class:`Operation`: method, path, the type of its request body
and of its replies. The types are the ones the handlers speak (the :mod:`~tessera.retrieval.api`
dataclasses, the chat API's pydantic models), and pydantic writes their JSON schemas, so
the document cannot drift from the bodies. :data:`PUBLIC_OPERATIONS` are the retrieval
API's own endpoints; the chat endpoint's operation comes from
:mod:`~tessera.retrieval.chat.response`, which owns its models, through :func:`document`.

This module knows nothing about aiohttp or a running role; ``tests/test_api_fuzz.py``
checks that every route the public application serves is described here, and fuzzes the
document against a running cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter

from tessera.retrieval import api
from tessera.units import UNIT_ID_PATTERN

OPENAPI_VERSION = "3.1.0"
BEARER = "apiKey"  # the security scheme's name in components.securitySchemes


class ApiError(BaseModel):
    """The retrieval API's error body (the chat API keeps OpenAI's shape)."""

    error: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str


class ModelList(BaseModel):
    """``GET /v1/models``: the one served model, OpenAI's shape."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


@dataclass(frozen=True)
class EventStream:
    """A ``text/event-stream`` reply: each event's ``data`` is one of ``events`` as JSON, or ``done``."""

    events: tuple[Any, ...]
    done: str = "[DONE]"


@dataclass(frozen=True)
class Link:
    """An OpenAPI link: a success reply's values that a follow-up call to (method, path) may use.

    ``parameters`` and the values of ``body`` are runtime expressions such as
    ``$response.body#/units/0/unit_id``; ``body`` is merged into the follow-up's request body.
    Stateful fuzzers follow links (ingest, then get, delete or retrieve what was ingested). No
    link leads to ``POST /v1/units/delete``: a fuzzer cannot tell that it deletes the units a
    later GET of the same ingest asks for, and would report their 404 as a lost unit.
    """

    method: str
    path: str
    parameters: Mapping[str, str] = field(default_factory=dict)
    body: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Operation:
    """One public endpoint: what it takes and what it answers.

    ``ok`` maps each media type of the 200 reply to its body type (an :class:`EventStream` for
    server-sent events); ``errors`` maps each error status to when it is sent, each with an
    ``error_body``. ``authenticated``: needs an API key when the role has ``security.keys_file``
    (every endpoint but the health checks).
    """

    method: str
    path: str
    summary: str
    ok: Mapping[str, Any]
    errors: Mapping[int, str]
    body: Any = None  # the request body's type; None: no body
    error_body: Any = ApiError
    path_params: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # name -> (description, regex)
    authenticated: bool = True
    links: Mapping[str, Link] = field(default_factory=dict)  # name -> link from the success reply


JSON = "application/json"
LOADING = "the role is still loading its tokenizer and embedder"
NOT_READY = "not ready: still loading, no generation node alive, or no leader elected (the reason says which)"
NO_KEY = "missing or unknown API key (with security.keys_file)"
NOT_YOURS = "the API key's tenant does not own the scope"
UNIT_ID = {"unit_id": ("a unit id returned by POST /v1/units", UNIT_ID_PATTERN)}
INGESTED_ID = {"unit_id": "$response.body#/units/0/unit_id"}
INGESTED_SCOPE = {"scope": "$response.body#/units/0/scope"}

PUBLIC_OPERATIONS: tuple[Operation, ...] = (
    Operation("get", "/health", "readiness (as /health/ready): 200 when a chat can be served through this process",
              {JSON: api.Health}, {503: NOT_READY}, error_body=api.Health, authenticated=False),
    Operation("get", "/health/ready", "readiness: 200 when a chat can be served through this process",
              {JSON: api.Health}, {503: NOT_READY}, error_body=api.Health, authenticated=False),
    Operation("get", "/health/live", "liveness: 200 while the process serves HTTP", {JSON: api.Health}, {},
              authenticated=False),
    Operation("post", "/v1/units", "ingest (or update by external_id) units; returns their ids and token counts",
              {JSON: api.IngestResponse},
              {400: "a body or unit that does not fit (the message names the field)", 401: NO_KEY, 403: NOT_YOURS,
               413: "too many units in one call, or a unit longer than retrieval.max_unit_tokens", 503: LOADING},
              body=api.IngestRequest,
              links={"GetUnit": Link("get", "/v1/units/{unit_id}", INGESTED_ID),
                     "DeleteUnit": Link("delete", "/v1/units/{unit_id}", INGESTED_ID),
                     "Retrieve": Link("post", "/v1/retrieve", body=INGESTED_SCOPE),
                     "Chat": Link("post", "/v1/chat/completions", body={
                         "retrieval": {"query": "what do the records say?", **INGESTED_SCOPE}})}),
    Operation("get", "/v1/units/{unit_id}", "one stored unit", {JSON: api.StoredUnitBody},
              {401: NO_KEY, 404: "no such unit (never stored, deleted, or another tenant's)", 503: LOADING},
              path_params=UNIT_ID),
    Operation("delete", "/v1/units/{unit_id}", "revoke one unit (200 again if it is already deleted)",
              {JSON: api.DeleteResponse},
              {401: NO_KEY, 404: "no such unit was ever stored (or it is another tenant's)", 503: LOADING},
              path_params=UNIT_ID),
    Operation("post", "/v1/units/delete", "revoke every unit of a scope whose metadata has all of filter",
              {JSON: api.DeleteResponse}, {400: "a body that does not fit", 401: NO_KEY, 403: NOT_YOURS,
                                           503: LOADING},
              body=api.DeleteRequest),
    Operation("post", "/v1/retrieve", "top-k units of a scope for a query text or an embedding (exactly one)",
              {JSON: api.RetrieveResponse},
              {400: "a body that does not fit (the message names the field)", 401: NO_KEY, 403: NOT_YOURS,
               404: "nothing was ever ingested into the scope", 503: LOADING},
              body=api.RetrieveRequest),
    Operation("get", "/v1/models", "the served model", {JSON: ModelList}, {401: NO_KEY}),
    Operation("get", "/metrics", "Prometheus metrics", {"text/plain": str},
              {401: NO_KEY, 403: "needs an admin API key (with security.keys_file)"}),
    Operation("get", "/openapi.json", "this document", {JSON: dict[str, Any]}, {401: NO_KEY}),
)


def operation_id(method: str, path: str) -> str:
    """``post``, ``/v1/units/{unit_id}`` -> ``post_v1_units_unit_id``."""
    return method + path.replace("/", "_").replace("{", "").replace("}", "")


def _link(link: Link) -> dict[str, Any]:
    out: dict[str, Any] = {"operationId": operation_id(link.method, link.path)}
    if link.parameters:
        out["parameters"] = dict(link.parameters)
    if link.body is not None:
        out["requestBody"] = dict(link.body)
    return out


def _types(op: Operation) -> Iterator[Any]:
    for tp in (op.body, op.error_body, *op.ok.values()):
        if isinstance(tp, EventStream):
            yield from tp.events
        elif tp is not None:
            yield tp


def _schemas(operations: Iterable[Operation]) -> tuple[dict[int, Any], dict[str, Any]]:
    """id of a type -> its schema (a $ref for models), and every model's definition."""
    types = {id(tp): tp for op in operations for tp in _types(op)}
    refs, defs = TypeAdapter.json_schemas([(key, "validation", TypeAdapter(tp)) for key, tp in types.items()],
                                          ref_template="#/components/schemas/{model}")
    return {key: schema for (key, _), schema in refs.items()}, defs.get("$defs", {})


def _event_schema(stream: EventStream, schemas: Mapping[int, Any]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1: a stream's ``schema`` describes each event)."""
    data = [{"const": stream.done}, *({"contentMediaType": JSON, "contentSchema": schemas[id(tp)]}
                                      for tp in stream.events)]
    return {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", "anyOf": data}}}


def _operation(op: Operation, schemas: Mapping[int, Any]) -> dict[str, Any]:
    """One operation object of ``paths``."""

    def content(by_media: Mapping[str, Any]) -> dict[str, Any]:
        return {media: {"schema": _event_schema(tp, schemas) if isinstance(tp, EventStream) else schemas[id(tp)]}
                for media, tp in by_media.items()}

    ok: dict[str, Any] = {"description": "success", "content": content(op.ok)}
    if op.links:
        ok["links"] = {name: _link(link) for name, link in op.links.items()}
    entry: dict[str, Any] = {
        "summary": op.summary,
        "operationId": operation_id(op.method, op.path),
        "responses": {"200": ok} | {str(status): {"description": why, "content": content({JSON: op.error_body})}
                                    for status, why in sorted(op.errors.items())},
    }
    if op.path_params:
        entry["parameters"] = [{"name": name, "in": "path", "required": True, "description": why,
                                "schema": {"type": "string", "pattern": f"^{pattern}$"}}
                               for name, (why, pattern) in op.path_params.items()]
    if op.body is not None:
        entry["requestBody"] = {"required": True, "content": content({JSON: op.body})}
    if op.authenticated:
        entry["security"] = [{BEARER: []}]
    return entry


def document(title: str, operations: Iterable[Operation]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the public operations plus ``operations`` (the chat endpoint)."""
    ops = (*PUBLIC_OPERATIONS, *operations)
    schemas, defs = _schemas(ops)
    paths: dict[str, dict[str, Any]] = {}
    for op in ops:
        paths.setdefault(op.path, {})[op.method] = _operation(op, schemas)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {
            "schemas": defs,
            "securitySchemes": {BEARER: {
                "type": "http", "scheme": "bearer",
                "description": "Authorization: Bearer <key>, when the role has security.keys_file "
                               "(a cluster on loopback without keys serves every request)"}},
        },
    }
