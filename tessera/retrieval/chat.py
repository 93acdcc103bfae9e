"""The OpenAI-compatible API on the retrieval role: the single entry point of a Tessera cluster.

    POST /v1/chat/completions   OpenAI-compatible (streaming and not), plus Tessera's
                                retrieval / context_units extensions (see chat_request.py)
    GET  /v1/models             the served model
    GET  /metrics               Prometheus text
    GET  /openapi.json          OpenAPI 3.1 schema of the chat endpoint (from the pydantic models)

Request flow (paper §4): retrieve (or take the caller's units) → identify → render the
layout → route → snapshot of the chosen node → finalize the per-unit plan → execute on
the node, relaying its tokens. The control plane runs in this process.

This module holds the per-process state and the handlers; parsing is in ``chat_request``,
the call itself in ``chat_call``, the streaming reply in ``chat_stream``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

import orjson
from aiohttp import web

from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.control.plane import ControlPlane
from tessera.engines.checkpoint import resolve
from tessera.engines.geometry import geometry_from_checkpoint
from tessera.errors import BadRequest, Overloaded, TesseraError
from tessera.metrics import Metrics
from tessera.retrieval.chat_call import ChatCall, ClientGone, Outcome, collect, usage
from tessera.retrieval.chat_request import parse_chat_request
from tessera.retrieval.chat_response import completion_body, error_body, openapi_document, to_json
from tessera.retrieval.chat_stream import stream_reply
from tessera.retrieval.generation_client import NodeClients, NodeUnavailable
from tessera.retrieval.limits import check_body_size
from tessera.retrieval.node import RetrievalNode
from tessera.retrieval.prompt import PromptBuilder, trace_record
from tessera.retrieval.routes import RETRIEVAL_NODE
from tessera.tenants import tenant_of
from tessera.units import TokenCache

SERVING: web.AppKey[Serving]
DISCONNECT_POLL_S = 0.25  # how often a waiting chat call checks that its client is still there


class Serving:
    """Per-process serving state: node clients, prompt builder, metrics."""

    def __init__(self, config: ClusterConfig, plane: ControlPlane) -> None:
        self.config = config
        self.nodes = NodeClients(config)
        self.policy = policy_from_config(config.composition)
        self.builder: PromptBuilder | None = None
        self.max_context = 0
        self.capacity = sum(n.max_inflight for n in config.generation)
        self.pending = 0
        m = self.metrics = Metrics()
        self.m_requests = m.counter("tessera_requests_total", "Chat requests by HTTP status", ["status"])
        self.m_ttft = m.histogram("tessera_ttft_seconds", "Time to first token at the server")
        self.m_tokens = m.counter("tessera_prompt_tokens_total", "Prompt tokens by where their state came from "
                                  "(prefix cache, local unit cache, shared KV pool, computed unit, recomputed)",
                                  ["source"])
        self.m_units = m.counter("tessera_units_total", "Context units by preparation outcome", ["preparation"])
        self.m_fallbacks = m.counter("tessera_fetch_fallbacks_total", "Remote fetches that failed and were computed")
        self.m_coalesced = m.counter("tessera_coalesced_prefills_total",
                                     "Missing units that joined an in-flight prefill")
        self.m_bytes = m.counter("tessera_bytes_fetched_total", "Bytes of unit state fetched from the KV pool")
        self.m_completion = m.counter("tessera_completion_tokens_total", "Generated tokens")
        self.g_pending = m.gauge("tessera_pending_requests", "Requests in flight at the retrieval node")
        m.read_at_scrape(plane.metrics)

    def builder_for(self, node: RetrievalNode) -> PromptBuilder:
        if self.builder is None:
            assert node.tokenizer is not None
            self.builder = PromptBuilder(node.tokenizer, TokenCache(node.tokenizer.encode_plain))
            # the context limit comes from the checkpoint's config (no weights are loaded here)
            geometry = geometry_from_checkpoint(resolve(self.config.model), self.config.kv_dtype,
                                                self.config.model.max_context)
            self.max_context = geometry.max_context
        return self.builder

    def record(self, outcome: Outcome) -> None:
        s = outcome.stats
        for source, n in s.tokens_by_source():
            self.m_tokens.labels(source=source).inc(n)
        for preparation, n in s.units_by_preparation():
            self.m_units.labels(preparation=preparation).inc(n)
        self.m_fallbacks.inc(s.fallbacks)
        self.m_coalesced.inc(s.coalesced_units)
        self.m_bytes.inc(s.bytes_fetched)
        self.m_completion.inc(s.completion_tokens)


SERVING = web.AppKey("serving", Serving)


def _json_error(message: str, status: int) -> web.Response:
    return web.Response(body=to_json(error_body(message, status)), status=status, content_type="application/json")


async def _until_disconnect(request: web.Request, work: Awaitable[web.StreamResponse]) -> web.StreamResponse:
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
        return await _until_disconnect(request, _chat_completions(request))
    except ClientGone:
        # counted apart from 200: the reply never reached the client
        serving.m_requests.labels(status="cancelled").inc()
        return web.Response(status=499)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    serving = request.app[SERVING]
    node = request.app[RETRIEVAL_NODE]
    if not node.ready:
        return _json_error("the cluster is still starting (tokenizer and embedder loading); retry shortly", 503)
    try:
        check_body_size(request.content_length)
    except BadRequest as exc:
        return _json_error(str(exc), exc.status)
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return _json_error(f"body is not valid JSON: {exc}", 400)
    if serving.pending >= serving.capacity:
        serving.m_requests.labels(status="503").inc()
        return _json_error(f"the cluster has {serving.pending} requests in flight, its capacity "
                           f"(sum of max_inflight) is {serving.capacity}; retry later", 503)
    serving.pending += 1
    serving.g_pending.set(serving.pending)
    try:
        chat = parse_chat_request(body, default_top_k=node.config.retrieval.top_k,
                                  default_placement=node.config.retrieval.unit_placement,
                                  served_model=serving.config.model.source)
        call = ChatCall(serving, node, chat, tenant_of(request))
        layout = await call.prepare()
        trace = trace_record(layout, chat.retrieval.scope if chat.retrieval else "") \
            if chat.return_layout else None
        if chat.stream:
            return await stream_reply(request, serving, call, layout, trace)
        outcome = await collect(serving, call, layout)
        serving.m_requests.labels(status="200").inc()
        ttft_ms = None if outcome.first_token_at is None else round((outcome.first_token_at - call.started) * 1000)
        payload = completion_body(call.request_id, chat.model, outcome.text, outcome.finish_reason,
                                  usage(layout, outcome.stats, call.target, ttft_ms),
                                  outcome.logprobs if chat.top_logprobs >= 0 else None, trace)
        return web.Response(body=to_json(payload), content_type="application/json")
    except BadRequest as exc:
        serving.m_requests.labels(status=str(exc.status)).inc()
        return _json_error(str(exc), exc.status)
    except Overloaded as exc:
        serving.m_requests.labels(status="429").inc()
        refused = _json_error(str(exc), 429)
        if exc.retry_after_s is not None:
            refused.headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        return refused
    except (NodeUnavailable, TesseraError) as exc:
        serving.m_requests.labels(status="503").inc()
        return _json_error(str(exc), 503)
    finally:
        serving.pending -= 1
        serving.g_pending.set(serving.pending)


async def models(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    return web.json_response({"object": "list", "data": [
        {"id": serving.config.model.source, "object": "model", "owned_by": "tessera"}]})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document("Tessera"))


async def metrics(request: web.Request) -> web.Response:
    return request.app[SERVING].metrics.response()


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[SERVING].nodes.close()


def add_chat_routes(app: web.Application, config: ClusterConfig) -> None:
    app[SERVING] = Serving(config, app[RETRIEVAL_NODE].plane)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)

