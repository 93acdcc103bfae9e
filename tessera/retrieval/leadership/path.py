"""The chat driver's way to the control plane: the plane in this process, or the leader's over RPC.

Without ``[ha]`` the retrieval process hosts the plane and every request uses
:class:`LocalPath`. With it, the replica that leads uses its own plane (:class:`LocalPath`,
which asks the :class:`~tessera.retrieval.leadership.office.Office` for the plane at every verb, so a
term that ended mid-request issues nothing more), and every other replica goes through the
leader's ``/control/route|plan|complete`` (:class:`RemotePath`). Both take the same verbs:

``route`` (the node and the attempt's :class:`~tessera.control.pace.Watch`), ``finalize``,
``started``, ``suspect``, ``complete`` and ``give_back`` (an unused plan's leases and grants).

A remote leader that cannot be reached (killed, paused, partitioned), or none elected, sends
the request down :class:`LeaderlessPath`: served without reuse under the last leader's term
(with no term known yet, a :class:`~tessera.errors.NotLeader`: 503 with ``Retry-After``,
never a connection error). ``complete``, ``suspect`` and ``give_back`` are best effort on a remote
leader (sent in the background; what is lost expires there on its own: request TTL, lease and
write timeouts, the node's heartbeats). A retry's ``route`` waits for the completion of the
attempt before it, since the leader refuses (409) to route a request id still outstanding.
So a follower fails over from a node exactly as the leader does (the chat driver's rules):
the node it could not reach is suspected on the leader's plane, and its waits judge slow or
gone by the leader's heartbeats (:class:`~tessera.control.pace.RemoteWatch`). A remote path
does not measure queueing (``started``): that is done where the heartbeats arrive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Protocol

from tessera.auth import plan_seal
from tessera.control.client import RequestControl
from tessera.control.pace import Heard, NodeWatch, RemoteWatch, Watch, first_token_deadline_s
from tessera.control.plane import ControlPlane
from tessera.errors import ControlPlaneError, NotLeader, TesseraError
from tessera.messages.control import CancelRequest, ReleaseRequest
from tessera.messages.plan import Preparation, RequestPlan, Retention, UnitPlan
from tessera.runtime import BackgroundTasks
from tessera.wire import WIRE_VERSION

log = logging.getLogger(__name__)


class RequestPath(Protocol):
    async def route(self, request_id: str, units: Sequence[tuple[str, int]], exclude: Collection[str],
                    prompt_tokens: int, waited_s: float = 0.0) -> tuple[str, Watch]: ...

    async def finalize(self, request_id: str, node: str, held: Collection[str]) -> RequestPlan: ...

    def started(self, request_id: str) -> None: ...

    def suspect(self, node: str) -> None: ...

    def complete(self, request_id: str) -> None: ...

    def give_back(self, plan: RequestPlan) -> None: ...


def _grants(plan: RequestPlan) -> tuple[tuple[str, ...], list[CancelRequest]]:
    """The plan's leases and its grants as cancels (an assist's grants stay: its node may be
    writing them already, and a reservation never written lapses on its own)."""
    leases = tuple(u.lease.lease_id for u in plan.units if u.lease is not None)
    cancels = [CancelRequest(WIRE_VERSION, u.grant.unit_id, u.grant.epoch, u.grant.writer, 0.0)
               for u in plan.units if u.grant is not None]
    return leases, cancels


class LocalPath:
    """The plane this process holds; ``plane()`` raises NotLeader once the term ended.

    Only issuing (route, finalize) asks ``plane()``; the bookkeeping of a request already
    routed (started, suspect, complete, give_back) goes to the plane that routed it, whose
    term may have ended meanwhile: it issues nothing, and a reply already streamed is not
    turned into an error by its completion.
    """

    def __init__(self, plane: Callable[[], ControlPlane]) -> None:
        self.plane = plane
        self.routed_by: ControlPlane | None = None

    async def route(self, request_id: str, units: Sequence[tuple[str, int]], exclude: Collection[str],
                    prompt_tokens: int, waited_s: float = 0.0) -> tuple[str, Watch]:
        plane = self.routed_by = self.plane()
        target = plane.route(request_id, units, exclude, waited_s)
        node = plane.generation_node(target)
        deadline_s = first_token_deadline_s(node, prompt_tokens, plane.config.control.first_token_timeout_s)
        return target, NodeWatch(node, plane.clock, deadline_s)

    async def finalize(self, request_id: str, node: str, held: Collection[str]) -> RequestPlan:
        return self.plane().finalize(request_id, node, held)

    def started(self, request_id: str) -> None:
        if self.routed_by is not None:
            self.routed_by.started(request_id)

    def suspect(self, node: str) -> None:
        if self.routed_by is not None:
            self.routed_by.suspect(node)

    def complete(self, request_id: str) -> None:
        if self.routed_by is not None:
            self.routed_by.complete(request_id)

    def give_back(self, plan: RequestPlan) -> None:
        if self.routed_by is None:
            return
        leases, cancels = _grants(plan)
        if leases:
            self.routed_by.release(ReleaseRequest(WIRE_VERSION, leases))
        for msg in cancels:
            self.routed_by.cancel(msg)


class RemotePath:
    """The leader's plane over its signed RPCs (``control.base_url`` follows the election)."""

    def __init__(self, control: RequestControl, tasks: BackgroundTasks, retry_after_s: float, heard: Heard,
                 leaderless: LeaderlessPath | None = None) -> None:
        self.control = control
        self.tasks = tasks
        self.retry_after_s = retry_after_s
        self.heard = heard  # the leader's heartbeats, for the attempts' watches
        self._completing: asyncio.Task[None] | None = None  # the previous attempt's completion
        # where the request goes once the leader cannot be reached (None: a 503 instead)
        self.leaderless = leaderless
        self._diverted: LeaderlessPath | None = None  # the leaderless path, once this request took it
        self._units: tuple[tuple[str, int], ...] = ()  # what the last route asked for

    def _divert(self, request_id: str, exc: ControlPlaneError | NotLeader) -> LeaderlessPath:
        """The leader is unreachable, or no longer (or not yet) leads: a failover is under way, and
        the request goes on without reuse (a 503 where no leader's term is known yet)."""
        if self.leaderless is None:
            raise NotLeader(f"the leader's control plane at {self.control.base_url} cannot be reached ({exc}); "
                            "a new leader takes over within ha.lease_ttl_s: retry", self.retry_after_s) from None
        log.info("request %s: no leader can be reached (%s); served without reuse", request_id, exc)
        self._diverted = self.leaderless
        return self._diverted

    async def route(self, request_id: str, units: Sequence[tuple[str, int]], exclude: Collection[str],
                    prompt_tokens: int, waited_s: float = 0.0) -> tuple[str, Watch]:
        if self._completing is not None:
            await asyncio.shield(self._completing)  # best effort, bounded by the client's timeout
        if self._diverted is not None:
            return await self._diverted.route(request_id, units, exclude, prompt_tokens, waited_s)
        try:
            routed = await self.control.route_request(request_id, units, exclude, prompt_tokens, waited_s)
        except (ControlPlaneError, NotLeader) as exc:
            return await self._divert(request_id, exc).route(request_id, units, exclude, prompt_tokens, waited_s)
        self._units = tuple(units)
        return routed.node, RemoteWatch(routed.node, routed.first_token_s, self.heard)

    async def finalize(self, request_id: str, node: str, held: Collection[str]) -> RequestPlan:
        if self._diverted is not None:
            return await self._diverted.finalize(request_id, node, held)
        try:
            return await self.control.finalize(request_id, node, held)
        except (ControlPlaneError, NotLeader) as exc:
            # the leader went between route and plan: the routed node serves without reuse
            diverted = self._divert(request_id, exc)
            diverted.adopt(request_id, self._units)
            return await diverted.finalize(request_id, node, held)

    def started(self, request_id: str) -> None:
        pass  # queueing is measured where the heartbeats arrive, on the leader

    def suspect(self, node: str) -> None:
        if self._diverted is not None:
            return
        self.tasks.spawn(self._best_effort(self.control.suspect(node), f"suspect {node}"), name=f"suspect-{node}")

    def complete(self, request_id: str) -> None:
        if self._diverted is not None:
            self._diverted.complete(request_id)
            return
        self._completing = self.tasks.spawn(
            self._best_effort(self.control.complete(request_id), f"complete {request_id}"),
            name=f"complete-{request_id[-8:]}")

    def give_back(self, plan: RequestPlan) -> None:
        if self._diverted is not None:
            return  # its plans lease and grant nothing
        leases, cancels = _grants(plan)
        if leases:
            self.tasks.spawn(self._best_effort(self.control.release(leases), f"release {len(leases)} leases"),
                             name=f"release-{plan.request_id[-8:]}")
        for msg in cancels:
            self.tasks.spawn(self._best_effort(self.control.cancel(msg), f"cancel {msg.unit_id}"),
                             name=f"cancel-{msg.unit_id[:8]}")

    @staticmethod
    async def _best_effort(call: Awaitable[object], what: str) -> None:
        try:
            await call
        except TesseraError as exc:
            log.info("%s on the leader failed (it expires there on its own): %s", what, exc)


