"""One chat request's journey through the cluster: units, layout, route, plan, execute.

:class:`ChatCall` retrieves (or identifies the caller's) units, renders the layout, checks
it against the model's context, asks the control plane to route and finalize a plan, and
relays the chosen generation node's events. A node that cannot be reached, misses a
deadline or answers 429 before the first token is left for another one (at most
``control.max_attempts`` nodes; the failed attempt's leases and grants go back at once and
its route is completed). :func:`events` turns the events into text deltas, applying stop
strings; the streaming and non-streaming replies are built from them in
:mod:`tessera.retrieval.chat_stream`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tessera.errors import BadRequest, Overloaded, TesseraError, Unavailable
from tessera.messages import (
    CancelRequest,
    DoneEvent,
    ErrorEvent,
    ExecuteEvent,
    ExecuteRequest,
    PromptLayout,
    ReleaseRequest,
    RequestPlan,
    RequestStats,
    SegmentKind,
    TokenEvent,
    check_version,
)
from tessera.retrieval.chat_request import ChatRequest
from tessera.retrieval.chat_response import PromptTokensDetails, Usage
from tessera.retrieval.generation_client import NodeUnavailable
from tessera.retrieval.limits import check_prompt_chars
from tessera.retrieval.node import RetrievalNode
from tessera.tenants import OPEN, Tenant
from tessera.units import ContextUnit
from tessera.wire import WIRE_VERSION, to_wire

if TYPE_CHECKING:
    from tessera.retrieval.chat import Serving

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed its connection before the reply was complete (counted as cancelled)."""


@dataclass
class Outcome:
    text: str = ""
    finish_reason: str = "stop"
    stats: RequestStats = field(default_factory=RequestStats)
    first_token_at: float | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0  # token events received (the usage of a reply cut short by a stop string)


async def request_units(node: RetrievalNode, chat: ChatRequest, tenant: Tenant = OPEN) -> list[ContextUnit]:
    """The request's units, all of ``tenant`` (403 for a scope it does not own)."""
    if chat.retrieval is not None:
        r = chat.retrieval
        tenant.check_scope(r.scope, "retrieval.scope")
        if r.embedding is not None:
            hits = await node.retrieve(r.scope, embedding=r.embedding, top_k=r.top_k, tenant=tenant.name)
        else:
            hits = await node.retrieve(r.scope, query=r.query, top_k=r.top_k, tenant=tenant.name)
        return [h.unit for h in hits]
    if chat.units:
        by_scope: dict[str, list[int]] = {}
        for i, u in enumerate(chat.units):
            by_scope.setdefault(u.scope, []).append(i)
        out: list[ContextUnit | None] = [None] * len(chat.units)
        for scope, idx in by_scope.items():
            tenant.check_scope(scope, "context_units.scope")
            for i, unit in zip(idx, await node.identify(scope, [chat.units[i].text for i in idx], tenant.name),
                               strict=True):
                out[i] = unit
        return [u for u in out if u is not None]
    return []


def usage(layout: PromptLayout, stats: RequestStats, node: str, ttft_ms: int | None = None) -> Usage:
    completion = stats.completion_tokens
    extra: dict[str, Any] = {"node": node} if ttft_ms is None else {"node": node, "ttft_ms": ttft_ms}
    return Usage(prompt_tokens=layout.n_tokens, completion_tokens=completion,
                 total_tokens=layout.n_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_tokens),
                 tessera={**to_wire(stats), **extra})


