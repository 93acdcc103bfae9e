"""The retrieval role's own API: health, ingest and retrieve.

=========================  ==================================================================
GET    /health             200 {"status": "ready"} once the tokenizer, embedder and store are loaded
POST   /v1/units           ingest (or update by external_id) units -> ids and token counts
GET    /v1/units/{id}      one stored unit (404 if unknown or deleted)
DELETE /v1/units/{id}      revoke one unit (200 again if already deleted, 404 if never stored)
POST   /v1/units/delete    revoke every unit of a scope matching a metadata filter
POST   /v1/retrieve        top-k units of a scope for a query text or embedding
POST   /control/kvpool/inventory   a memory node's verified blocks after this role restarted
=========================  ==================================================================

A delete is acknowledged only once it is committed, the unit left the index, the control
plane revoked it and the generation nodes were told (see RetrievalNode).
"""

from __future__ import annotations

from aiohttp import web

from tessera.errors import BadRequest, Unavailable
from tessera.http import body, reply
from tessera.messages import MemoryNodeInventory
from tessera.retrieval import api
from tessera.retrieval.limits import check_metadata
from tessera.retrieval.node import RetrievalNode
from tessera.retrieval.store import StoredUnit
from tessera.tenants import tenant_of
from tessera.units import UNIT_ID_PATTERN
from tessera.wire import WIRE_VERSION

RETRIEVAL_NODE = web.AppKey("retrieval_node", RetrievalNode)
# only a unit id matches, so /v1/units/delete is not a unit path (GET on it is a 405, not "no such unit")
UNIT_PATH = f"/v1/units/{{unit_id:{UNIT_ID_PATTERN}}}"
MAX_INGEST = 4096  # units per ingest call

routes = web.RouteTableDef()


def state(request: web.Request) -> RetrievalNode:
    return request.app[RETRIEVAL_NODE]


def ready(request: web.Request) -> RetrievalNode:
    node = state(request)
    if not node.ready:
        raise Unavailable("the retrieval node is still loading its tokenizer and embedder; retry shortly")
    return node


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    ok = state(request).ready
    return reply(api.Health(WIRE_VERSION, "ready" if ok else "loading"), status=200 if ok else 503)


@routes.post("/v1/units")
async def ingest(request: web.Request) -> web.Response:
    msg = await body(request, api.IngestRequest)
    if not msg.units:
        raise BadRequest("units is empty; send at least one {scope, text} unit")
    if len(msg.units) > MAX_INGEST:
        raise BadRequest(f"{len(msg.units)} units in one call; send at most {MAX_INGEST} per call", 413)
    tenant = tenant_of(request)
    for i, u in enumerate(msg.units):
        tenant.check_scope(u.scope, f"units[{i}].scope")
        check_metadata(f"units[{i}]", u.metadata)
    done = await ready(request).ingest([(u.scope, u.text, u.metadata) for u in msg.units],
                                       [u.embedding for u in msg.units], [u.external_id for u in msg.units],
                                       tenant.name)
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
    node = ready(request)
    if await node.get(unit_id) is not None and await _owned(request, unit_id) is None:
        # another tenant's unit: answered like an unknown id, so ids of others are not confirmed
        raise BadRequest(f"no unit {unit_id!r} was ever stored here; nothing to delete", 404)
    done = await node.delete([unit_id])
    if done.unknown:
        raise BadRequest(f"no unit {unit_id!r} was ever stored here; nothing to delete", 404)
    return reply(api.DeleteResponse(WIRE_VERSION, done.deleted, done.already))


@routes.post("/v1/units/delete")
async def delete_units(request: web.Request) -> web.Response:
    msg = await body(request, api.DeleteRequest)
    tenant = tenant_of(request)
    tenant.check_scope(msg.scope)
    done = await ready(request).delete_where(msg.scope, msg.filter, tenant.name)
    return reply(api.DeleteResponse(WIRE_VERSION, done.deleted))


@routes.post("/v1/retrieve")
async def retrieve(request: web.Request) -> web.Response:
    msg = await body(request, api.RetrieveRequest)
    tenant = tenant_of(request)
    tenant.check_scope(msg.scope)
    hits = await ready(request).retrieve(msg.scope, query=msg.query, embedding=msg.embedding, top_k=msg.top_k,
                                         tenant=tenant.name)
    return reply(api.RetrieveResponse(WIRE_VERSION, msg.scope, tuple(
        api.RetrievedUnit(h.unit.unit_id, h.unit.scope, h.unit.text, h.unit.n_tokens, h.score, dict(h.metadata))
        for h in hits)))


internal_routes = web.RouteTableDef()  # served on the internal plane with the control routes


@internal_routes.post("/control/kvpool/inventory")
async def inventory(request: web.Request) -> web.Response:
    msg = await body(request, MemoryNodeInventory)
    return reply(await ready(request).adopt(msg))
