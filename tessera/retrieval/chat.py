"""The serving API on the retrieval role: the single entry point of a Tessera cluster.

    POST /v1/chat/completions   OpenAI-compatible (streaming and not), plus Tessera's
                                retrieval / context_units extensions (see protocol.py)
    GET  /v1/models             the served model
    GET  /metrics               Prometheus text

Request flow (paper §4): retrieve (or take the caller's units) → identify → render the
layout → route → snapshot of the chosen node → finalize the per-unit plan → execute on
the node, relaying its tokens. The control plane runs in this process.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.engines.checkpoint import resolve
from tessera.engines.geometry import geometry_from_checkpoint
from tessera.errors import BadRequest, Overloaded, TesseraError
from tessera.messages import (
    CancelRequest,
    ExecuteRequest,
    PromptLayout,
    ReleaseRequest,
    RequestPlan,
    SamplingParams,
    SegmentKind,
)
from tessera.metrics import Registry
from tessera.retrieval.chat_request import (
    ChatRequest,
    chunk_body,
    completion_body,
    error_body,
    parse_chat_request,
)
from tessera.retrieval.generation_client import NodeClients, NodeUnavailable
from tessera.retrieval.node import RetrievalNode
from tessera.retrieval.prompt import PromptBuilder, trace_record
from tessera.retrieval.routes import RETRIEVAL_NODE
from tessera.units import ContextUnit, TokenCache
from tessera.wire import WIRE_VERSION

SERVING: web.AppKey[Serving]
TIERS = ("prefix", "local", "remote", "computed")


@dataclass
class Outcome:
    text: str = ""
    finish_reason: str = "stop"
    stats: dict[str, int] = field(default_factory=dict)
    first_token_at: float | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class Serving:
    """Per-process serving state: node clients, prompt builder, metrics."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.nodes = NodeClients(config)
        self.policy = policy_from_config(config.composition)
        self.builder: PromptBuilder | None = None
        self.max_context = 0
        self.capacity = sum(n.max_inflight for n in config.generation)
        self.pending = 0
        m = self.metrics = Registry()
        self.m_requests = m.counter("tessera_requests_total", "Chat requests by HTTP status")
        self.m_ttft = m.histogram("tessera_ttft_seconds", "Time to first token at the server")
        self.m_tokens = m.counter("tessera_prompt_tokens_total", "Prompt tokens by where their state came from "
                                  "(prefix cache, local unit cache, shared KV pool, computed unit, recomputed)")
        self.m_units = m.counter("tessera_units_total", "Context units by preparation outcome")
        self.m_fallbacks = m.counter("tessera_fetch_fallbacks_total", "Remote fetches that failed and were computed")
        self.m_coalesced = m.counter("tessera_coalesced_prefills_total", "Missing units that joined an in-flight prefill")
        self.m_bytes = m.counter("tessera_bytes_fetched_total", "Bytes of unit state fetched from the KV pool")
        self.m_completion = m.counter("tessera_completion_tokens_total", "Generated tokens")
        self.g_pending = m.gauge("tessera_pending_requests", "Requests in flight at the retrieval node")
        self.g_inflight = m.gauge("tessera_node_inflight", "In-flight requests per generation node (control plane view)")

    def builder_for(self, node: RetrievalNode) -> PromptBuilder:
        if self.builder is None:
            assert node.tokenizer is not None
            self.builder = PromptBuilder(node.tokenizer, TokenCache(node.tokenizer.encode))
            # the context limit comes from the checkpoint's config (no weights are loaded here)
            geometry = geometry_from_checkpoint(resolve(self.config.model), self.config.kv_dtype,
                                                self.config.model.max_context)
            self.max_context = geometry.max_context
        return self.builder

    def record(self, outcome: Outcome) -> None:
        s = outcome.stats
        for tier, key in (("prefix", "prefix_cached_tokens"), ("local", "local_tokens"), ("remote", "remote_tokens"),
                          ("computed", "computed_unit_tokens"), ("recomputed", "recomputed_tokens")):
            self.m_tokens.inc(s.get(key, 0), {"source": tier})
        for tier in ("local", "remote", "computed"):
            self.m_units.inc(s.get(f"{tier}_units", 0), {"preparation": tier})
        self.m_fallbacks.inc(s.get("fallbacks", 0))
        self.m_coalesced.inc(s.get("coalesced_units", 0))
        self.m_bytes.inc(s.get("bytes_fetched", 0))
        self.m_completion.inc(s.get("completion_tokens", 0))


