"""Counters of the control plane's decisions (exported by ``/metrics`` and the benchmarks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.metrics import Metric, gauge

if TYPE_CHECKING:
    from tessera.control.plane import ControlPlane


class PlaneStats:
    """Monotonic counters; ``snapshot()`` returns them as a plain dict."""

    __slots__ = ("compute", "keep_local", "keep_shared", "local", "local_evictions", "plans", "remote", "units")

    def __init__(self) -> None:
        self.plans = 0
        self.units = 0
        self.local = 0  # preparations by kind
        self.remote = 0
        self.compute = 0
        self.keep_local = 0  # retentions granted, per tier
        self.keep_shared = 0
        self.local_evictions = 0

    def count_plan(self, units: int, local: int, remote: int, keep_local: int, keep_shared: int,
                   local_evictions: int) -> None:
        self.plans += 1
        self.units += units
        self.local += local
        self.remote += remote
        self.compute += units - local - remote
        self.keep_local += keep_local
        self.keep_shared += keep_shared
        self.local_evictions += local_evictions

    def snapshot(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


def plane_metrics(plane: ControlPlane) -> list[Metric]:
    """The plane's occupancy gauges, read when ``/metrics`` is scraped."""
    nodes = plane.nodes.values()
    return [
        gauge("tessera_shared_entries", "Units in the shared KV pool directory", len(plane.directory)),
        gauge("tessera_shared_free_blocks", "Free blocks in the shared KV pool", plane.allocator.free_blocks),
        gauge("tessera_node_inflight", "In-flight requests per generation node (control plane view)",
              {n.name: n.inflight for n in nodes}, label="node"),
        gauge("tessera_node_queued_tokens", "Tokens queued on each generation node (from its heartbeat)",
              {n.name: n.queued_tokens for n in nodes}, label="node"),
    ]
