"""One chat request through the cluster: route → snapshot → plan → execute → complete, with retries.

:meth:`ChatDriver.run` takes the request's fixed layout and yields the serving generation
node's events (tokens, then one ``DoneEvent`` or ``ErrorEvent``). Each attempt asks the
control plane to route, takes the chosen node's snapshot, finalizes the plan against it and
streams the node's execution; whatever happens, the attempt's route is completed. A node
that cannot be reached, misses a deadline or answers 429 before its first event is left for
another one (at most ``control.max_attempts`` nodes): the failed attempt's leases and grants
go back at once. An attempt that ends before its ``DoneEvent`` (a deadline, a broken stream,
a stop string, a client gone: the consumer closes :meth:`run`) tells the node to abort.

This module knows nothing about HTTP, text or metrics: it relays node events as they come.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Collection

from tessera.errors import Overloaded, Unavailable
from tessera.messages import (
    CancelRequest,
    DoneEvent,
    ErrorEvent,
    ExecuteEvent,
    ExecuteRequest,
    PromptLayout,
    ReleaseRequest,
    RequestPlan,
    SamplingParams,
    SegmentKind,
)
from tessera.retrieval.generation_client import NodeClients, NodeUnavailable
from tessera.retrieval.node import RetrievalNode
from tessera.wire import WIRE_VERSION

log = logging.getLogger(__name__)


class ChatDriver:
    """Drives one request's attempts; ``target`` is the node of the latest one."""

    def __init__(self, node: RetrievalNode, nodes: NodeClients, sampling: SamplingParams, tenant: str = "") -> None:
        self.plane = node.plane
        self.control = node.config.control
        self.nodes = nodes
        self.sampling = sampling
        self.tenant = tenant
        self.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.target = ""
        self.plan: RequestPlan | None = None

    async def run(self, layout: PromptLayout) -> AsyncGenerator[ExecuteEvent, None]:
        """Yield the serving node's events; another node is tried while none was delivered."""
        refs = self._unit_refs(layout)
        tried: set[str] = set()
        failed: NodeUnavailable | Overloaded | None = None
        attempts = self.control.max_attempts
        for attempt in range(1, attempts + 1):
            self.target = self._route(refs, tried, failed)
            self.plan = None
            delivered = finished = False
            try:
                msg = await self._plan(layout, refs)
                async with contextlib.aclosing(self.nodes.execute(self.target, msg)) as node_events:
                    async for event in node_events:
                        if not delivered:
                            self.plane.started(self.request_id)  # its queueing ended: overload control measures it
                        delivered = True
                        finished = isinstance(event, DoneEvent | ErrorEvent)
                        yield event
                finished = True
                return
            except (NodeUnavailable, Overloaded) as exc:
                if isinstance(exc, NodeUnavailable):
                    self.plane.suspect(self.target)
                if not delivered:
                    self._return_grants()
                if delivered or attempt == attempts:
                    raise
                failed = exc
                tried.add(self.target)
                log.info("request %s: %s; trying another node (attempt %d of %d)",
                         self.request_id, exc, attempt + 1, attempts)
            finally:
                self._complete(finished)

    def _unit_refs(self, layout: PromptLayout) -> dict[str, int]:
        """The layout's units and their token counts, in prompt order (none outside compose mode)."""
        refs: dict[str, int] = {}
        if self.control.mode == "compose":
            for seg in layout.segments:
                if seg.kind is SegmentKind.UNIT:
                    refs.setdefault(seg.unit_id, len(seg.token_ids))
        return refs

    def _route(self, refs: dict[str, int], tried: Collection[str], failed: NodeUnavailable | Overloaded | None) -> str:
        try:
            return self.plane.route(self.request_id, list(refs.items()), tried)
        except Unavailable:
            if isinstance(failed, Overloaded):
                raise failed from None  # every node that could serve is full: 429, not 503
            raise

    async def _plan(self, layout: PromptLayout, refs: dict[str, int]) -> ExecuteRequest:
        """Snapshot the routed node (it pins what it holds) and finalize the plan against it."""
        snap = await self.nodes.snapshot(self.target, self.request_id, list(refs))
        self.plan = self.plane.finalize(self.request_id, self.target, snap.held)
        return ExecuteRequest(WIRE_VERSION, self.request_id, layout, self.plan, self.sampling, self.tenant)

    def _complete(self, finished: bool) -> None:
        """The attempt is over: an unfinished run is aborted on its node, and its route completed."""
        if self.plan is not None and not finished:
            # deadline, broken stream, stop string or a client that went away: the node
            # may still be working on it (or hold its pins); tell it to stop
            self.nodes.abort_later(self.target, self.request_id)
        self.plane.complete(self.request_id)

    def _return_grants(self) -> None:
        """The node never got the plan: give its leases and reservations back at once."""
        if self.plan is None:
            return
        leases = tuple(u.lease.lease_id for u in self.plan.units if u.lease is not None)
        if leases:
            self.plane.release(ReleaseRequest(WIRE_VERSION, leases))
        for u in self.plan.units:
            if u.grant is not None:
                self.plane.cancel(CancelRequest(WIRE_VERSION, u.grant.unit_id, u.grant.epoch, u.grant.writer, 0.0))