SERVING = web.AppKey("serving", Serving)


def _json_error(message: str, status: int) -> web.Response:
    return web.Response(body=orjson.dumps(error_body(message, status)), status=status, content_type="application/json")


async def _units(node: RetrievalNode, chat: ChatRequest) -> list[ContextUnit]:
    if chat.retrieval is not None:
        r = chat.retrieval
        if r.embedding is not None:
            hits = await node.retrieve(r.scope, embedding=r.embedding, top_k=r.top_k)
        else:
            hits = await node.retrieve(r.scope, query=r.query, top_k=r.top_k)
        return [h.unit for h in hits]
    if chat.units:
        by_scope: dict[str, list[int]] = {}
        for i, u in enumerate(chat.units):
            by_scope.setdefault(u.scope, []).append(i)
        out: list[ContextUnit | None] = [None] * len(chat.units)
        for scope, idx in by_scope.items():
            for i, unit in zip(idx, await node.identify(scope, [chat.units[i].text for i in idx]), strict=True):
                out[i] = unit
        return [u for u in out if u is not None]
    return []


def _usage(layout: PromptLayout, stats: dict[str, int], node: str) -> dict[str, Any]:
    cached = stats.get("prefix_cached_tokens", 0) + stats.get("local_tokens", 0) + stats.get("remote_tokens", 0)
    completion = stats.get("completion_tokens", 0)
    return {
        "prompt_tokens": layout.n_tokens,
        "completion_tokens": completion,
        "total_tokens": layout.n_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "tessera": {**stats, "node": node},
    }


class ChatCall:
    """One chat request's journey through the cluster."""

    def __init__(self, serving: Serving, node: RetrievalNode, chat: ChatRequest) -> None:
        self.serving = serving
        self.node = node
        self.chat = chat
        self.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.target = ""
        self.plan: RequestPlan | None = None
        self.started = time.perf_counter()

    async def prepare(self) -> PromptLayout:
        units = await _units(self.node, self.chat)
        layout = self.serving.builder_for(self.node).build(self.chat.messages, units, self.chat.placement)
        if self.node.config.control.mode == "compose":
            # units the policy recomputes (nearly) whole are plain text: never prefilled, planned or retained
            layout = self.serving.policy.inline(layout)
        limit = self.serving.max_context
        if layout.n_tokens + self.chat.max_tokens > limit:
            raise BadRequest(
                f"the prompt has {layout.n_tokens} tokens (units included) and max_tokens is {self.chat.max_tokens}, "
                f"more than the model's context of {limit}; send fewer or shorter units, or lower max_tokens")
        return layout

    async def run(self, layout: PromptLayout) -> AsyncIterator[dict[str, Any]]:
        """Route, plan and execute; yields the node's events."""
        plane = self.node.plane
        compose = self.node.config.control.mode == "compose"
        refs: dict[str, int] = {}
        if compose:
            for seg in layout.segments:
                if seg.kind is SegmentKind.UNIT:
                    refs.setdefault(seg.unit_id, len(seg.token_ids))
        self.target = plane.route(self.request_id, list(refs.items()))
        try:
            snap = await self.serving.nodes.snapshot(self.target, self.request_id, list(refs))
            self.plan = plane.finalize(self.request_id, self.target, snap.held)
            sampling = SamplingParams(self.chat.max_tokens, self.chat.temperature, self.chat.top_p, self.chat.seed,
                                      (), self.chat.ignore_eos, self.chat.top_logprobs)
            msg = ExecuteRequest(WIRE_VERSION, self.request_id, layout, self.plan, sampling)
            delivered = False
            try:
                async for event in self.serving.nodes.execute(self.target, msg):
                    delivered = True
                    yield event
            except NodeUnavailable:
                if not delivered:
                    self._return_grants()
                raise
        finally:
            plane.complete(self.request_id)

    def _return_grants(self) -> None:
        """The node never got the plan: give its leases and reservations back at once."""
        if self.plan is None:
            return
        plane = self.node.plane
        leases = tuple(u.lease.lease_id for u in self.plan.units if u.lease is not None)
        if leases:
            plane.release(ReleaseRequest(WIRE_VERSION, leases))
        for u in self.plan.units:
            if u.grant is not None:
                plane.cancel(CancelRequest(WIRE_VERSION, u.grant.unit_id, u.grant.epoch, u.grant.writer, 0.0))


