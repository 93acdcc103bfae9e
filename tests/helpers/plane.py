"""An in-process control plane (fake clock) with generation nodes that follow its plans, and plan views.

The cluster itself is the package's :class:`~tessera.control.simulated.SimulatedCluster` (the
bench drives the same one); this module only gives it the tests' small config.
"""

from __future__ import annotations

from typing import Any

from helpers.cluster import cluster_config
from tessera.config import ClusterConfig
from tessera.control.simulated import SimulatedCluster
from tessera.control.simulated import memory_node_hello as hello
from tessera.messages.plan import Preparation, RequestPlan

__all__ = ["B", "Cluster", "hello", "plane_config", "preps", "retentions"]

B = 4  # block size of every test cluster


def plane_config(*, nodes: int = 2, local_blocks: int = 16, shared_blocks: int = 16,
                 kvpools: int = 1, **control: Any) -> ClusterConfig:
    """A small cluster (B = 4, 16 blocks per tier) for an in-process control plane."""
    return cluster_config(nodes=nodes, local_blocks=local_blocks, kvpools=kvpools, kv_blocks=shared_blocks,
                          block_tokens=B, **control)


class Cluster(SimulatedCluster):
    """A :class:`SimulatedCluster` of ``config``, or of ``plane_config(**kw)`` (B = 4)."""

    def __init__(self, config: ClusterConfig | None = None, *, join_memory: bool = True, join_generation: bool = True,
                 **kw: Any) -> None:
        super().__init__(config or plane_config(**kw), join_memory=join_memory, join_generation=join_generation)


def preps(plan: RequestPlan) -> dict[str, Preparation]:
    return {u.unit_id: u.preparation for u in plan.units}


def retentions(plan: RequestPlan) -> dict[str, str]:
    return {u.unit_id: u.retention.value for u in plan.units}
