"""``tessera chaos --hosts N``: the chaos run with every role on its own host and network faults.

The process faults of :class:`~tessera_lab.chaos.harness.ChaosRun` (kill -9, SIGSTOP, a
corrupt block, a restart of the retrieval role) mix with network faults, each held for
longer than the deadline it should trip and then healed:

=========================  =================================================================
cut_generation_memory      a generation node and the memory node partitioned (fetch and
                           writeback fail: compute instead; grants expire unpublished)
cut_memory_control         the memory node partitioned from the control plane past the
                           heartbeat timeout (declared dead, fenced), then healed (re-adopted)
oneway_heartbeat           a generation node cannot reach the control plane's internal port;
                           the control plane can still reach it (it must stop routing there)
cut_retrieval_generation   the retrieval role cut from every generation node (clean 503s)
slow_generation_memory     every byte between a generation node and the memory node's data
                           port held 3/4 of transport.timeout_s each way, at 2 MB/s (fetches
                           outlast their deadline: compute instead; needs nftables)
=========================  =================================================================

While it runs, a sampler records the control plane's state, the memory nodes' verified
blocks and the generation nodes' caches about once a second, and ingests a unit every few
seconds. Afterwards :mod:`tessera_lab.hosts.checker` judges the history; the run's verdict is
the base report's (every reply verified) plus those invariants.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig
from tessera_lab.chaos.harness import FAULTS, ChaosOptions, ChaosReport, ChaosRun, Reply
from tessera_lab.hosts import checker
from tessera_lab.hosts.cluster import CONTROL_HOST, HostCluster
from tessera_lab.hosts.netns import has_nftables
from tessera_lab.hosts.proxy import SlowLink

NETWORK_FAULTS = ("cut_generation_memory", "cut_memory_control", "oneway_heartbeat", "cut_retrieval_generation",
                  "slow_generation_memory")
SAMPLE_EVERY_S = 1.0
INGEST_EVERY_S = 3.0
LEASE_GRACE_S = 2.0  # the plane expires leases on its tick; sampling adds its own delay
CONVERGENCE_BOUND_S = 30.0


class HostChaosRun(ChaosRun):
    def __init__(self, config: ClusterConfig, options: ChaosOptions, log_dir: Path | None = None,
                 faults: tuple[str, ...] = FAULTS + NETWORK_FAULTS) -> None:
        super().__init__(config, options, log_dir)
        self.hosts = HostCluster(config, log_dir=self.cluster.log_dir, quiet=True)
        self.cluster = self.hosts
        self.config = self.hosts.config
        self.auth = ClusterAuth.from_config(self.config)
        self.headers = {"Authorization": f"Bearer {self.hosts.api_key}"}
        self.fault_kinds = tuple(f for f in faults if f != "slow_generation_memory" or has_nftables())
        self.samples: list[checker.Sample] = []
        self.acknowledged: list[str] = []
        self.heals: list[float] = []
        self.windows: list[tuple[str, str, float, float]] = []  # (fault, host, from, to) in run time
        self.proxied = 0  # connections the slow links carried
        self.verdict = checker.Verdict()

    def run(self) -> ChaosReport:
        report = super().run()
        report.violations += [f"{name}: {v}" for name, found in self.verdict.violations.items() for v in found]
        return report

    # --- recording -----------------------------------------------------------------------

    async def _drive(self) -> list[Reply]:
        async with aiohttp.ClientSession() as session:
            sampler = asyncio.create_task(self._sample(session))
            try:
                return await super()._drive()
            finally:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler

    async def _get(self, session: aiohttp.ClientSession, url: str) -> Any:
        try:
            async with session.get(url, headers=self.auth.headers("GET", url),
                                   timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def _snapshot(self, session: aiohttp.ClientSession, at: float) -> checker.Sample | None:
        cfg = self.config
        before = await self._get(session, cfg.control_url + "/control/state")
        inventories = {n.name: await self._get(session, f"{cfg.scheme}://{n.host}:{n.port}/inventory")
                       for n in cfg.kvpools}
        caches = {n.name: await self._get(session, f"{cfg.scheme}://{n.host}:{n.port}/v1/cache")
                  for n in cfg.generation}
        after = await self._get(session, cfg.control_url + "/control/state")
        if before is None or after is None:
            return None
        return checker.Sample(at, before, {k: v for k, v in inventories.items() if v is not None}, after,
                              {k: v["units"] for k, v in caches.items() if v is not None})

    async def _sample(self, session: aiohttp.ClientSession) -> None:
        next_ingest = 0.0
        while True:
            at = time.monotonic() - self.t0
            if at >= next_ingest:
                await self._ingest(session, len(self.acknowledged))
                next_ingest = at + INGEST_EVERY_S
            sample = await self._snapshot(session, at)
            if sample is not None:
                self.samples.append(sample)
            await asyncio.sleep(SAMPLE_EVERY_S)

    async def _ingest(self, session: aiohttp.ClientSession, i: int) -> None:
        text = f"Ingested note {i}: the tide came in at {i} o'clock."
        body = {"version": 1, "units": [{"scope": "chaos", "text": text}]}
        try:
            async with session.post(self.config.retrieval_url + "/v1/units", json=body, headers=self.headers,
                                    timeout=aiohttp.ClientTimeout(total=10.0)) as resp:
                if resp.status == 200:
                    self.acknowledged += [u["unit_id"] for u in (await resp.json())["units"]]
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass  # not acknowledged: nothing to lose

    # --- network faults ------------------------------------------------------------------

    def _host(self, role: str) -> str:
        return CONTROL_HOST if role == "retrieval" else self._pick(role).node

    async def _hold(self, kind: str, host: str, seconds: float) -> None:
        start = time.monotonic() - self.t0
        await asyncio.sleep(seconds)
        self.hosts.net.heal()
        self.heals.append(time.monotonic() - self.t0)
        self.windows.append((kind, host, start, self.heals[-1]))

    async def _cut_generation_memory(self) -> None:
        gen = self._host("generation")
        self.hosts.net.cut(gen, self._host("kvpool"))
        await self._hold("cut_generation_memory", gen, 2 * self.config.transport.timeout_s + 1.0)

    async def _cut_memory_control(self) -> None:
        kv = self._host("kvpool")
        self.hosts.net.cut(kv, CONTROL_HOST)
        await self._hold("cut_memory_control", kv, self.config.control.heartbeat_timeout_s + 2.0)

    async def _oneway_heartbeat(self) -> None:
        gen = self._host("generation")
        self.hosts.net.block(gen, CONTROL_HOST, port=self.config.retrieval.internal_port)
        await self._hold("oneway_heartbeat", gen, self.config.control.heartbeat_timeout_s + 2.0)

    async def _cut_retrieval_generation(self) -> None:
        for node in self.config.generation:
            self.hosts.net.cut(CONTROL_HOST, node.name)
        await self._hold("cut_retrieval_generation", "all", 2 * self.config.control.connect_timeout_s + 2.0)

    async def _slow_generation_memory(self) -> None:
        gen, kv = self._host("generation"), self.config.kvpools[0]
        net = self.hosts.net
        # each way 3/4 of the transport timeout: a fetch's round trip outlasts its deadline
        delay = 0.75 * self.config.transport.timeout_s
        link = SlowLink(net.namespace(gen), (kv.host, kv.data_port), delay_s=delay, rate_bytes_s=2e6)
        port = await asyncio.to_thread(link.start)
        net.redirect(gen, kv.name, kv.data_port, port)
        net.drop_connections(gen, kv.name, kv.data_port)
        try:
            await self._hold("slow_generation_memory", gen, 6.0)
        finally:
            await asyncio.to_thread(link.stop)
            self.proxied += link.connections

    # --- afterwards ----------------------------------------------------------------------

    async def _final_check(self) -> list[Reply]:
        async with aiohttp.ClientSession() as session:
            await self._converge(session)  # first: the time since the last heal
        final = await super()._final_check()
        async with aiohttp.ClientSession() as session:
            served = []
            for unit_id in self.acknowledged:
                url = f"{self.config.retrieval_url}/v1/units/{unit_id}"
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url, headers=self.headers) as resp:
                        if resp.status == 200:
                            served.append(unit_id)
        self.verdict.add("no ingested unit is lost", checker.lost_units(self.acknowledged, served))
        return final

    async def _converge(self, session: aiohttp.ClientSession) -> None:
        """Poll until the directory, the inventories, the local views and the caches agree (or the bound)."""
        since = max(self.heals, default=time.monotonic() - self.t0)
        cfg = self.config
        gens, kvs = [n.name for n in cfg.generation], [n.name for n in cfg.kvpools]
        left: list[str] = ["not sampled"]
        while time.monotonic() - self.t0 - since < CONVERGENCE_BOUND_S:
            sample = await self._snapshot(session, time.monotonic() - self.t0)
            if sample is not None:
                left = checker.differences(sample.after, sample.inventories, sample.caches, kvs, gens)
                if not left:
                    self.verdict.converged_after_s = sample.at - since
                    return
            await asyncio.sleep(0.5)
        self.verdict.add("converges after the heal", [f"after {CONVERGENCE_BOUND_S:.0f}s: " + "; ".join(left)])

    def _verify(self, replies: list[Reply], oracle: Any, final: list[Reply]) -> None:
        super()._verify(replies, oracle, final)
        v = self.verdict
        v.add("no READY entry references unfinished blocks",
              [x for s in self.samples for x in checker.unfinished_ready(s, self.corrupted)])
        v.add("no lease or reservation outlives its expiry + grace",
              [x for s in self.samples for x in checker.overdue(s.before, LEASE_GRACE_S, s.at)])
        served = [checker.Served(r.sent_at, r.sent_at + r.latency_s, r.body["usage"]["tessera"]["node"])
                  for r in replies if r.status == 200 and "usage" in r.body]
        v.add("no request served by a node held dead", checker.flaps(served, self.samples))
        self.effects = self._effects(replies)

    def _effects(self, replies: list[Reply]) -> dict[str, Counter[str]]:
        """Per network fault kind: what the requests sent during its windows got."""
        out: dict[str, Counter[str]] = {}
        for kind, host, start, end in self.windows:
            seen = out.setdefault(kind, Counter())
            for r in replies:
                if not start <= r.sent_at <= end:
                    continue
                seen[str(r.status)] += 1
                usage = r.body.get("usage", {}).get("tessera", {}) if r.status == 200 else {}
                seen["computed units"] += int(usage.get("computed_units", 0))
                seen["remote units"] += int(usage.get("remote_units", 0))
                seen["fetch fallbacks"] += int(usage.get("fallbacks", 0))
                if usage.get("node") == host:
                    seen["served by the faulted node"] += 1
        return out

    def render(self) -> str:
        lines = [f"network faults ({self.proxied} connections through slow links):"]
        for kind, seen in sorted(getattr(self, "effects", {}).items()):
            lines.append(f"  {kind}: " + ", ".join(f"{k} {v}" for k, v in sorted(seen.items())))
        lines.append(f"invariants over {len(self.samples)} samples:")
        return "\n".join(lines) + "\n" + self.verdict.render()


def run_on_hosts(config: ClusterConfig, options: ChaosOptions, log_dir: Path | None, hosts: int) -> ChaosReport:
    """``tessera chaos --hosts N``: the run on N hosts; prints the network faults' table and the checker's verdict."""
    from tessera.errors import ConfigError
    from tessera_lab.hosts.cluster import resize
    from tessera_lab.hosts.netns import unavailable

    why = unavailable()
    if why is not None:
        raise ConfigError(f"--hosts: {why}")
    try:
        sized = resize(config, hosts)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    run = HostChaosRun(sized, options, log_dir)
    report = run.run()
    print(run.render(), flush=True)
    return report
