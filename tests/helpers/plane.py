"""An in-process control plane (fake clock) with generation nodes that follow its plans, and plan views."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from helpers.clock import Clock
from helpers.cluster import cluster_config
from tessera.config import ClusterConfig
from tessera.control.plane import ControlPlane
from tessera.messages import (
    LoadReport,
    MemoryNodeHello,
    Preparation,
    PublishRequest,
    ReleaseRequest,
    RequestPlan,
    ResidencyReport,
)
from tessera.units import blocks_for
from tessera.wire import WIRE_VERSION

B = 4  # block size of every test cluster


def plane_config(*, nodes: int = 2, local_blocks: int = 16, shared_blocks: int = 16,
                 kvpools: int = 1, **control: Any) -> ClusterConfig:
    """A small cluster (B = 4, 16 blocks per tier) for an in-process control plane."""
    return cluster_config(nodes=nodes, local_blocks=local_blocks, kvpools=kvpools, kv_blocks=shared_blocks,
                          block_tokens=B, **control)


def hello(name: str = "kv0", capacity: int = 16, boot: str = "boot-1") -> MemoryNodeHello:
    return MemoryNodeHello(WIRE_VERSION, name, boot, capacity, 1024, f"tessera-{name}", "127.0.0.1", 7501)


class Cluster:
    """A control plane plus generation nodes that do exactly what their plans say."""

    def __init__(self, config: ClusterConfig | None = None, *, join_memory: bool = True, join_generation: bool = True,
                 **kw: object) -> None:
        self.config = config or plane_config(**kw)  # type: ignore[arg-type]
        self.clock = Clock()
        self.plane = ControlPlane(self.config, clock=self.clock)
        self.caches: dict[str, set[str]] = {n.name: set() for n in self.config.generation}
        self._ids = 0
        self.blocks: dict[str, int] = {}  # unit -> blocks, as the nodes know it
        if join_memory:
            for pool in self.config.kvpools:
                self.plane.hello(hello(pool.name, pool.capacity_blocks))
        if join_generation:
            self.heartbeat()

    def heartbeat(self, *names: str) -> None:
        """Generation nodes report in (all by default): only a node heard from is routable."""
        for name in names or [n.name for n in self.config.generation]:
            self.plane.load(LoadReport(WIRE_VERSION, name, 0))

    def rid(self) -> str:
        self._ids += 1
        return f"r{self._ids}"

    def plan(self, units: Sequence[tuple[str, int]], request_id: str | None = None) -> RequestPlan:
        """Route, snapshot from the chosen node's real cache, finalize. The request stays in flight."""
        rid = request_id or self.rid()
        for u, n in units:
            self.blocks[u] = blocks_for(n, B)
        node = self.plane.route(rid, units)
        held = [u for u, _ in units if u in self.caches[node]]
        return self.plane.finalize(rid, node, held)

    def execute(self, plan: RequestPlan, *, publish: bool = True, release: bool = True,
                complete: bool = True, decline: bool = False) -> None:
        """The node follows the plan: drop victims, insert what fits, write back + publish, release, report.

        Like a real node it enforces its own capacity and reports what it declined; ``decline``
        makes it decline its first insertion regardless.
        """
        cache = self.caches[plan.node]
        capacity = self.config.generation_node(plan.node).local_capacity_blocks
        cache.difference_update(plan.local_evict)
        inserted: list[str] = []
        declined: list[str] = []
        for up in plan.units:
            if up.retention.local:
                used = sum(self.blocks[u] for u in cache)
                fits = up.unit_id in cache or used + blocks_for(up.n_tokens, B) <= capacity
                if fits and not (decline and not declined):
                    cache.add(up.unit_id)
                    inserted.append(up.unit_id)
                else:
                    declined.append(up.unit_id)
            if publish and up.grant is not None:
                g = up.grant
                self.plane.publish(PublishRequest(WIRE_VERSION, g.unit_id, g.epoch, g.writer, g.blocks))
        leases = tuple(up.lease.lease_id for up in plan.units if up.lease is not None)
        if release and leases:
            self.plane.release(ReleaseRequest(WIRE_VERSION, leases))
        self.plane.residency(ResidencyReport(WIRE_VERSION, plan.node, tuple(inserted),
                                             (*plan.local_evict, *declined)))
        if complete:
            self.plane.complete(plan.request_id)

    def serve(self, units: Sequence[tuple[str, int]]) -> RequestPlan:
        plan = self.plan(units)
        self.execute(plan)
        return plan


def preps(plan: RequestPlan) -> dict[str, Preparation]:
    return {u.unit_id: u.preparation for u in plan.units}


def retentions(plan: RequestPlan) -> dict[str, str]:
    return {u.unit_id: u.retention.value for u in plan.units}
