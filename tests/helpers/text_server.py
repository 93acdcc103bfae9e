"""A plain OpenAI-compatible chat server that only renders text: what ``tessera bench --url`` sends
to a server without Tessera, recorded. It streams one fixed word per request (with usage) and
runs on its own event loop in a thread, so a synchronous command can drive it."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from helpers.cluster import free_port


@dataclass
class TextServer:
    url: str
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _app(server: TextServer) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "plain-model", "object": "model",
                                                             "owned_by": "someone-else"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        server.bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        prompt = sum(len(m["content"]) for m in body["messages"])  # characters stand in for tokens
        for chunk in ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                      {"choices": [{"index": 0, "delta": {"content": "ok"}}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                      {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 1,
                                                "prompt_tokens_details": {"cached_tokens": 0}}}):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


@contextmanager
def text_server() -> Iterator[TextServer]:
    port = free_port()
    server = TextServer(f"http://127.0.0.1:{port}")
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_app(server))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
