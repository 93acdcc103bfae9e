"""``GET /control/state``: what the control plane believes, for checkers (tessera_lab/hosts/checker.py).

A read-only dump of the shared directory (every entry with its epoch, state, blocks, writer,
deadline and read leases) and of every generation node's local view, stamped with the
plane's own clock, so a checker can hold leases and reservations against their expiry and
the directory against the memory nodes' arenas. It changes nothing and decides nothing.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from tessera.control.directory import EntryState
from tessera.control.plane import ControlPlane
from tessera.control.routes import CONTROL_PLANE


def plane_state(plane: ControlPlane) -> dict[str, Any]:
    directory = plane.directory
    return {
        "now": plane.clock(),
        "lease_ttl_s": directory.lease_ttl_s,
        "write_timeout_s": directory.write_timeout_s,
        "entries": [
            {"unit": e.unit_id, "epoch": e.epoch, "ready": e.state is EntryState.READY,
             "blocks": [[b.node, b.index] for b in e.blocks], "writer": e.writer, "deadline": e.deadline,
             "leases": [[lease.lease_id, lease.expires_at] for lease in e.leases.values()]}
            for e in directory.entries()
        ],
        "nodes": {n.name: {"alive": n.alive, "local": sorted(n.local.policy.resident)} for n in plane.nodes.values()},
    }


async def state(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(plane_state(request.app[CONTROL_PLANE]())), content_type="application/json")


def add_observe_routes(app: web.Application) -> None:
    """Add ``GET /control/state`` to an app that already has the control routes (internal plane only)."""
    app.router.add_get("/control/state", state)
