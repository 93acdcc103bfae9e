"""One simulated cluster: the real :class:`ControlPlane` deciding for simulated nodes.

The plane is built exactly as the retrieval role builds it, on the event loop's simulated
clock; memory nodes say hello, generation nodes heartbeat every ``HEARTBEAT_S`` (load
reports with their queued tokens) and the plane ticks as often. Each request follows the
chat driver's path: (the retrieval role's CPU, then ``request_overhead_s``) route → the node's snapshot →
finalize → execute → started at its first token → complete at its last. Every call into the
plane is timed with ``perf_counter`` (:class:`TimedPlane`): that is the control plane's real
CPU cost, request by request, whatever the simulated cluster's size.

The other roles' CPU per request (the cost model's ``cpu_per_request_s``) runs on their
host's cores beside the engines: the retrieval role's on the request's path, the load
generator's, the memory node's and the generation node's event loop's beside it.

This module knows nothing about workloads' origin, sweeps or plots.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.control.plane import ControlPlane
from tessera.control.simulated import memory_node_hello
from tessera.engines.base import ENGINES
from tessera.errors import PublishRejected
from tessera.generation.node import HEARTBEAT_S
from tessera.messages.control import CancelRequest, LoadReport, PublishRequest, ReleaseRequest, ResidencyReport
from tessera.messages.generation import RequestStats
from tessera.messages.plan import WriteGrant
from tessera.wire import WIRE_VERSION
from tessera_lab.simulate.costs import CostModel
from tessera_lab.simulate.engine import Host
from tessera_lab.simulate.events import EventLoop
from tessera_lab.simulate.node import Execution, SimNode
from tessera_lab.simulate.workload import SimRequest

T = TypeVar("T")


def _nothing() -> None:
    """A background CPU job's end: nothing waits for it."""


@dataclass
class PlaneTime:
    """Seconds of real CPU spent in the plane's verbs: per verb, and on each request's own path."""

    by_verb: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, verb: str, seconds: float) -> None:
        self.by_verb[verb] = self.by_verb.get(verb, 0.0) + seconds
        self.calls[verb] = self.calls.get(verb, 0) + 1

    @property
    def total_s(self) -> float:
        return sum(self.by_verb.values())


class TimedPlane:
    """The node reports and the driver's calls, forwarded to the real plane and timed."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.time = PlaneTime()
        self.rejected = 0  # publishes refused (reservation expired)

    def call(self, verb: str, fn: Callable[[], T], out: Outcome | None = None) -> T:
        """``fn()`` (one plane verb), its CPU time added to ``verb`` and to the request ``out``."""
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        self.time.add(verb, seconds)
        if out is not None:
            out.plane_s += seconds
        return result

    # NodeReports
    def residency(self, node: str, inserted: Sequence[str], evicted: Sequence[str], kept: Sequence[str]) -> None:
        msg = ResidencyReport(WIRE_VERSION, node, tuple(inserted), tuple(evicted), tuple(kept))
        self.call("residency", lambda: self.plane.residency(msg))

    def publish(self, grant: WriteGrant) -> None:
        msg = PublishRequest(WIRE_VERSION, grant.unit_id, grant.epoch, grant.writer, grant.blocks)
        try:
            self.call("publish", lambda: self.plane.publish(msg))
        except PublishRejected:
            # the reservation expired while the unit waited in the node's queue: the real
            # retainer logs it as a write failure and the unit is simply not shared
            self.rejected += 1

    def give_up(self, grant: WriteGrant) -> None:
        msg = CancelRequest(WIRE_VERSION, grant.unit_id, grant.epoch, grant.writer, 0.0)
        self.call("cancel", lambda: self.plane.cancel(msg))

    def release(self, lease_ids: Sequence[str]) -> None:
        msg = ReleaseRequest(WIRE_VERSION, tuple(lease_ids))
        self.call("release", lambda: self.plane.release(msg))


@dataclass
class Outcome:
    """One request's simulated life (times in seconds since the run started)."""

    sent_at: float
    ttft: float | None = None
    latency: float | None = None
    node: str = ""
    stats: RequestStats | None = None
    plane_s: float = 0.0  # CPU in the plane on this request's own path (route, finalize, started, complete)


