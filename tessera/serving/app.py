"""The retrieval role's process: control plane + retrieval API + the OpenAI-compatible API."""

from __future__ import annotations

import sys

from aiohttp import web

from tessera.config import ClusterConfig
from tessera.control.service import build_app
from tessera.errors import ModelLoadError
from tessera.runtime import run, serve
from tessera.serving.api import add_serving_routes


def build_retrieval_app(config: ClusterConfig) -> web.Application:
    app = build_app(config)
    add_serving_routes(app, config)
    return app


def run_retrieval_role(config: ClusterConfig) -> int:
    async def main() -> int:
        app = build_retrieval_app(config)
        return await serve(app, config.retrieval.host, config.retrieval.port, name="retrieval", drain_s=30.0)

    try:
        return run(main)
    except ModelLoadError as exc:
        print(f"tessera retrieval: {exc}", file=sys.stderr)
        return 3
