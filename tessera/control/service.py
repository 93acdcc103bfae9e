"""The retrieval role's HTTP service (aiohttp + orjson): retrieval API and control RPCs.

``build_app(config)`` returns the application with the :class:`RetrievalNode` stored at
``app[RETRIEVAL_NODE]``; the serving layer adds its OpenAI-compatible routes to the same
app. Bodies are typed dataclasses decoded with :func:`tessera.wire.decode`, so malformed
JSON or a wrong type is a 400 naming the field; every error body is ``{"error": message}``.

Endpoints (all JSON):

=====================  ======================================================================
GET  /health           200 {"status": "ready"} once the tokenizer and embedder are loaded
POST /v1/units         ingest units -> ids and token counts
POST /v1/retrieve      top-k units of a scope for a query text or embedding
POST /control/route    step 1 of a plan: choose the generation node
POST /control/plan     step 4: finalize the per-unit plan against the node's snapshot
POST /control/complete the request finished (in-flight accounting)
POST /control/publish  writer finished a shared entry (409 + reason when rejected)
POST /control/cancel   writer gives up a reservation
POST /control/release  reader releases read leases
POST /control/residency  a generation node's local cache changed
POST /control/load     a generation node's load figures (its heartbeat)
POST /control/kvpool/hello  a memory node announces itself (its heartbeat)
GET  /control/kvpool   the registered memory nodes' hellos
GET  /control/stats    counters of the control plane
=====================  ======================================================================
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from aiohttp import web

from tessera.config import ClusterConfig
from tessera.control import api
from tessera.control.node import RetrievalNode
from tessera.errors import BadRequest, ModelLoadError, Overloaded, PublishRejected
from tessera.messages import (
    Ack,
    CancelRequest,
    LoadReport,
    MemoryNodeHello,
    PublishRequest,
    ReleaseRequest,
    ResidencyReport,
    check_version,
)
from tessera.runtime import run, serve
from tessera.wire import WIRE_VERSION, decode, encode

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRIEVAL_NODE = web.AppKey("retrieval_node", RetrievalNode)
MAX_BODY = 64 << 20
MAX_INGEST = 4096  # units per ingest call
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def reply(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=encode(obj), status=status, content_type="application/json")


def error(status: int, message: str) -> web.Response:
    return web.Response(body=orjson.dumps({"error": message}), status=status, content_type="application/json")


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Client mistakes become 4xx with a message; nothing escapes as a bare traceback."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return error(exc.status, str(exc))
    except PublishRejected as exc:
        return reply(Ack(WIRE_VERSION, False, str(exc)), status=409)
    except Overloaded as exc:
        return error(503, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error(exc.status, exc.reason or exc.text or "error")
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return error(500, f"internal error: {type(exc).__name__}: {exc}")


async def body(request: web.Request, cls: type[T]) -> T:
    msg = decode(cls, await request.read())
    check_version(msg.version)  # type: ignore[attr-defined]
    return msg


def state(request: web.Request) -> RetrievalNode:
    return request.app[RETRIEVAL_NODE]


def ready(request: web.Request) -> RetrievalNode:
    node = state(request)
    if not node.ready:
        raise Overloaded("the retrieval node is still loading its tokenizer and embedder; retry shortly")
    return node


routes = web.RouteTableDef()


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
    done = await ready(request).ingest([(u.scope, u.text, u.metadata) for u in msg.units],
                                       [u.embedding for u in msg.units])
    return reply(api.IngestResponse(WIRE_VERSION, tuple(
        api.IngestedUnit(unit.unit_id, unit.scope, unit.n_tokens, new) for unit, new in done)))


@routes.post("/v1/retrieve")
async def retrieve(request: web.Request) -> web.Response:
    msg = await body(request, api.RetrieveRequest)
    hits = await ready(request).retrieve(msg.scope, query=msg.query, embedding=msg.embedding, top_k=msg.top_k)
    return reply(api.RetrieveResponse(WIRE_VERSION, msg.scope, tuple(
        api.RetrievedUnit(h.unit.unit_id, h.unit.scope, h.unit.text, h.unit.n_tokens, h.score, dict(h.metadata))
        for h in hits)))


@routes.post("/control/route")
async def route(request: web.Request) -> web.Response:
    msg = await body(request, api.RouteRequest)
    if not msg.request_id:
        raise BadRequest("request_id is empty")
    if any(not u.unit_id for u in msg.units):
        raise BadRequest("units: every unit needs a non-empty unit_id")
    node = state(request).plane.route(msg.request_id, [(u.unit_id, u.n_tokens) for u in msg.units])
    return reply(api.RouteResponse(WIRE_VERSION, msg.request_id, node))


@routes.post("/control/plan")
async def plan(request: web.Request) -> web.Response:
    msg = await body(request, api.PlanRequest)
    plane = state(request).plane
    plane.generation_node(msg.node)  # unknown node -> 404 naming it
    return reply(plane.finalize(msg.request_id, msg.node, msg.held))


@routes.post("/control/complete")
async def complete(request: web.Request) -> web.Response:
    msg = await body(request, api.CompleteRequest)
    done = state(request).plane.complete(msg.request_id)
    return reply(Ack(WIRE_VERSION, done, "" if done else f"request {msg.request_id!r} was not outstanding"))


def _rpc(path: str, cls: type[Any], verb: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        msg = await body(request, cls)
        return reply(getattr(state(request).plane, verb)(msg))

    handler.__name__ = verb
    routes.post(path)(handler)


_rpc("/control/publish", PublishRequest, "publish")
_rpc("/control/cancel", CancelRequest, "cancel")
_rpc("/control/release", ReleaseRequest, "release")
_rpc("/control/residency", ResidencyReport, "residency")
_rpc("/control/load", LoadReport, "load")
_rpc("/control/kvpool/hello", MemoryNodeHello, "hello")


@routes.get("/control/kvpool")
async def kvpool(request: web.Request) -> web.Response:
    return reply(api.MemoryNodeList(WIRE_VERSION, tuple(state(request).plane.memory_nodes())))


@routes.get("/control/stats")
async def stats(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(state(request).stats()), content_type="application/json")


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    node = app[RETRIEVAL_NODE]
    await node.start()
    yield
    await node.stop()


def build_app(config: ClusterConfig, node: RetrievalNode | None = None) -> web.Application:
    """The retrieval role's application; its state is ``app[RETRIEVAL_NODE]``."""
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY)
    app[RETRIEVAL_NODE] = node or RetrievalNode(config)
    app.cleanup_ctx.append(_lifecycle)
    app.add_routes(routes)
    return app


def run_retrieval(config: ClusterConfig) -> int:
    """Entry point of ``tessera run --role retrieval``."""

    async def main() -> int:
        app = build_app(config)
        return await serve(app, config.retrieval.host, config.retrieval.port, name="retrieval")

    try:
        return run(main)
    except ModelLoadError as exc:
        print(f"tessera retrieval: {exc}", file=sys.stderr)
        return 3
