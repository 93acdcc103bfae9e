"""One chat request through the cluster: route → snapshot → plan → execute → complete, with retries.

:meth:`ChatDriver.run` takes the request's fixed layout and yields the serving generation
node's events (tokens, then one ``DoneEvent``). Each attempt asks the control plane to
route, takes the chosen node's snapshot, finalizes the plan against it and streams the
node's execution; whatever happens, the attempt's route is completed.

Retries follow the node, never the clock: a node that failed (unreachable, a broken stream,
silent past its heartbeats, an ``ErrorEvent``) or refused (429) is left for another one, at
most ``control.max_attempts`` nodes, as long as nothing reached the client yet (the
:class:`Receiver` says; a non-streamed reply sends nothing before its end, so it is retried
even after tokens came). A failed node leaves routing; one that refused stays. A node that
is alive but slow (:class:`~tessera.retrieval.chat.generation_client.NodeSlow`: it missed a
deadline that follows its work while still reporting in) is neither retried nor suspected:
another node would have to redo the same work. A failed attempt's leases and grants go back
at once. An attempt that ends before its ``DoneEvent`` (a deadline, a broken stream, a stop
string, a client gone: the consumer closes :meth:`run`) tells the node to abort.

The queueing bound (``control.max_queue_wait_s``, held by the plane when it routes and by the
node when it starts the work) runs from the request's arrival, less the time of the attempts
whose node failed. Finding a node dead can take longer than the bound (its heartbeats must
go silent first); that time went to a failure, not to a queue, and counting it would turn a
dead node into a 429 while another node was free. A node that refused is different: the
request queued there until its bound ran out, and that time still counts, or a request
bounced between busy nodes would queue the bound once per node; its retry goes only where
nothing is queued ahead of it.

This module knows nothing about HTTP, text or metrics: it relays node events as they come.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Collection
from typing import Protocol

from tessera.control.pace import Watch
from tessera.errors import Overloaded, TesseraError, Unavailable
from tessera.messages.generation import DoneEvent, ErrorEvent, ExecuteRequest, SamplingParams, TokenEvent
from tessera.messages.plan import RequestPlan
from tessera.messages.prompt import PromptLayout, SegmentKind
from tessera.retrieval.chat.generation_client import NodeClients, NodeUnavailable
from tessera.retrieval.node import RetrievalNode
from tessera.wire import WIRE_VERSION

log = logging.getLogger(__name__)


class NodeFailed(TesseraError):
    """The node answered the request with an ``ErrorEvent`` (HTTP 503; retried while nothing was sent)."""


class Receiver(Protocol):
    """The consumer of :meth:`ChatDriver.run`: whether it may still start the reply over."""

    def committed(self) -> bool:
        """True once anything of the reply reached the client: a failure can no longer be retried."""
        ...

    def restart(self) -> None:
        """Forget the events taken so far: the request starts over on another node."""
        ...


Failure = NodeUnavailable | NodeFailed | Overloaded


class ChatDriver:
    """Drives one request's attempts; ``target`` is the node of the latest one."""

    def __init__(self, node: RetrievalNode, nodes: NodeClients, sampling: SamplingParams, tenant: str = "",
                 arrived: float | None = None) -> None:
        self.path = node.office.path()  # the leader's plane: in this process, or over its RPCs
        # perf_counter at the request's arrival: the time before routing counts against the
        # queueing bound (control/overload.py)
        self.arrived = time.perf_counter() if arrived is None else arrived
        self.excused_s = 0.0  # time of the attempts whose node failed: not counted (module docstring)
        self.control = node.config.control
        self.nodes = nodes
        self.sampling = sampling
        self.tenant = tenant
        self.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.target = ""
        self.plan: RequestPlan | None = None

    async def run(self, layout: PromptLayout, receiver: Receiver, *, order_free: bool = False,
                  recurring: bool = False, setting: str = "") -> AsyncGenerator[TokenEvent | DoneEvent, None]:
        """Yield the serving node's events; another node is tried while nothing reached the client.
        ``order_free``: the layout's units were ordered for exact prefix reuse (the node may match
        its prefix cache into them), ``recurring``: in an order served before; ``setting``: the
        composition setting chosen for it ("": the node's)."""
        refs = self._unit_refs(layout)
        tried: set[str] = set()
        failed: Failure | None = None
        attempts = self.control.max_attempts
        for attempt in range(1, attempts + 1):
            self.plan = None
            delivered = finished = False
            began = time.perf_counter()
            self.target, watch = await self._route(refs, tried, failed, layout.n_tokens)
            try:
                msg = await self._plan(watch, layout, refs, order_free=order_free, recurring=recurring,
                                       setting=setting)
                async with contextlib.aclosing(self.nodes.execute(watch, msg)) as node_events:
                    async for event in node_events:
                        if not delivered:
                            self.path.started(self.request_id)  # its queueing ended: overload control measures it
                        delivered = True
                        if isinstance(event, ErrorEvent):
                            if event.refused:  # its queueing bound ran out there: busy, not failed
                                raise Overloaded(f"generation node {self.target}: {event.message}")
                            raise NodeFailed(f"generation node {self.target} failed: {event.message}")
                        finished = isinstance(event, DoneEvent)
                        yield event
                finished = True
                return
            except (NodeUnavailable, NodeFailed, Overloaded) as exc:
                if isinstance(exc, NodeUnavailable):
                    self.path.suspect(self.target)
                if not isinstance(exc, Overloaded):  # failed, not queued: see the module docstring
                    self.excused_s += time.perf_counter() - began
                if not delivered:
                    self._return_grants()
                if receiver.committed() or attempt == attempts:
                    raise
                if delivered:
                    receiver.restart()
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

    async def _route(self, refs: dict[str, int], tried: Collection[str], failed: Failure | None,
                     prompt_tokens: int) -> tuple[str, Watch]:
        """The attempt's node and its watch (its first-token deadline: the prompt's work there)."""
        try:
            return await self.path.route(self.request_id, list(refs.items()), tried, prompt_tokens,
                                         waited_s=self._waited_s())
        except Unavailable:
            if isinstance(failed, Overloaded):
                raise failed from None  # every node that could serve is full: 429, not 503
            raise

    async def _plan(self, watch: Watch, layout: PromptLayout, refs: dict[str, int], *,
                    order_free: bool, recurring: bool, setting: str) -> ExecuteRequest:
        """Snapshot the routed node (it pins what it holds) and finalize the plan against it."""
        snap = await self.nodes.snapshot(watch, self.request_id, list(refs))
        self.plan = await self.path.finalize(self.request_id, self.target, snap.held)
        for assist in self.plan.assists:  # idle nodes prefill some units at the same time
            self.nodes.assist_later(assist, layout)
        bound = self.control.max_queue_wait_s
        # what is left of the queueing bound: the node refuses the request if its work cannot
        # begin within it (tessera.generation.scheduler, late starts)
        budget = max(0.0, bound - self._waited_s()) if bound > 0 else None
        return ExecuteRequest(WIRE_VERSION, self.request_id, layout, self.plan, self.sampling, self.tenant,
                              queue_budget_s=budget, exact_into_units=order_free, recurring=recurring,
                              setting=setting)

    def _waited_s(self) -> float:
        """The time that counts against the queueing bound: since arrival, less failed attempts."""
        return max(0.0, time.perf_counter() - self.arrived - self.excused_s)

    def _complete(self, finished: bool) -> None:
        """The attempt is over: an unfinished run is aborted on its node, and its route completed."""
        if self.plan is not None and not finished:
            # deadline, broken stream, stop string or a client that went away: the node
            # may still be working on it (or hold its pins); tell it to stop
            self.nodes.abort_later(self.target, self.request_id)
        self.path.complete(self.request_id)

    def _return_grants(self) -> None:
        """The node never got the plan: give its leases and reservations back at once."""
        if self.plan is not None:
            self.path.give_back(self.plan)
