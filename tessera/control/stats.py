"""Counters of the control plane's decisions (exported by ``/control/stats`` and the benchmarks)."""

from __future__ import annotations

from tessera.messages.plan import Preparation, RequestPlan, Retention

LOCAL, REMOTE = Preparation.LOCAL, Preparation.REMOTE
KEPT_LOCAL, KEPT_BOTH = Retention.LOCAL, Retention.BOTH


class PlaneStats:
    """Monotonic counters of the plans issued; ``snapshot()`` returns them as a plain dict."""

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

    def add(self, units: int, local: int, remote: int, keep_local: int, keep_shared: int, evictions: int) -> None:
        """One plan issued: its units, their preparations (the rest computed), the retentions
        granted per tier, and the local evictions it asks for (counted by the planner as it
        decides, so the plan's units are walked once)."""
        self.plans += 1
        self.units += units
        self.local += local
        self.remote += remote
        self.compute += units - local - remote
        self.keep_local += keep_local
        self.keep_shared += keep_shared
        self.local_evictions += evictions

    def count(self, plan: RequestPlan) -> None:
        """:meth:`add` for a finished plan (its counts read back from its units)."""
        local = remote = keep_local = keep_shared = 0
        for up in plan.units:
            prep = up.preparation
            if prep is LOCAL:
                local += 1
            elif prep is REMOTE:
                remote += 1
            retention = up.retention
            if retention is KEPT_LOCAL or retention is KEPT_BOTH:
                keep_local += 1
            if up.grant is not None:
                keep_shared += 1
        self.add(len(plan.units), local, remote, keep_local, keep_shared, len(plan.local_evict))

    def snapshot(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}