def _token_entry(node: RetrievalNode, token_id: int, logprob: float) -> dict[str, Any]:
    text = node.tokenizer.decode([token_id]) if node.tokenizer is not None else ""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "token_id": token_id}


def _logprob_entry(node: RetrievalNode, event: dict[str, Any]) -> dict[str, Any]:
    entry = _token_entry(node, int(event["token"]), float(event["logprob"]))
    entry["top_logprobs"] = [_token_entry(node, int(t), float(lp)) for t, lp in event.get("top") or []]
    return entry


def _stop_at(text: str, stops: tuple[str, ...]) -> int:
    cut = [text.find(s) for s in stops if s and s in text]
    return min(cut) if cut else -1


async def chat_completions(request: web.Request) -> web.StreamResponse:
    serving = request.app[SERVING]
    node = request.app[RETRIEVAL_NODE]
    if not node.ready:
        return _json_error("the cluster is still starting (tokenizer and embedder loading); retry shortly", 503)
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return _json_error(f"body is not valid JSON: {exc}", 400)
    if serving.pending >= serving.capacity:
        serving.m_requests.inc(labels={"status": "503"})
        return _json_error(f"the cluster has {serving.pending} requests in flight, its capacity "
                           f"(sum of max_inflight) is {serving.capacity}; retry later", 503)
    serving.pending += 1
    serving.g_pending.set(serving.pending)
    try:
        chat = parse_chat_request(body, default_top_k=node.config.retrieval.top_k,
                                  default_placement=node.config.retrieval.unit_placement,
                                  served_model=serving.config.model.source)
        call = ChatCall(serving, node, chat)
        layout = await call.prepare()
        trace = trace_record(layout, chat.retrieval.scope if chat.retrieval else "") \
            if body.get("return_layout") is True else None
        if chat.stream:
            return await _stream(request, serving, call, layout, trace)
        outcome = await _collect(serving, call, layout)
        serving.m_requests.inc(labels={"status": "200"})
        payload = completion_body(call.request_id, chat.model, outcome.text, outcome.finish_reason,
                                  _usage(layout, outcome.stats, call.target),
                                  outcome.logprobs if chat.top_logprobs >= 0 else None)
        if trace is not None:
            payload["tessera_layout"] = trace
        return web.Response(body=orjson.dumps(payload), content_type="application/json")
    except BadRequest as exc:
        serving.m_requests.inc(labels={"status": str(exc.status)})
        return _json_error(str(exc), exc.status)
    except Overloaded as exc:
        serving.m_requests.inc(labels={"status": "429"})
        return _json_error(str(exc), 429)
    except (NodeUnavailable, TesseraError) as exc:
        serving.m_requests.inc(labels={"status": "503"})
        return _json_error(str(exc), 503)
    finally:
        serving.pending -= 1
        serving.g_pending.set(serving.pending)


