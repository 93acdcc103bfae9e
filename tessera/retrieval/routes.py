"""The retrieval role's own API: ingest, retrieve and delete units.

=========================  ==================================================================
POST   /v1/units           ingest (or update by external_id) units -> ids and token counts
GET    /v1/units/{id}      one stored unit (404 if unknown or deleted)
DELETE /v1/units/{id}      revoke one unit (200 again if already deleted, 404 if never stored or another tenant's)
POST   /v1/units/delete    revoke every unit of a scope matching a metadata filter
POST   /v1/retrieve        top-k units of a scope for a query text or embedding
POST   /control/kvpool/inventory   a memory node's verified blocks after this role restarted
=========================  ==================================================================

The health checks (``/health``, ``/health/live``, ``/health/ready``) are in :mod:`tessera.retrieval.health`.

A delete is acknowledged only once it is committed, the unit left the index, the control
plane revoked it and the generation nodes were told (see RetrievalNode). A unit of another
tenant, live or deleted, is answered 404 like an id never stored: no reply confirms that
another tenant's id exists.

Ingest and retrieve bodies are checked before the typed decoder turns them into messages
(its cost is per array element): embeddings must have the embedder's dimension, a retrieve
body is bounded in bytes, and a unit's text in characters before it is tokenized (limits.py).
A field these bodies do not have is refused, naming the nearest known one, unless
``retrieval.allow_unknown_fields`` (:func:`client_body`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from tessera.errors import BadRequest, Unavailable
from tessera.http import body, reply
from tessera.messages.kvpool import MemoryNodeInventory
from tessera.retrieval import api
from tessera.retrieval.limits import (
    MAX_RETRIEVE_BODY_BYTES,
    check_body_size,
    check_metadata,
    check_unit_chars,
    check_vector,
)
from tessera.retrieval.node import RetrievalNode
from tessera.retrieval.store.unit_store import StoredUnit
from tessera.tenants import tenant_of
from tessera.units import UNIT_ID_PATTERN
from tessera.wire import WIRE_VERSION

RETRIEVAL_NODE = web.AppKey("retrieval_node", RetrievalNode)
# only a unit id matches, so /v1/units/delete is not a unit path (GET on it is a 405, not "no such unit")
UNIT_PATH = f"/v1/units/{{unit_id:{UNIT_ID_PATTERN}}}"
MAX_INGEST = 4096  # units per ingest call
T = TypeVar("T")

routes = web.RouteTableDef()


def state(request: web.Request) -> RetrievalNode:
    return request.app[RETRIEVAL_NODE]


def ready(request: web.Request) -> RetrievalNode:
    node = state(request)
    if not node.ready:
        raise Unavailable("the retrieval node is still loading its tokenizer and embedder; retry shortly")
    return node


async def client_body(request: web.Request, cls: type[T], check: Callable[[Any], None] | None = None,
                      limit: int | None = None, fix: str = "send a smaller body") -> T:
    """:func:`tessera.http.body` of a client's request: ``check`` runs on the raw JSON before the
    typed decode, and unknown fields are refused unless ``retrieval.allow_unknown_fields``.

    ``limit``: bytes of the body (413 naming ``fix`` past it); else the app's ``client_max_size``.
    """
    if limit is not None:
        check_body_size(request.content_length, limit, fix)
        check_body_size(len(await request.read()), limit, fix)  # a chunked body has no Content-Length
    return await body(request, cls, check, closed=not state(request).config.retrieval.allow_unknown_fields)


def _ingest_bounds(dim: int) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        units = value.get("units") if isinstance(value, dict) else None
        if not isinstance(units, list):
            return  # the typed decoder names what is wrong
        if len(units) > MAX_INGEST:
            raise BadRequest(f"{len(units)} units in one call; send at most {MAX_INGEST} per call", 413)
        for i, u in enumerate(units):
            if isinstance(u, dict):
                check_vector(f"units[{i}].embedding", u.get("embedding"), dim)
    return check


def _retrieve_bounds(dim: int) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if isinstance(value, dict):
            check_vector("embedding", value.get("embedding"), dim)
    return check


@routes.post("/v1/units")
async def ingest(request: web.Request) -> web.Response:
    node = ready(request)
    msg = await client_body(request, api.IngestRequest, _ingest_bounds(node.embedding_dim))
    if not msg.units:
        raise BadRequest("units is empty; send at least one {scope, text} unit")
    tenant = tenant_of(request)
    for i, u in enumerate(msg.units):  # all of them before any work: a refused batch writes nothing
        tenant.check_scope(u.scope, f"units[{i}].scope")
        check_unit_chars(f"units[{i}]", u.text, node.config.retrieval.max_unit_tokens)
        check_metadata(f"units[{i}]", u.metadata)
    done = await node.ingest([(u.scope, u.text, u.metadata) for u in msg.units],
                             [u.embedding for u in msg.units], [u.external_id for u in msg.units], tenant.name)
    return reply(api.IngestResponse(WIRE_VERSION, tuple(
        api.IngestedUnit(unit.unit_id, unit.scope, unit.n_tokens, new) for unit, new in done.units), done.revoked))


async def _owned(request: web.Request, unit_id: str) -> StoredUnit | None:
    """The stored unit if the caller's tenant owns it (its tenant and one of its scopes), else None."""
    found = await ready(request).get(unit_id)
    tenant = tenant_of(request)
    if found is None or found.unit.tenant != tenant.name or not tenant.allows(found.unit.scope):
        return None
    return found


