"""The retrieval role's process: control plane + retrieval API + the OpenAI-compatible API.

Two aiohttp applications on two listeners:

* the **public** API (``retrieval.host:port``): ``/v1/*`` (chat, models, units, retrieve),
  ``/metrics`` and the health checks (``/health``, ``/health/live``, ``/health/ready``:
  :mod:`tessera.retrieval.health`), for API clients; every request but the health checks
  carries an API key when ``security.keys_file`` is set (:mod:`tessera.tenants`);
* the **internal** plane (``retrieval.internal_host:internal_port``): ``/control/*``, the
  other roles' RPCs, each signed with the cluster secret (:mod:`tessera.auth`).

``/control/*`` does not exist on the public listener. The :class:`RetrievalNode` (control
plane + unit store) starts and stops in the public app's ``cleanup_ctx``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiohttp import web

from tessera.auth import ClusterAuth
from tessera.config import LOOPBACK_HOSTS, ClusterConfig
from tessera.control.observe import add_observe_routes
from tessera.control.routes import STATS_EXTRA, add_control_routes
from tessera.errors import ConfigError
from tessera.ha.replicas import replica_config, replica_index
from tessera.http import application
from tessera.retrieval.access_log import access_middleware
from tessera.retrieval.chat.routes import add_chat_routes
from tessera.retrieval.health import HEALTH_PATHS, add_health_routes
from tessera.retrieval.node import RetrievalNode
from tessera.retrieval.routes import RETRIEVAL_NODE, internal_routes, routes
from tessera.runtime import run, serve
from tessera.tenants import KeyRing, public_middleware

log = logging.getLogger("tessera.retrieval")


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    node = app[RETRIEVAL_NODE]
    await node.start()
    yield
    await node.stop()


def build_retrieval_app(config: ClusterConfig, node: RetrievalNode | None = None,
                        keys: KeyRing | None = None) -> web.Application:
    """The public application; its state is ``app[RETRIEVAL_NODE]``."""
    app = application([access_middleware(config.retrieval.access_log),
                       public_middleware(keys, open_paths=HEALTH_PATHS, body_timeout_s=config.listener.body_timeout_s)])
    node = node or RetrievalNode(config)
    app[RETRIEVAL_NODE] = node
    app.cleanup_ctx.append(_lifecycle)
    app.add_routes(routes)
    add_chat_routes(app, config)
    add_health_routes(app)
    return app


async def _internal_health(_: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def build_control_app(node: RetrievalNode, auth: ClusterAuth) -> web.Application:
    """The internal plane of ``node``: ``/control/*`` (and ``/health``), signed requests only."""
    r = node.config.retrieval
    app = application([auth.middleware(r.internal_host, r.internal_port,
                                       body_timeout_s=node.config.listener.body_timeout_s)])
    app[STATS_EXTRA] = node.store_stats
    app[RETRIEVAL_NODE] = node  # the memory nodes' inventories are checked against the unit store
    app.router.add_get("/health", _internal_health)
    app.add_routes(internal_routes)
    add_control_routes(app, node.office.held)  # 503 on a replica that does not lead
    add_observe_routes(app)  # GET /control/state, for checkers
    return app


def check_exposure(config: ClusterConfig, keys: KeyRing | None, auth: ClusterAuth) -> None:
    """Refuse listeners that would be open to the network; warn about open loopback ones."""
    r = config.retrieval
    if keys is None:
        if r.host not in LOOPBACK_HOSTS:
            raise ConfigError(f"retrieval.host = {r.host!r} exposes the API beyond this machine without API keys; "
                              "set security.keys_file (see docs/security.md) or bind 127.0.0.1")
        log.warning("no API keys (security.keys_file): the API on %s:%d is open to every local process",
                    r.host, r.port)
    if auth.secret is None:
        if r.internal_host not in LOOPBACK_HOSTS:
            raise ConfigError(f"retrieval.internal_host = {r.internal_host!r} without security.secret_file "
                              "would let anyone on the network drive the control plane; set a secret file")
        log.warning("no cluster secret (security.secret_file): the internal plane on %s:%d is unauthenticated",
                    r.internal_host, r.internal_port)


def run_retrieval_role(config: ClusterConfig, replica: str | None = None) -> int:
    """Entry point of ``tessera run --role retrieval [--node rI]`` (replica I of ``[ha]``)."""
    config = replica_config(config, replica_index(config, replica))
    auth = ClusterAuth.from_config(config)
    keys = KeyRing.load(config.security.keys_file) if config.security.keys_file else None
    check_exposure(config, keys, auth)

    async def main() -> int:
        node = RetrievalNode(config)
        public = build_retrieval_app(config, node, keys)
        internal = build_control_app(node, auth)
        r = config.retrieval
        return await serve(public, r.host, r.port, name="retrieval", limits=config.listener, drain_s=30.0,
                           ssl_context=auth.server_ssl(),
                           also=[(internal, r.internal_host, r.internal_port)])

    return run(main)
