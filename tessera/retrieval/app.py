"""The retrieval role's process: control plane + retrieval API + the OpenAI-compatible API.

One aiohttp application holds the three route sets; the :class:`RetrievalNode` (control
plane + unit store) starts and stops in the app's ``cleanup_ctx``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from tessera.config import ClusterConfig
from tessera.control.routes import STATS_EXTRA, add_control_routes
from tessera.http import application
from tessera.retrieval.chat import add_chat_routes
from tessera.retrieval.node import RetrievalNode
from tessera.retrieval.routes import RETRIEVAL_NODE, routes
from tessera.runtime import run, serve


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    node = app[RETRIEVAL_NODE]
    await node.start()
    yield
    await node.stop()


def build_retrieval_app(config: ClusterConfig, node: RetrievalNode | None = None) -> web.Application:
    """The retrieval role's application; its state is ``app[RETRIEVAL_NODE]``."""
    app = application()
    node = node or RetrievalNode(config)
    app[RETRIEVAL_NODE] = node
    app[STATS_EXTRA] = node.store_stats
    app.cleanup_ctx.append(_lifecycle)
    app.add_routes(routes)
    add_control_routes(app, node.plane)
    add_chat_routes(app, config)
    return app


def run_retrieval_role(config: ClusterConfig) -> int:
    """Entry point of ``tessera run --role retrieval``."""

    async def main() -> int:
        # a model that fails to load (in the app's start-up) is exit code 3, logged by serve
        app = build_retrieval_app(config)
        return await serve(app, config.retrieval.host, config.retrieval.port, name="retrieval", drain_s=30.0)

    return run(main)
