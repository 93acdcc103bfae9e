"""The retrieval role's client of the generation nodes (snapshot, execute, abort), in typed messages.

Every call toward a node is bounded: connecting (``control.connect_timeout_s``), the snapshot
(``first_token_timeout_s``), the first token of a reply (the attempt's
:class:`~tessera.control.pace.NodeWatch`: its work at the node's measured rate, plus
``first_token_timeout_s`` as slack) and the gap between two tokens (``idle_timeout_s``).
Every wait also ends as soon as the control plane declares the node dead (missed heartbeats).

Two outcomes, by cause: a node that refuses the connection, breaks a stream, is declared
dead, or misses a deadline without a heartbeat since the wait began raises
:class:`NodeUnavailable` (it failed: the caller retries elsewhere); a node that misses a
deadline while it still reports in, and ran no prompt work meanwhile, raises :class:`NodeSlow`
(it is alive, only slow: no retry, the node stays in routing); one that ran prompt work is
draining its queue and is waited on. Either way the caller tells the node to abort
(:meth:`NodeClients.abort_later`), since it may still be working.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any, TypeVar

import aiohttp
import orjson

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig
from tessera.control.pace import Watch
from tessera.errors import BadRequest, Overloaded, TesseraError
from tessera.http import LazySession
from tessera.messages.common import check_version
from tessera.messages.generation import (
    EXECUTE_EVENTS,
    AbortRequest,
    AbortResponse,
    ExecuteEvent,
    ExecuteRequest,
    PrefillRequest,
    PrefillResponse,
    SnapshotRequest,
    SnapshotResponse,
    UnitText,
)
from tessera.messages.plan import RequestPlan
from tessera.messages.prompt import PromptLayout, SegmentKind
from tessera.runtime import BackgroundTasks
from tessera.wire import WIRE_VERSION, decode, decode_tagged, encode, from_wire

log = logging.getLogger(__name__)
T = TypeVar("T")
WATCH_S = 0.5  # how often a wait looks at the node's liveness


class NodeUnavailable(TesseraError):
    """A generation node could not be reached, failed mid-request or went silent (HTTP 503; retried)."""


class NodeSlow(TesseraError):
    """A generation node that still reports in missed a deadline (HTTP 503; not retried, not suspected)."""


class NodeClients:
    def __init__(self, config: ClusterConfig) -> None:
        control = config.control
        self.urls = {n.name: f"{config.scheme}://{n.host}:{n.port}" for n in config.generation}
        self.auth = ClusterAuth.from_config(config)  # the generation nodes' API is internal: signed
        self.connect_timeout_s = control.connect_timeout_s
        self.first_token_timeout_s = control.first_token_timeout_s
        self.idle_timeout_s = control.idle_timeout_s
        # no total timeout: a long generation is fine; connecting, the first token and every
        # gap between tokens are bounded per call below
        self._session = LazySession(
            aiohttp.ClientTimeout(total=None, connect=control.connect_timeout_s,
                                  sock_connect=control.connect_timeout_s),
            connection_limit=0)
        self.aborts = BackgroundTasks("aborts")

    async def close(self) -> None:
        await self.aborts.drain(timeout=self.connect_timeout_s)
        await self._session.close()

    def _post(self, node: str, path: str, data: bytes) -> Any:
        url = self.urls[node] + path
        headers = {"Content-Type": "application/json", **self.auth.headers("POST", url, data)}
        return self._session.get().post(url, data=data, headers=headers, ssl=self.auth.client_ssl())

    async def _error(self, node: str, resp: aiohttp.ClientResponse) -> TesseraError:
        text = (await resp.text())[:500]
        if resp.status == 429:
            return Overloaded(f"generation node {node} is overloaded: {text}")
        if 400 <= resp.status < 500:
            return BadRequest(f"generation node {node} refused the request: {text}", resp.status)
        return NodeUnavailable(f"generation node {node} answered HTTP {resp.status}: {text}")

    async def _snapshot(self, node: str, request_id: str, unit_ids: Sequence[str]) -> SnapshotResponse:
        msg = SnapshotRequest(WIRE_VERSION, request_id, tuple(unit_ids))
        try:
            async with self._post(node, "/v1/snapshot", encode(msg)) as resp:
                if resp.status != 200:
                    raise await self._error(node, resp)
                body = await resp.read()
            return from_wire(SnapshotResponse, orjson.loads(body))
        except aiohttp.ClientError as exc:
            raise NodeUnavailable(f"generation node {node} is unreachable: {exc!r}") from None

    async def snapshot(self, watch: Watch, request_id: str, unit_ids: Sequence[str]) -> SnapshotResponse:
        """The node's snapshot (it pins what it holds); given up when the node is declared dead."""
        return await _watched(self._snapshot(watch.name, request_id, unit_ids), watch, self.first_token_timeout_s,
                              "the snapshot", "control.first_token_timeout_s")

    async def execute(self, watch: Watch, msg: ExecuteRequest) -> AsyncGenerator[ExecuteEvent, None]:
        """Yield the node's events; the last one is a ``DoneEvent`` (or an ``ErrorEvent``)."""
        node = watch.name
        wait, what = watch.first_token_s, "its first token"
        key = "its work at the measured rate + control.first_token_timeout_s"
        progress_s: float | None = self.first_token_timeout_s
        try:
            resp = await _watched(self._post(node, "/v1/execute", encode(msg)), watch, wait, what, key, progress_s)
            try:
                if resp.status != 200:
                    raise await self._error(node, resp)
                while True:
                    line = await _watched(resp.content.readline(), watch, wait, what, key, progress_s)
                    if not line:
                        return
                    if line.strip():
                        wait, what, key = self.idle_timeout_s, "its next token", "control.idle_timeout_s"
                        progress_s = None
                        yield decode_tagged(EXECUTE_EVENTS, line)
            finally:
                resp.close()  # an unfinished stream closes the connection: the node sees it
        except aiohttp.ClientError as exc:
            raise NodeUnavailable(f"generation node {node} failed mid-request: {exc!r}") from None

    async def _brief(self, node: str, path: str, msg: object, answer: type[T]) -> T:
        """One short call (connecting and answering within ``connect_timeout_s``): the node's
        answer, or the node's refusal raised as :meth:`_error` says; ``aiohttp.ClientError``
        and ``TimeoutError`` pass through."""
        async with asyncio.timeout(self.connect_timeout_s), self._post(node, path, encode(msg)) as resp:
            if resp.status != 200:
                raise await self._error(node, resp)
            return decode(answer, await resp.read())

    async def abort(self, node: str, request_id: str) -> None:
        try:
            answer = await self._brief(node, "/v1/abort", AbortRequest(WIRE_VERSION, request_id), AbortResponse)
        except TesseraError as exc:
            log.warning("request %s: %s", request_id, exc)
            return
        except (aiohttp.ClientError, TimeoutError):
            return  # the node is gone or wedged; its own pin timeout frees what it holds
        check_version(answer.version)
        log.debug("request %s on %s: %s", request_id, node,
                  "run cancelled" if answer.aborted else "not running; its pins are dropped")

    async def assist(self, plan: RequestPlan, layout: PromptLayout) -> None:
        """Ask ``plan.node`` to prefill and publish the plan's units of ``layout`` (an assist: the
        serving node computes them itself if they do not come, so a failure is only logged)."""
        wanted = {u.unit_id for u in plan.units}
        texts: dict[str, UnitText] = {}
        for seg in layout.segments:
            if seg.kind is SegmentKind.UNIT and seg.unit_id in wanted and seg.unit_id not in texts:
                texts[seg.unit_id] = UnitText(seg.unit_id, tuple(seg.token_ids))
        msg = PrefillRequest(WIRE_VERSION, plan, tuple(texts.values()))
        try:
            answer = await self._brief(plan.node, "/v1/prefill", msg, PrefillResponse)
        except TesseraError as exc:
            log.info("request %s: assist: %s", plan.request_id, exc)
            return
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("request %s: assist on %s not sent (%r)", plan.request_id, plan.node, exc)
            return
        check_version(answer.version)

    def assist_later(self, plan: RequestPlan, layout: PromptLayout) -> None:
        """:meth:`assist`, without waiting: the request's own execute goes out at once."""
        self.aborts.spawn(self.assist(plan, layout), name=f"assist-{plan.request_id[-8:]}")

    def abort_later(self, node: str, request_id: str) -> None:
        """Tell the node to stop a request, without waiting (the caller may be unwinding)."""
        self.aborts.spawn(self.abort(node, request_id), name=f"abort-{request_id[-8:]}")


