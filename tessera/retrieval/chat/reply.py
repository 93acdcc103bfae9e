"""The reply layer: a request's node events become its OpenAI reply, its usage and its metrics.

:func:`answer` renders the layout (:mod:`tessera.retrieval.chat.layout`), drives the request
through the cluster (:class:`~tessera.retrieval.chat.driver.ChatDriver`) and replies with one JSON
completion or a stream of server-sent events. :meth:`Reply.relay` turns the node's events
into text deltas (applying stop strings) and logprob entries, observes the first token and,
once the reply ran to its end, counts where its prompt's state came from: each metric once.
Every usage carries the reply's reuse receipt (:mod:`tessera.retrieval.chat.receipt`).

A stream's headers go out with its first token, so an error before it reaches the handler
as a clean 4xx/5xx JSON reply; an error after it ends the stream with an error event (request
status ``stream-error``). A client that goes away mid-stream raises :class:`ClientGone`.

This module knows nothing about admission or parsing; it answers requests the handler admitted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from tessera.errors import BadRequest, Overloaded, TesseraError
from tessera.messages.common import check_version
from tessera.messages.generation import DoneEvent, RequestStats, TokenEvent
from tessera.retrieval.access_log import note_outcome
from tessera.retrieval.chat.driver import ChatDriver
from tessera.retrieval.chat.layout import chat_layout
from tessera.retrieval.chat.metrics import ChatMetrics
from tessera.retrieval.chat.receipt import Composition, receipt
from tessera.retrieval.chat.refusal import refusal
from tessera.retrieval.chat.request import ChatRequest
from tessera.retrieval.chat.response import (
    Delta,
    PromptTokensDetails,
    Usage,
    chunk_body,
    completion_body,
    error_body,
    to_json,
)
from tessera.retrieval.chat.serving import Serving
from tessera.retrieval.node import RetrievalNode
from tessera.retrieval.prompt import trace_record
from tessera.retrieval.prompt_path import Built
from tessera.tenants import Tenant
from tessera.wire import to_wire

Send = Callable[[str], Awaitable[None]]


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


async def answer(request: web.Request, serving: Serving, node: RetrievalNode, chat: ChatRequest,
                 tenant: Tenant) -> tuple[web.StreamResponse, str]:
    """Reply to an admitted request: the response and its request status (``200``, ``stream-error``)."""
    started = time.perf_counter()
    driver = ChatDriver(node, serving.nodes, chat.sampling, tenant.name, arrived=started)
    built = await chat_layout(serving, node, chat, tenant)
    trace = trace_record(built.served, chat.retrieval.scope if chat.retrieval else "") if chat.return_layout else None
    reply = Reply(serving.metrics, node.tokenizer, chat, driver, built, serving.composition_of(built.setting), started)
    if chat.stream:
        return await reply.stream(request, trace)
    return await reply.complete(trace), "200"


class Reply:
    """One request's reply, built from its driver's events."""

    def __init__(self, metrics: ChatMetrics, tokenizer: Any, chat: ChatRequest, driver: ChatDriver,
                 built: Built, composition: Composition, started: float) -> None:
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.chat = chat
        self.driver = driver
        self.built = built
        self.layout = built.served
        self.composition = composition
        self.started = started
        self.outcome = Outcome()
        self.done = False
        self.cut: str | None = None  # the text before a stop string, sent after the reply is counted
        self.sent = False  # something reached the client: the request can no longer start over
        self._ttft_observed = False

    def committed(self) -> bool:
        return self.sent

    def restart(self) -> None:
        """The driver starts the request over on another node: what came so far is not the reply."""
        assert not self.sent, self.driver.request_id
        self.outcome, self.done, self.cut = Outcome(), False, None

    async def relay(self, send: Send | None = None) -> Outcome:
        """Run the request, ``send`` each text delta as it comes; the outcome once the reply is complete."""
        # closing the run at once (a stop string, a client gone) aborts the node's work now, not
        # whenever the garbage collector finalizes the generator
        built = self.built
        run = self.driver.run(self.layout, self, order_free=built.order_free, recurring=built.recurring,
                              setting=built.setting)
        async with contextlib.aclosing(run) as node_events:
            async for event in node_events:
                delta = self._take(event)
                if self.done:
                    break
                if send is not None:
                    self.sent = True
                    await send(delta)
        self.metrics.finished(self.outcome.stats, self.receipt())
        note_outcome(self.outcome.stats, self.outcome.first_token_at, self.driver.target)
        if self.cut is not None and send is not None:
            await send(self.cut)
        return self.outcome

    def _take(self, event: TokenEvent | DoneEvent) -> str:
        """The text delta of one node event; sets ``done`` at the DoneEvent or a stop string."""
        check_version(event.version)
        out = self.outcome
        if isinstance(event, DoneEvent):
            out.finish_reason, out.stats, self.done = event.finish_reason, event.stats, True
            return ""
        if out.first_token_at is None:
            out.first_token_at = time.perf_counter()
            if not self._ttft_observed:  # once per request, also when it started over elsewhere
                self._ttft_observed = True
                self.metrics.first_token(out.first_token_at - self.started)
        if event.stats is not None:  # the first token carries the prompt's preparation figures
            out.stats = dataclasses.replace(event.stats)
        out.tokens += 1
        if event.logprob is not None:
            out.logprobs.append(self._logprob_entry(event, event.logprob))
        delta = event.text
        cut = _stop_at(out.text + delta, self.chat.stop) if self.chat.stop else -1
        if cut >= 0:
            delta = (out.text + delta)[:cut][len(out.text):]
            out.finish_reason, self.done, self.cut = "stop", True, delta
            # the node never sends its final figures: the tokens it sent are the completion
            out.stats.completion_tokens = out.tokens
        out.text += delta
        return delta

    def receipt(self) -> dict[str, Any]:
        """Where each unit's state came from and the composition that served it (per unit with return_layout)."""
        return receipt(self.built.rendered, self.built.served, self.composition, self.outcome.stats,
                       per_unit=self.chat.return_layout)

    def usage(self, ttft_ms: int | None = None) -> Usage:
        stats, node, n_prompt = self.outcome.stats, self.driver.target, self.layout.n_tokens
        extra: dict[str, Any] = {"node": node} if ttft_ms is None else {"node": node, "ttft_ms": ttft_ms}
        flat = to_wire(stats)
        del flat["unit_sources"]  # the receipt says it per unit
        return Usage(prompt_tokens=n_prompt, completion_tokens=stats.completion_tokens,
                     total_tokens=n_prompt + stats.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_tokens),
                     tessera={**flat, **extra, "receipt": self.receipt()})

    def _ttft_ms(self, first_token_at: float | None) -> int | None:
        """The server-side time to first token, in the usage of streamed and whole replies alike."""
        return None if first_token_at is None else round((first_token_at - self.started) * 1000)

    async def complete(self, trace: dict[str, Any] | None) -> web.Response:
        """The whole completion as one JSON body."""
        out = await self.relay()
        body = completion_body(self.driver.request_id, self.chat.model, out.text, out.finish_reason,
                               self.usage(self._ttft_ms(out.first_token_at)),
                               out.logprobs if self.chat.top_logprobs >= 0 else None, trace)
        return web.Response(body=to_json(body), content_type="application/json")

    async def stream(self, request: web.Request, trace: dict[str, Any] | None) -> tuple[web.StreamResponse, str]:
        """OpenAI-style server-sent events: a chunk per delta, the finish chunk, usage, ``[DONE]``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        rid, model = self.driver.request_id, self.chat.model

        async def send(body: BaseModel) -> None:
            await resp.write(b"data: " + to_json(body) + b"\n\n")

        async def send_delta(delta: str) -> None:
            if not resp.prepared:
                # headers go out with the first token, so errors before it are still a clean 4xx/5xx
                await resp.prepare(request)
                await send(chunk_body(rid, model, Delta(role="assistant", content=""), None))
            entries = self.outcome.logprobs
            logprobs = entries[-1:] if self.chat.top_logprobs >= 0 and entries else None
            await send(chunk_body(rid, model, Delta(content=delta), None, logprobs=logprobs))

        try:
            out = await self.relay(send_delta)
            if not resp.prepared:
                await resp.prepare(request)
            await send(chunk_body(rid, model, Delta(), out.finish_reason, layout=trace))
            if self.chat.include_usage:
                await send(chunk_body(rid, model, None, None, self.usage(self._ttft_ms(out.first_token_at))))
            await resp.write(b"data: [DONE]\n\n")
            status = "200"
        except ConnectionError:
            raise ClientGone from None
        except (BadRequest, Overloaded, TesseraError) as exc:
            if not resp.prepared:
                raise
            status = "stream-error"
            told = refusal(exc)  # after the first token: an error event, not a status
            with contextlib.suppress(ConnectionError, RuntimeError):
                await send(error_body(told.message, told.status))
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp, status

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "token_id": token_id}

    def _logprob_entry(self, event: TokenEvent, logprob: float) -> dict[str, Any]:
        entry = self._token_entry(event.token_id, logprob)
        entry["top_logprobs"] = [self._token_entry(t.token_id, t.logprob) for t in event.top]
        return entry


def _stop_at(text: str, stops: tuple[str, ...]) -> int:
    cut = [text.find(s) for s in stops if s and s in text]
    return min(cut) if cut else -1