class ChatCall:
    """One chat request's journey through the cluster."""

    def __init__(self, serving: Serving, node: RetrievalNode, chat: ChatRequest, tenant: Tenant = OPEN) -> None:
        self.serving = serving
        self.node = node
        self.chat = chat
        self.tenant = tenant
        self.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.target = ""
        self.plan: RequestPlan | None = None
        self.started = time.perf_counter()

    async def prepare(self) -> PromptLayout:
        builder = self.serving.builder_for(self.node)
        limit = self.serving.max_context
        texts = [m["content"] for m in self.chat.messages]
        # bounded work: a prompt that cannot fit is refused before anything is tokenized
        check_prompt_chars([*texts, *(u.text for u in self.chat.units)], limit)
        units = await request_units(self.node, self.chat, self.tenant)
        check_prompt_chars([*texts, *(u.text for u in units)], limit)
        # tokenizing runs on the retrieval worker thread, never on the event loop
        layout = await self.node.in_worker(builder.build, self.chat.messages, units, self.chat.placement)
        if self.node.config.control.mode == "compose":
            # units the policy recomputes (nearly) whole are plain text: never prefilled, planned or retained
            layout = self.serving.policy.inline(layout)
        if layout.n_tokens + self.chat.max_tokens > limit:
            raise BadRequest(
                f"the prompt has {layout.n_tokens} tokens (units included) and max_tokens is {self.chat.max_tokens}, "
                f"more than the model's context of {limit}; send fewer or shorter units, or lower max_tokens")
        return layout

    async def run(self, layout: PromptLayout) -> AsyncGenerator[ExecuteEvent, None]:
        """Route, plan and execute, on another node while nothing was streamed; yields the node's events."""
        refs: dict[str, int] = {}
        if self.node.config.control.mode == "compose":
            for seg in layout.segments:
                if seg.kind is SegmentKind.UNIT:
                    refs.setdefault(seg.unit_id, len(seg.token_ids))
        tried: set[str] = set()
        failed: NodeUnavailable | Overloaded | None = None
        attempts = self.node.config.control.max_attempts
        for attempt in range(1, attempts + 1):
            try:
                self.target = self.node.plane.route(self.request_id, list(refs.items()), tried)
            except Unavailable:
                if isinstance(failed, Overloaded):
                    raise failed from None  # every node that could serve is full: 429, not 503
                raise
            delivered = False
            try:
                async with contextlib.aclosing(self._attempt(layout, refs)) as node_events:
                    async for event in node_events:
                        delivered = True
                        yield event
                return
            except (NodeUnavailable, Overloaded) as exc:
                if delivered or attempt == attempts:
                    raise
                failed = exc
                tried.add(self.target)
                log.info("request %s: %s; trying another node (attempt %d of %d)",
                         self.request_id, exc, attempt + 1, attempts)

    async def _attempt(self, layout: PromptLayout, refs: Mapping[str, int]) -> AsyncGenerator[ExecuteEvent, None]:
        """One routed attempt: snapshot, plan, execute. Always completes the route; aborts an unfinished run."""
        plane, nodes, target = self.node.plane, self.serving.nodes, self.target
        self.plan = None
        finished = False
        try:
            try:
                snap = await nodes.snapshot(target, self.request_id, list(refs))
            except NodeUnavailable:
                plane.suspect(target)
                raise
            self.plan = plane.finalize(self.request_id, target, snap.held)
            msg = ExecuteRequest(WIRE_VERSION, self.request_id, layout, self.plan, self.chat.sampling,
                                 self.tenant.name)
            delivered = False
            try:
                async with contextlib.aclosing(nodes.execute(target, msg)) as node_events:
                    async for event in node_events:
                        if not delivered:
                            plane.started(self.request_id)  # its queueing ended: overload control measures it
                        delivered = True
                        finished = isinstance(event, DoneEvent | ErrorEvent)
                        yield event
                finished = True
            except (NodeUnavailable, Overloaded) as exc:
                if isinstance(exc, NodeUnavailable):
                    plane.suspect(target)
                if not delivered:
                    self._return_grants()
                raise
        finally:
            if self.plan is not None and not finished:
                # deadline, broken stream, stop string or a client that went away: the node
                # may still be working on it (or hold its pins); tell it to stop
                nodes.abort_later(target, self.request_id)
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


def _logprob_entry(node: RetrievalNode, event: TokenEvent, logprob: float) -> dict[str, Any]:
    entry = _token_entry(node, event.token_id, logprob)
    entry["top_logprobs"] = [_token_entry(node, t.token_id, t.logprob) for t in event.top]
    return entry


def _stop_at(text: str, stops: tuple[str, ...]) -> int:
    cut = [text.find(s) for s in stops if s and s in text]
    return min(cut) if cut else -1


async def events(serving: Serving, call: ChatCall, layout: PromptLayout) -> AsyncIterator[tuple[str, Outcome]]:
    """Yield (text delta, outcome so far); handles stop strings and node errors."""
    outcome = Outcome()
    stops = call.chat.stop
    # closing the run at once (a stop string, a client gone) aborts the node's work now, not
    # whenever the garbage collector finalizes the generator
    async with contextlib.aclosing(call.run(layout)) as node_events:
        async for event in node_events:
            check_version(event.version)
            if isinstance(event, ErrorEvent):
                raise TesseraError(f"generation node {call.target} failed: {event.message}")
            if isinstance(event, DoneEvent):
                outcome.finish_reason = event.finish_reason
                outcome.stats = event.stats
                break
            if outcome.first_token_at is None:
                outcome.first_token_at = time.perf_counter()
                serving.m_ttft.observe(outcome.first_token_at - call.started)
            if event.stats is not None:  # the first token carries the prompt's preparation figures
                outcome.stats = dataclasses.replace(event.stats)
            outcome.tokens += 1
            delta = event.text
            if event.logprob is not None:
                outcome.logprobs.append(_logprob_entry(call.node, event, event.logprob))
            if stops:
                cut = _stop_at(outcome.text + delta, stops)
                if cut >= 0:
                    delta = (outcome.text + delta)[:cut][len(outcome.text):]
                    outcome.text += delta
                    outcome.finish_reason = "stop"
                    # the node never sends its final figures: the tokens it sent are the completion
                    outcome.stats.completion_tokens = outcome.tokens
                    serving.record(outcome)
                    yield delta, outcome
                    return
            outcome.text += delta
            yield delta, outcome
    serving.record(outcome)


async def collect(serving: Serving, call: ChatCall, layout: PromptLayout) -> Outcome:
    last = Outcome()
    async for _delta, outcome in events(serving, call, layout):
        last = outcome
    return last