@routes.get(UNIT_PATH)
async def get_unit(request: web.Request) -> web.Response:
    unit_id = request.match_info["unit_id"]
    found = await _owned(request, unit_id)
    if found is None:
        raise BadRequest(f"no unit {unit_id!r} is stored (never ingested, or deleted)", 404)
    u = found.unit
    return reply(api.StoredUnitBody(WIRE_VERSION, u.unit_id, u.scope, u.text, u.n_tokens, dict(found.metadata),
                                    found.external_id))


@routes.delete(UNIT_PATH)
async def delete_unit(request: web.Request) -> web.Response:
    unit_id = request.match_info["unit_id"]
    tenant = tenant_of(request)
    # another tenant's unit or tombstone counts as unknown: a 404, so ids of others are not confirmed
    done = await ready(request).delete([unit_id], lambda owner, scope: owner == tenant.name and tenant.allows(scope))
    if done.unknown:
        raise BadRequest(f"no unit {unit_id!r} was ever stored here; nothing to delete", 404)
    return reply(api.DeleteResponse(WIRE_VERSION, done.deleted, done.already))


@routes.post("/v1/units/delete")
async def delete_units(request: web.Request) -> web.Response:
    msg = await client_body(request, api.DeleteRequest)
    tenant = tenant_of(request)
    tenant.check_scope(msg.scope)
    done = await ready(request).delete_where(msg.scope, msg.filter, tenant.name)
    return reply(api.DeleteResponse(WIRE_VERSION, done.deleted))


@routes.post("/v1/retrieve")
async def retrieve(request: web.Request) -> web.Response:
    node = ready(request)
    msg = await client_body(request, api.RetrieveRequest, _retrieve_bounds(node.embedding_dim),
                            MAX_RETRIEVE_BODY_BYTES, "send one query text or one embedding")
    tenant = tenant_of(request)
    tenant.check_scope(msg.scope)
    hits = await node.retrieve(msg.scope, query=msg.query, embedding=msg.embedding, top_k=msg.top_k,
                               tenant=tenant.name)
    return reply(api.RetrieveResponse(WIRE_VERSION, msg.scope, tuple(
        api.RetrievedUnit(h.unit.unit_id, h.unit.scope, h.unit.text, h.unit.n_tokens, h.score, dict(h.metadata))
        for h in hits)))


internal_routes = web.RouteTableDef()  # served on the internal plane with the control routes


@internal_routes.post("/control/kvpool/inventory")
async def inventory(request: web.Request) -> web.Response:
    msg = await body(request, MemoryNodeInventory)
    return reply(await ready(request).adopt(msg))