async def _events(serving: Serving, call: ChatCall, layout: PromptLayout) -> AsyncIterator[tuple[str, Outcome]]:
    """Yield (text delta, outcome so far); handles stop strings and node errors."""
    outcome = Outcome()
    stops = call.chat.stop
    async for event in call.run(layout):
        if "error" in event:
            raise TesseraError(f"generation node {call.target} failed: {event['error']}")
        if event.get("done"):
            outcome.finish_reason = event["finish_reason"]
            outcome.stats = event["stats"]
            break
        if outcome.first_token_at is None:
            outcome.first_token_at = time.perf_counter()
            serving.m_ttft.observe(outcome.first_token_at - call.started)
        delta = event["text"]
        if "logprob" in event:
            outcome.logprobs.append(_logprob_entry(call.node, event))
        if stops:
            cut = _stop_at(outcome.text + delta, stops)
            if cut >= 0:
                delta = (outcome.text + delta)[:cut][len(outcome.text):]
                outcome.text += delta
                outcome.finish_reason = "stop"
                yield delta, outcome
                await serving.nodes.abort(call.target, call.request_id)
                return
        outcome.text += delta
        yield delta, outcome
    serving.record(outcome)


async def _collect(serving: Serving, call: ChatCall, layout: PromptLayout) -> Outcome:
    last = Outcome()
    async for _delta, outcome in _events(serving, call, layout):
        last = outcome
    return last


async def _stream(request: web.Request, serving: Serving, call: ChatCall, layout: PromptLayout,
                  trace: dict[str, Any] | None) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    model = call.chat.model

    async def send(obj: dict[str, Any]) -> None:
        await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")

    outcome = Outcome()
    status = "200"
    try:
        first = True
        async for delta, latest in _events(serving, call, layout):
            outcome = latest
            if first:
                # headers go out with the first token, so errors before it are still a clean 4xx/5xx
                await resp.prepare(request)
                await send(chunk_body(call.request_id, model, {"role": "assistant", "content": ""}, None))
                first = False
            chunk = chunk_body(call.request_id, model, {"content": delta}, None)
            if call.chat.top_logprobs >= 0 and outcome.logprobs:
                chunk["choices"][0]["logprobs"] = {"content": [outcome.logprobs[-1]]}
            await send(chunk)
        if first:
            await resp.prepare(request)
        final = chunk_body(call.request_id, model, {}, outcome.finish_reason)
        if trace is not None:
            final["tessera_layout"] = trace
        await send(final)
        if call.chat.include_usage:
            usage_chunk = chunk_body(call.request_id, model, {}, None, _usage(layout, outcome.stats, call.target))
            usage_chunk["choices"] = []
            await send(usage_chunk)
        await resp.write(b"data: [DONE]\n\n")
    except (BadRequest, Overloaded, TesseraError) as exc:
        if not resp.prepared:
            raise
        status = "stream-error"
        with contextlib.suppress(ConnectionError, RuntimeError):
            await send(error_body(str(exc), 503))
    finally:
        serving.m_requests.inc(labels={"status": status})
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    return web.json_response({"object": "list", "data": [
        {"id": serving.config.model.source, "object": "model", "owned_by": "tessera"}]})


async def metrics(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    node = request.app[RETRIEVAL_NODE]
    for name, gen in node.plane.nodes.items():
        serving.g_inflight.set(gen.inflight, {"node": name})
    text = serving.metrics.render() + _plane_metrics(node)
    return web.Response(text=text, content_type="text/plain")


def _plane_metrics(node: RetrievalNode) -> str:
    stats = node.stats()
    lines = [
        "# HELP tessera_shared_entries Units in the shared KV pool directory",
        "# TYPE tessera_shared_entries gauge",
        f"tessera_shared_entries {stats['shared_entries']}",
        "# HELP tessera_shared_free_blocks Free blocks in the shared KV pool",
        "# TYPE tessera_shared_free_blocks gauge",
        f"tessera_shared_free_blocks {stats['shared_free_blocks']}",
        "# HELP tessera_node_queued_tokens Tokens queued on each generation node (from its heartbeat)",
        "# TYPE tessera_node_queued_tokens gauge",
    ]
    for name, gen in node.plane.nodes.items():
        lines.append(f'tessera_node_queued_tokens{{node="{name}"}} {getattr(gen, "queued_tokens", 0)}')
    return "\n".join(lines) + "\n"


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[SERVING].nodes.close()


def add_chat_routes(app: web.Application, config: ClusterConfig) -> None:
    app[SERVING] = Serving(config)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)

