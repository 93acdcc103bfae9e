"""What one bench run sends its load to: a fresh local cluster, or an endpoint already running.

A :class:`Target` opens a URL for one run (:meth:`Target.open`) and says how each request
becomes a body (:attr:`body_of`) and which headers go with it. :class:`FreshCluster` starts
the config's cluster anew for every run (no run inherits another's caches) and ingests the
workload's corpus; :class:`RunningEndpoint` is a server someone else runs (``--url``): its
caches carry over from one run to the next, and nothing is ingested.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tessera.benchmark.client import BodyOf, ingest
from tessera.benchmark.counters import node_counters
from tessera.benchmark.endpoints import Endpoint
from tessera.benchmark.workloads import Workload
from tessera.config import ClusterConfig
from tessera.launcher import LocalCluster
from tessera.ports import on_free_ports

WRITEBACK_SETTLE_S = 1.0  # after the last reply, before the nodes' counters are read


class Target(Protocol):
    @property
    def description(self) -> dict[str, Any]:
        """What the report says about this system."""

    @property
    def body_of(self) -> BodyOf | None:
        """How a request becomes a body; None: Tessera's (``BenchRequest.body``)."""

    @property
    def headers(self) -> dict[str, str]:
        """Sent with every request (an API key)."""

    def open(self, log_dir: Path, progress: bool) -> Any:
        """An async context manager yielding the base URL for one run."""

    @property
    def counters(self) -> dict[str, float]:
        """What the servers of the last run counted (:mod:`tessera.benchmark.counters`); {}: none known."""


@dataclass
class FreshCluster:
    config: ClusterConfig
    workload: Workload
    description: dict[str, Any]
    embeddings: Mapping[str, list[float]] | None = None
    body_of: BodyOf | None = None
    headers: dict[str, str] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)

    @asynccontextmanager
    async def open(self, log_dir: Path, progress: bool) -> AsyncIterator[str]:
        # ports of its own: a bench runs beside a cluster that serves on the configured ones
        cluster = LocalCluster(on_free_ports(self.config), log_dir=log_dir, quiet=True)
        await asyncio.to_thread(cluster.start)
        self.counters = {}
        try:
            url = cluster.config.retrieval_url
            await ingest(url, self.workload.corpus, progress=progress, embeddings=self.embeddings)
            yield url
            # the writebacks of the run's last units may still be in flight: they count
            await asyncio.sleep(WRITEBACK_SETTLE_S)
            self.counters = await node_counters(cluster.config)
        finally:
            await asyncio.to_thread(cluster.stop)


@dataclass
class RunningEndpoint:
    endpoint: Endpoint
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def description(self) -> dict[str, Any]:
        e = self.endpoint
        return {"url": e.url, "api": e.api, "model": e.model}

    @property
    def body_of(self) -> BodyOf | None:
        # a Tessera endpoint takes Tessera's own body (and its return_layout); others the plain one
        return None if self.endpoint.api == "tessera" else self.endpoint.body

    @property
    def counters(self) -> dict[str, float]:
        return {}  # someone else's server: its counters are its own

    @asynccontextmanager
    async def open(self, log_dir: Path, progress: bool) -> AsyncIterator[str]:
        yield self.endpoint.url
