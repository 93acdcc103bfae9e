"""Health checks of the retrieval role's public listener, as load balancers and orchestrators read them.

=====================  ==========================================================================
GET /health/live       200 while the process serves HTTP (a liveness probe: restart it if this fails)
GET /health/ready      200 when a chat can be served through this process now, else 503 with the
                       reason (a readiness probe: send traffic only while this is 200)
GET /health            the same as ``/health/ready``: a load balancer's default check sends no
                       traffic before chat can be served
=====================  ==========================================================================

Ready means: the tokenizer, embedder and unit store are loaded, the chat API is started, and
a request can be routed: without ``[ha]`` (or on the leader) some generation node is alive in
the control plane; on a follower a leader is elected elsewhere
(:meth:`~tessera.retrieval.leadership.office.Office.unready`). Every check reads in-process
state only (no I/O), and none needs an API key (:data:`HEALTH_PATHS`, the public middleware's
open paths), so a probe costs a client nothing and reveals nothing beyond what it answers.

This module knows nothing about how requests are served; it reads the state others keep.
"""

from __future__ import annotations

from aiohttp import web

from tessera.http import reply
from tessera.retrieval import api
from tessera.retrieval.chat.routes import SERVING
from tessera.retrieval.routes import RETRIEVAL_NODE
from tessera.wire import WIRE_VERSION

HEALTH_PATHS = ("/health", "/health/live", "/health/ready")


def unready(app: web.Application) -> str | None:
    """Why a chat cannot be served through this process now, or None when it can."""
    node = app[RETRIEVAL_NODE]
    if not node.ready or not app[SERVING].ready:
        return "the retrieval role is still loading its tokenizer, embedder and unit store"
    return node.office.unready()


async def live(request: web.Request) -> web.Response:
    return reply(api.Health(WIRE_VERSION, "live"))


async def ready(request: web.Request) -> web.Response:
    why = unready(request.app)
    if why is None:
        return reply(api.Health(WIRE_VERSION, "ready"))
    return reply(api.Health(WIRE_VERSION, "unready", reason=why), status=503)


def add_health_routes(app: web.Application) -> None:
    """The checks on ``app``; call after the retrieval node and the chat API are on it."""
    app.router.add_get("/health", ready)
    app.router.add_get("/health/ready", ready)
    app.router.add_get("/health/live", live)
