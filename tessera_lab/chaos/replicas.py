"""``tessera chaos --replicas N``: the chaos run against a replicated retrieval role, with leader faults.

The same load, faults and verifier as :class:`~tessera_lab.chaos.harness.ChaosRun`, with the
load spread round robin over the replicas, and the retrieval restart replaced by two faults
of the leader (the replica whose internal plane answers ``/control/stats``):

* ``kill_leader``: ``kill -9``; another replica must take office, then the killed one starts
  again (as a follower). A request lost with its connection is allowed only if it was sent to
  the killed replica while it was down; the survivors answer 200 or a clean 503/429;
* ``pause_leader``: ``SIGSTOP`` for ``ha.lease_ttl_s`` + 2 s (past its lease), then
  ``SIGCONT``. Another replica must have taken office meanwhile, and the resumed one must issue
  nothing under its old term: its ``/control/route`` right after ``SIGCONT`` must be refused
  (a violation otherwise). Every 200 is still checked token for token against the offline
  composition, so a stale plan executed anywhere would show as wrong tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig
from tessera.ha.replicas import replica_config
from tessera.launcher import Child
from tessera.messages.control import RouteRequest
from tessera.wire import WIRE_VERSION, encode
from tessera_lab.chaos.harness import FAULTS, ChaosOptions, ChaosRun

LEADER_FAULTS = ("kill_leader", "pause_leader")


class ReplicatedChaosRun(ChaosRun):
    def __init__(self, config: ClusterConfig, options: ChaosOptions, log_dir: Path | None = None) -> None:
        super().__init__(config, options, log_dir)
        self.replicas = self.config.ha.replicas
        self.fault_kinds = tuple(f for f in FAULTS if f != "restart_retrieval") + LEADER_FAULTS
        self.auth = ClusterAuth.from_config(self.cluster.config)

    def _url(self, replica: int) -> str:
        return replica_config(self.config, replica).retrieval_url

    def _internal(self, replica: int) -> str:
        return replica_config(self.config, replica).control_url

    def _signed(self, replica: int, path: str, body: bytes | None = None) -> int:
        """Status of a signed internal call to ``replica`` (0: no answer within 2 s)."""
        url = self._internal(replica) + path
        method = "GET" if body is None else "POST"
        req = urllib.request.Request(url, data=body, method=method, headers={
            "Content-Type": "application/json", **self.auth.headers(method, url, body or b"")})
        try:
            with urllib.request.urlopen(req, timeout=2.0) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return 0

    async def _leader(self, timeout: float = 60.0) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for i in range(self.replicas):
                if await asyncio.to_thread(self._signed, i, "/control/stats") == 200:
                    return i
            await asyncio.sleep(0.1)
        raise RuntimeError(f"no retrieval replica leads after {timeout:.0f}s")

    async def _new_leader(self, old: int, timeout: float = 60.0) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for i in range(self.replicas):
                if i != old and await asyncio.to_thread(self._signed, i, "/control/stats") == 200:
                    return i
            await asyncio.sleep(0.1)
        self.report.violations.append(f"no other replica took office within {timeout:.0f}s of a fault of r{old}")
        return old

    def _child(self, replica: int) -> Child:
        return next(c for c in self.cluster.children if c.role == "retrieval" and c.node == f"r{replica}")

    async def _kill_leader(self) -> None:
        lead = await self._leader()
        child = self._child(lead)
        down = time.monotonic() - self.t0
        os.kill(child.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(child.proc.wait)
        await self._new_leader(lead)
        new = self.cluster.restart_child(child)
        await asyncio.to_thread(self.cluster._wait, [new], 120.0)
        self.retrieval_down.append((down, time.monotonic() - self.t0, lead))

    async def _pause_leader(self) -> None:
        lead = await self._leader()
        pid = self._child(lead).proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(self.config.ha.lease_ttl_s + 2.0)
            await self._new_leader(lead, timeout=30.0)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        probe = encode(RouteRequest(WIRE_VERSION, f"chaos-probe-{time.monotonic_ns()}"))
        status = await asyncio.to_thread(self._signed, lead, "/control/route", probe)
        if status == 200:
            self.report.violations.append(f"r{lead} routed a request after it resumed from a pause past its lease")
