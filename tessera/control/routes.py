"""The control plane's RPCs (``/control/*``) on the retrieval role's aiohttp app.

Bodies are typed dataclasses decoded with :func:`tessera.http.body`, so malformed JSON or a
wrong type is a 400 naming the field; every error body is ``{"error": message}``.

=====================  ======================================================================
POST /control/route    step 2: choose the generation node (paper Fig. 10)
POST /control/plan     step 4: finalize the per-unit plan against the node's snapshot
POST /control/complete the request finished (in-flight accounting)
POST /control/suspect  a follower could not reach a generation node: it leaves routing (``[ha]``)
POST /control/liveness what the heartbeats say of generation nodes (a follower's deadlines, ``[ha]``)
POST /control/units    another replica revoked / re-ingested units (``[ha]``)
POST /control/publish  writer finished a shared entry (409 + reason when rejected)
POST /control/cancel   writer gives up a reservation
POST /control/renew    writer about to write: its grant extended, or a new one if it lapsed
POST /control/lease    a node about to compute a unit planned long ago: a lease if it is READY now
POST /control/release  reader releases read leases
POST /control/residency  a generation node's local cache changed
POST /control/load     a generation node's load figures (its heartbeat)
POST /control/kvpool/hello  a memory node announces itself (its heartbeat)
GET  /control/kvpool   the registered memory nodes' hellos
GET  /control/stats    counters of the control plane
=====================  ======================================================================

These routes live on the *internal* listener only, behind the cluster-secret middleware of
:mod:`tessera.auth`. The request path (route, plan, complete) is a supported remote API that
gives the same plans as the in-process plane. The routes see only the :class:`ControlPlane`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from tessera.control.pace import first_token_deadline_s
from tessera.control.plane import ControlPlane
from tessera.errors import BadRequest
from tessera.http import body, reply
from tessera.messages.common import Ack
from tessera.messages.control import (
    CancelRequest,
    CompleteRequest,
    InvalidateRequest,
    LateLeaseRequest,
    LivenessReport,
    LivenessRequest,
    LoadReport,
    NodeLiveness,
    PlanRequest,
    PublishRequest,
    ReleaseRequest,
    RenewRequest,
    ResidencyReport,
    RouteRequest,
    RouteResponse,
    SuspectRequest,
    UnitsChanged,
)
from tessera.messages.kvpool import MemoryNodeHello, MemoryNodeList
from tessera.wire import WIRE_VERSION

# the plane the routes serve, asked per request: a replica that does not lead (or no longer
# leads) raises Unavailable (503), so nothing is issued under a term it does not hold
PlaneSource = Callable[[], ControlPlane]
CONTROL_PLANE: web.AppKey[PlaneSource] = web.AppKey("control_plane")
StatsExtra = Callable[[], dict[str, Any]]
STATS_EXTRA: web.AppKey[StatsExtra] = web.AppKey("control_stats_extra")

routes = web.RouteTableDef()


def _plane(request: web.Request) -> ControlPlane:
    return request.app[CONTROL_PLANE]()


@routes.post("/control/route")
async def route(request: web.Request) -> web.Response:
    msg = await body(request, RouteRequest)
    if not msg.request_id:
        raise BadRequest("request_id is empty")
    if any(not u.unit_id for u in msg.units):
        raise BadRequest("units: every unit needs a non-empty unit_id")
    plane = _plane(request)
    node = plane.route(msg.request_id, [(u.unit_id, u.n_tokens) for u in msg.units], msg.exclude, msg.waited_s)
    deadline_s = 0.0
    if msg.prompt_tokens > 0:
        deadline_s = first_token_deadline_s(plane.generation_node(node), msg.prompt_tokens,
                                            plane.config.control.first_token_timeout_s)
    return reply(RouteResponse(WIRE_VERSION, msg.request_id, node, deadline_s))


@routes.post("/control/plan")
async def plan(request: web.Request) -> web.Response:
    msg = await body(request, PlanRequest)
    plane = _plane(request)
    plane.generation_node(msg.node)  # unknown node -> 404 naming it
    return reply(plane.finalize(msg.request_id, msg.node, msg.held))


@routes.post("/control/complete")
async def complete(request: web.Request) -> web.Response:
    msg = await body(request, CompleteRequest)
    done = _plane(request).complete(msg.request_id)
    return reply(Ack(WIRE_VERSION, done, "" if done else f"request {msg.request_id!r} was not outstanding"))


@routes.post("/control/suspect")
async def suspect(request: web.Request) -> web.Response:
    """A follower's request failed on the node: the plane treats it as its own path would (``suspect``)."""
    msg = await body(request, SuspectRequest)
    _plane(request).suspect(msg.node)  # unknown node -> 404 naming it
    return reply(Ack(WIRE_VERSION, True))


@routes.post("/control/liveness")
async def liveness(request: web.Request) -> web.Response:
    """Alive, and seconds since the last heartbeat and since the last one that showed prompt work
    run, of each named node: the leader's view is the authority."""
    msg = await body(request, LivenessRequest)
    plane = _plane(request)
    now = plane.clock()

    def ago(t: float | None) -> float:
        return -1.0 if t is None else max(0.0, now - t)

    members = [plane.generation_node(name) for name in msg.nodes]
    return reply(LivenessReport(WIRE_VERSION, tuple(
        NodeLiveness(m.name, m.alive, ago(m.last_seen), ago(m.progressed_at)) for m in members)))


def _rpc(path: str, cls: type[Any], verb: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        msg = await body(request, cls)
        return reply(getattr(_plane(request), verb)(msg))

    handler.__name__ = verb
    routes.post(path)(handler)


_rpc("/control/publish", PublishRequest, "publish")
_rpc("/control/cancel", CancelRequest, "cancel")
_rpc("/control/renew", RenewRequest, "renew")
_rpc("/control/lease", LateLeaseRequest, "late_lease")
_rpc("/control/release", ReleaseRequest, "release")
_rpc("/control/invalidate", InvalidateRequest, "invalidate")
_rpc("/control/residency", ResidencyReport, "residency")
_rpc("/control/load", LoadReport, "load")
_rpc("/control/kvpool/hello", MemoryNodeHello, "hello")


@routes.post("/control/units")
async def units(request: web.Request) -> web.Response:
    """Another replica revoked or re-ingested units in the shared store: this plane follows."""
    msg = await body(request, UnitsChanged)
    plane = _plane(request)
    plane.revoke(msg.revoked)
    plane.reinstate(msg.reinstated)
    return reply(Ack(WIRE_VERSION, True))


@routes.get("/control/kvpool")
async def kvpool(request: web.Request) -> web.Response:
    return reply(MemoryNodeList(WIRE_VERSION, tuple(_plane(request).memory_nodes())))


@routes.get("/control/stats")
async def stats(request: web.Request) -> web.Response:
    out = _plane(request).report()
    extra = request.app.get(STATS_EXTRA)
    if extra is not None:
        out.update(extra())
    return web.Response(body=orjson.dumps(out), content_type="application/json")


def add_control_routes(app: web.Application, plane: ControlPlane | PlaneSource) -> None:
    """The routes on ``app``, serving ``plane`` (or, asked per request, the plane ``plane()`` holds now)."""
    app[CONTROL_PLANE] = (lambda: plane) if isinstance(plane, ControlPlane) else plane
    app.add_routes(routes)