class LeaderlessPath:
    """While no leader can be reached: every unit computed, under the last leader's term.

    A failover leaves the cluster without a plane for up to ``ha.lease_ttl_s`` and one
    heartbeat; the generation nodes still run, so a replica keeps chat available by serving
    without reuse: a plan with every unit COMPUTE and nothing retained (no lease, grant,
    local insert or eviction), sealed with the cluster secret under the term of the leader
    it last knew. Such a plan touches no state a plane owns: it cannot corrupt the shared
    tier, fill a local cache behind the next leader's back, or serve a deleted unit from a
    cache. Nodes are taken in turn (a failed one is left for the next, as the chat driver
    retries); a late node counts as slow, since no heartbeats are heard here. Once the next
    leader's plans reach a node its term is newer, so this term's plans are refused there
    and chat goes through the new leader.
    """

    def __init__(self, nodes: Sequence[str], term: int, secret: bytes | None, first_token_s: float,
                 cursor: list[int]) -> None:
        self.nodes = list(nodes)
        self.term = term
        self.secret = secret
        self.first_token_s = first_token_s
        self._cursor = cursor  # shared by the replica's requests: turns go round the nodes
        self._units: dict[str, tuple[tuple[str, int], ...]] = {}

    async def route(self, request_id: str, units: Sequence[tuple[str, int]], exclude: Collection[str],
                    prompt_tokens: int, waited_s: float = 0.0) -> tuple[str, Watch]:
        candidates = [n for n in self.nodes if n not in exclude]
        if not candidates:
            raise NotLeader(f"no generation node could serve the request (tried {', '.join(sorted(exclude))}); "
                            "retry", 1.0)
        self._cursor[0] = (self._cursor[0] + 1) % len(candidates)
        node = candidates[self._cursor[0]]
        self.adopt(request_id, units)
        return node, UnwatchedNode(node, self.first_token_s)

    def adopt(self, request_id: str, units: Sequence[tuple[str, int]]) -> None:
        """Plan ``request_id`` here, on whichever node it was routed to."""
        self._units[request_id] = tuple(units)

    async def finalize(self, request_id: str, node: str, held: Collection[str]) -> RequestPlan:
        units = tuple(UnitPlan(u, n, Preparation.COMPUTE, Retention.NEITHER)
                      for u, n in self._units.get(request_id, ()))
        seal = "" if self.secret is None else plan_seal(self.secret, node, self.term, request_id)
        return RequestPlan(WIRE_VERSION, request_id, node, units, (), self.term, seal)

    def started(self, request_id: str) -> None:
        pass

    def suspect(self, node: str) -> None:
        pass  # routing here takes no liveness view; a failed node is excluded by the retry

    def complete(self, request_id: str) -> None:
        self._units.pop(request_id, None)

    def give_back(self, plan: RequestPlan) -> None:
        pass  # nothing leased or granted


class UnwatchedNode:
    """A node no heartbeats are heard of here: alive until a call to it fails, late means slow."""

    def __init__(self, name: str, first_token_s: float) -> None:
        self.name = name
        self.first_token_s = first_token_s

    async def look(self) -> None:
        pass

    def alive(self) -> bool:
        return True

    def mark(self) -> None:
        pass

    def heard_since_mark(self) -> bool:
        return True

    def progressed_since_mark(self) -> bool:
        return False
