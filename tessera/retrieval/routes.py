"""The retrieval role's own API: health, ingest and retrieve.

=====================  ======================================================================
GET  /health           200 {"status": "ready"} once the tokenizer and embedder are loaded
POST /v1/units         ingest units -> ids and token counts
POST /v1/retrieve      top-k units of a scope for a query text or embedding
=====================  ======================================================================
"""

from __future__ import annotations

from aiohttp import web

from tessera.errors import BadRequest, Unavailable
from tessera.http import body, reply
from tessera.retrieval import api
from tessera.retrieval.node import RetrievalNode
from tessera.tenants import tenant_of
from tessera.wire import WIRE_VERSION

RETRIEVAL_NODE = web.AppKey("retrieval_node", RetrievalNode)
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
    done = await ready(request).ingest([(u.scope, u.text, u.metadata) for u in msg.units],
                                       [u.embedding for u in msg.units], tenant.name)
    return reply(api.IngestResponse(WIRE_VERSION, tuple(
        api.IngestedUnit(unit.unit_id, unit.scope, unit.n_tokens, new) for unit, new in done)))


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
