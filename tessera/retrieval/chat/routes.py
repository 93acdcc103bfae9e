"""The OpenAI-compatible API on the retrieval role: the single entry point of a Tessera cluster.

    POST /v1/chat/completions   OpenAI-compatible (streaming and not), plus Tessera's
                                retrieval / context_units extensions (see request.py)
    GET  /v1/models             the served model
    GET  /metrics               Prometheus text
    GET  /openapi.json          OpenAPI 3.1 schema of the chat endpoint (from the pydantic models)

Request flow (paper §4): retrieve (or take the caller's units) → identify → render the
layout → route → snapshot of the chosen node → finalize the per-unit plan → execute on
the node, relaying its tokens. The control plane runs in this process (with ``[ha]``, in the
leader's; a replica that does not lead goes through its RPCs: :mod:`tessera.retrieval.leadership.office`).

The chat handler only admits (the cluster's capacity), parses and maps errors to HTTP
replies, and counts each admitted request's status once. It calls one way down:
:func:`tessera.retrieval.chat.reply.answer` renders the layout (:mod:`.layout`), drives the
request through the cluster (:mod:`.driver`) and builds the reply (:mod:`.reply`); the per-process
state is :class:`~tessera.retrieval.chat.serving.Serving`, started here once the retrieval node is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

import orjson
from aiohttp import web

from tessera.config import ClusterConfig
from tessera.errors import BadRequest, TesseraError
from tessera.retrieval.chat.refusal import refusal
from tessera.retrieval.chat.reply import ClientGone, answer
from tessera.retrieval.chat.request import parse_chat_request
from tessera.retrieval.chat.response import error_body, openapi_document, to_json
from tessera.retrieval.chat.serving import Serving
from tessera.retrieval.limits import check_body_size
from tessera.retrieval.node import RetrievalNode
from tessera.retrieval.routes import RETRIEVAL_NODE
from tessera.tenants import tenant_of

SERVING = web.AppKey("serving", Serving)
DISCONNECT_POLL_S = 0.25  # how often a waiting chat call checks that its client is still there
# a reply and its request status; None: refused before admission (not ready, too large, not JSON), not counted
Answered = tuple[web.StreamResponse, str | None]


def _json_error(message: str, status: int) -> web.Response:
    return web.Response(body=to_json(error_body(message, status)), status=status, content_type="application/json")


async def _until_disconnect(request: web.Request, work: Awaitable[Answered]) -> Answered:
    """Run ``work``; cancel it (aborting the generation behind it) if the client goes away.

    aiohttp does not cancel a handler whose client disconnected, so a client that gave up
    would otherwise keep a generation node busy until ``max_tokens``.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ClientGone
    finally:
        task.cancel()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    serving = request.app[SERVING]
    try:
        response, status = await _until_disconnect(request, _chat(request, serving, request.app[RETRIEVAL_NODE]))
    except ClientGone:
        # counted apart from 200: the reply never reached the client
        response, status = web.Response(status=499), "cancelled"
    if status is not None:
        serving.metrics.request(status)
    return response


async def _chat(request: web.Request, serving: Serving, node: RetrievalNode) -> Answered:
    """Admit, parse, answer; every error becomes its OpenAI-shaped HTTP reply."""
    if not serving.ready:
        return _json_error("the cluster is still starting (tokenizer and embedder loading); retry shortly", 503), None
    try:
        check_body_size(request.content_length)
        body = orjson.loads(await request.read())
    except BadRequest as exc:
        return _json_error(str(exc), exc.status), None
    except orjson.JSONDecodeError as exc:
        return _json_error(f"body is not valid JSON: {exc}", 400), None
    if not serving.admit():
        return _json_error(f"the cluster has {serving.pending} requests in flight, its capacity "
                           f"(sum of max_inflight) is {serving.capacity}; retry later", 503), "503"
    try:
        chat = parse_chat_request(body, default_top_k=node.config.retrieval.top_k,
                                  default_placement=node.config.retrieval.unit_placement,
                                  served_model=serving.config.model.served_name,
                                  allow_unknown=node.config.retrieval.allow_unknown_fields)
        return await answer(request, serving, node, chat, tenant_of(request))
    except TesseraError as exc:  # what the client is told: no internal URL, no exception text
        told = refusal(exc, node.config.ha.retry_after_s)
        refused = _json_error(told.message, told.status)
        if told.retry_after_s is not None:
            refused.headers["Retry-After"] = str(max(1, round(told.retry_after_s)))
        return refused, str(told.status)
    finally:
        serving.leave()


async def models(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    return web.json_response({"object": "list", "data": [
        {"id": serving.config.model.served_name, "object": "model", "owned_by": "tessera",
         "root": serving.config.model.source}]})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document("Tessera"))


async def metrics(request: web.Request) -> web.Response:
    return request.app[SERVING].metrics.response()


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    serving = app[SERVING]
    serving.start(app[RETRIEVAL_NODE])  # the node started in the cleanup_ctx before this one
    yield
    await serving.close()


def add_chat_routes(app: web.Application, config: ClusterConfig) -> None:
    """The chat API on ``app``; call after the retrieval node's lifecycle is in ``app.cleanup_ctx``."""
    node = app[RETRIEVAL_NODE]
    app[SERVING] = Serving(config, lambda: node.plane)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