async def _watched(step: Awaitable[T], watch: Watch, deadline_s: float, what: str, key: str,
                   progress_s: float | None = None) -> T:
    """Await one step of a call toward ``watch``'s node, within ``deadline_s``, while the node lives.

    Past the deadline the heartbeat decides: a node heard since the wait began is slow
    (:class:`NodeSlow`); one not heard yet is waited for until it reports in (slow) or the
    plane declares it dead (:class:`NodeUnavailable`), at most ``heartbeat_timeout_s`` more.
    With ``progress_s`` (a wait for a first token), a late node that ran prompt work since the
    wait began is draining its queue: the wait goes on for ``progress_s`` more, as long as each
    such span shows work run (:mod:`tessera.control.pace`).
    The step runs as its own task, never cancelled between looks at the node (a half-read
    line stays read); it is cancelled when the wait is given up or the caller is cancelled.
    """
    task = asyncio.ensure_future(step)
    watch.mark()
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    extended = False
    try:
        while True:
            left = end - loop.time()
            # NOTE: asyncio.wait, not wait_for: on Python 3.11 wait_for swallows a cancellation
            # that arrives as its awaitable completes, and a client's disconnect would be lost
            done, _ = await asyncio.wait((task,), timeout=max(0.01, min(WATCH_S, left)) if left > 0 else WATCH_S)
            if done:
                return task.result()
            await watch.look()
            if task.done():
                return task.result()
            if not watch.alive():
                raise NodeUnavailable(f"generation node {watch.name} stopped reporting in while we waited for {what} "
                                      "(control.heartbeat_timeout_s)")
            if loop.time() < end or not watch.heard_since_mark():
                continue
            if progress_s is not None and watch.progressed_since_mark():
                watch.mark()  # the queue moved: a new span, which must show work run again
                end, extended = loop.time() + progress_s, True
                log.debug("generation node %s is past the deadline for %s but ran prompt work: waiting %.0fs more",
                          watch.name, what, progress_s)
                continue
            stalled = f", nor run any prompt work in its last {progress_s:.0f}s" if extended else ""
            raise NodeSlow(f"generation node {watch.name} is alive but did not send {what} within "
                           f"{deadline_s:.0f}s ({key}){stalled}")
    finally:
        if not task.done():
            task.cancel()