class SimCluster:
    def __init__(self, config: ClusterConfig, costs: CostModel, loop: EventLoop | None = None) -> None:
        self.config = config
        self.costs = costs
        self.loop = loop or EventLoop()
        self.plane = ControlPlane(config, clock=self.loop.clock)
        self.timed = TimedPlane(self.plane)
        self.mode = config.control.mode
        policy = policy_from_config(config.composition)
        hosts = {g.host: Host(self.loop, costs) for g in config.generation}  # nodes of one host share its cores
        self.hosts = hosts
        # the real node prefills a missing unit inside its request's extend iff its engine can
        fuse = ENGINES.get(config.model.engine).fuses_unit_prefills
        self.nodes = {g.name: SimNode(g, config.transport, config.block_tokens, self.loop, costs, policy, self.mode,
                                      self.timed, hosts[g.host], fuse) for g in config.generation}
        # the other roles' CPU goes to the host they run on; one without engines has nothing to slow
        self._front = hosts.get(config.retrieval.host)  # the retrieval role, and the load generator beside it
        self._pool_host = hosts.get(config.kvpools[0].host) if config.kvpools else None
        self._hellos = [memory_node_hello(pool.name, pool.capacity_blocks) for pool in config.kvpools]
        self._ids = 0
        self.outstanding = 0
        self.started_at = self.loop.now
        self._heartbeat()

    def _heartbeat(self) -> None:
        # memory nodes repeat their hello (a silent one is dropped with its entries), generation
        # nodes send their load; then the plane's periodic tick
        for hello in self._hellos:
            self.timed.call("hello", partial(self.plane.hello, hello))
        for node in self.nodes.values():
            e = node.engine
            msg = LoadReport(WIRE_VERSION, node.name, node.inflight, e.queued_tokens, e.prefill_tokens_per_s)
            self.timed.call("load", partial(self.plane.load, msg))
        self.timed.call("tick", self.plane.tick)
        self.loop.after(HEARTBEAT_S, self._heartbeat)

    def send(self, req: SimRequest, max_tokens: int, done: Callable[[Outcome], None]) -> None:
        """The request arrives now; ``done`` gets its outcome once its last token is out."""
        out = Outcome(self.loop.now)
        self.outstanding += 1
        self._charge("client", self._front)

        def retrieved() -> None:
            self.loop.after(self.costs.request_overhead_s, lambda: self._serve(req, max_tokens, out, done))

        # the retrieval role's CPU (HTTP, search, prompt, tokens) is on the request's path
        retrieval = self.costs.role_cpu_s("retrieval")
        if retrieval and self._front is not None:
            self._front.cpu(retrieval, retrieved)
        else:
            self.loop.after(retrieval, retrieved)

    def _charge(self, role: str, host: Host | None) -> None:
        """``role``'s CPU for one request, run beside the request on ``host`` (none: nothing to slow)."""
        seconds = self.costs.role_cpu_s(role)
        if seconds and host is not None:
            host.cpu(seconds, _nothing)

    def _serve(self, req: SimRequest, max_tokens: int, out: Outcome, done: Callable[[Outcome], None]) -> None:
        self._ids += 1
        rid = f"sim-{self._ids}"
        refs = req.unit_refs() if self.mode == "compose" else []
        timed, plane = self.timed, self.plane
        name = timed.call("route", lambda: plane.route(rid, refs), out)
        node = self.nodes[name]
        self._charge("generation", node.engine.host)
        self._charge("kvpool", self._pool_host)
        held = node.snapshot(rid, [u for u, _ in refs])
        plan = timed.call("finalize", lambda: plane.finalize(rid, name, held), out)
        out.node = name

        def first(stats: RequestStats) -> None:
            out.ttft = self.loop.now - out.sent_at
            timed.call("started", lambda: plane.started(rid), out)

        def finished(stats: RequestStats) -> None:
            out.latency = self.loop.now - out.sent_at
            out.stats = stats
            timed.call("complete", lambda: plane.complete(rid), out)
            self.outstanding -= 1
            done(out)

        node.execute(Execution(rid, req.layout, req.tenant, req.max_tokens or max_tokens,
                               plan if refs else None, first, finished))
