"""A simulated cluster: the real control plane, on a simulated clock, with generation nodes that
do exactly what their plans say.

The plane's verbs are called directly with the messages the roles would send; memory nodes
only say hello and no block is ever written. The tests and ``bench/control_plane.py`` both
drive the plane through this class, so they see the same cluster.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.config import ClusterConfig
from tessera.control.plane import ControlPlane
from tessera.messages.control import LoadReport, PublishRequest, ReleaseRequest, ResidencyReport
from tessera.messages.kvpool import MemoryNodeHello
from tessera.messages.plan import RequestPlan
from tessera.units import blocks_for
from tessera.wire import WIRE_VERSION


class SimulatedClock:
    """A clock that moves only when advanced (``clock()`` reads it, like ``time.monotonic``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def memory_node_hello(name: str = "kv0", capacity: int = 16, boot: str = "boot-1") -> MemoryNodeHello:
    """The hello of a simulated memory node (1 KiB slots; its data address is never used)."""
    return MemoryNodeHello(WIRE_VERSION, name, boot, capacity, 1024, f"tessera-{name}", "127.0.0.1", 7501)


class SimulatedCluster:
    """A control plane plus generation nodes that do exactly what their plans say.

    ``caches``: each generation node's local cache (unit ids); ``blocks``: unit -> blocks, as
    the nodes learned it from the requests they were asked about. Both may be edited to
    simulate a node that lost its cache without telling anyone.
    """

    def __init__(self, config: ClusterConfig, *, join_memory: bool = True, join_generation: bool = True) -> None:
        self.config = config
        self.block_tokens = config.block_tokens
        self.clock = SimulatedClock()
        self.plane = ControlPlane(config, clock=self.clock)
        self.caches: dict[str, set[str]] = {n.name: set() for n in config.generation}
        self.blocks: dict[str, int] = {}
        self._capacity = {n.name: n.local_capacity_blocks for n in config.generation}
        self._ids = 0
        if join_memory:
            for pool in config.kvpools:
                self.plane.hello(memory_node_hello(pool.name, pool.capacity_blocks))
        if join_generation:
            self.heartbeat()

    def heartbeat(self, *names: str, prefill_tokens_per_s: float = 0.0, prompt_batches: int = 0) -> None:
        """Generation nodes report in (all by default): only a node heard from is routable;
        ``prompt_batches``: the count of prompt batches each says it ran (a change: its queue moved)."""
        for name in names or list(self.caches):
            self.plane.load(LoadReport(WIRE_VERSION, name, 0, prefill_tokens_per_s=prefill_tokens_per_s,
                                       prompt_batches=prompt_batches))

    def rid(self) -> str:
        """A new request id."""
        self._ids += 1
        return f"r{self._ids}"

    def snapshot(self, node: str, units: Sequence[tuple[str, int]]) -> list[str]:
        """Step 3: the units of a request (unit_id, n_tokens) that ``node`` holds (and pins)."""
        b = self.block_tokens
        for u, n in units:
            self.blocks[u] = blocks_for(n, b)
        cache = self.caches[node]
        return [u for u, _ in units if u in cache]

    def plan(self, units: Sequence[tuple[str, int]], request_id: str | None = None) -> RequestPlan:
        """Route, snapshot from the chosen node's real cache, finalize. The request stays in flight."""
        rid = request_id or self.rid()
        node = self.plane.route(rid, units)
        return self.plane.finalize(rid, node, self.snapshot(node, units))

    def execute(self, plan: RequestPlan, *, publish: bool = True, release: bool = True,
                complete: bool = True, decline: bool = False) -> None:
        """The node follows the plan: drop victims, insert what fits (``decline``: not the first),
        write back + publish, release, report."""
        plane, blocks, b = self.plane, self.blocks, self.block_tokens
        cache = self.caches[plan.node]
        cache.difference_update(plan.local_evict)
        used = sum(blocks[u] for u in cache)
        capacity = self._capacity[plan.node]
        inserted: list[str] = []
        declined: list[str] = []
        leases: list[str] = []
        for up in plan.units:
            u = up.unit_id
            if up.retention.local:
                fits = u in cache or used + blocks_for(up.n_tokens, b) <= capacity
                if fits and not (decline and not declined):
                    if u not in cache:
                        cache.add(u)
                        used += blocks[u]
                    inserted.append(u)
                else:
                    declined.append(u)
            if up.lease is not None:
                leases.append(up.lease.lease_id)
        # the writers publish: this node, and the helpers of the plan's assists
        for up in (*plan.units, *(u for a in plan.assists for u in a.units)) if publish else ():
            if up.grant is not None:
                g = up.grant
                plane.publish(PublishRequest(WIRE_VERSION, g.unit_id, g.epoch, g.writer, g.blocks))
        if release and leases:
            plane.release(ReleaseRequest(WIRE_VERSION, tuple(leases)))
        plane.residency(ResidencyReport(WIRE_VERSION, plan.node, tuple(inserted), (*plan.local_evict, *declined)))
        if complete:
            plane.complete(plan.request_id)

    def serve(self, units: Sequence[tuple[str, int]]) -> RequestPlan:
        """One request from route to complete."""
        plan = self.plan(units)
        self.execute(plan)
        return plan
