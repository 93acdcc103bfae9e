"""Safe publication end to end: real control plane, memory node and writer processes (paper §5.4).

The test plays generation node gen0 against a real retrieval role (the control plane) and a
real memory node on loopback, through the same two-step plan a generation node uses. Shared
admission is ``lru`` so that a unit is admitted on first sight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
import torch
from helpers.cluster import REPO, child_env, signed_get, write_config
from helpers.http import wait_for
from helpers.kvpool import HANG_GUARD_S, PoolConfig, random_state
from helpers.processes import MemoryNodeProcess, RoleProcess

from tessera.auth import ClusterAuth, read_secret
from tessera.config import ClusterConfig, ControlConfig
from tessera.engines.base import UnitState
from tessera.engines.checkpoint import resolve
from tessera.engines.geometry import ModelGeometry, geometry_from_checkpoint
from tessera.errors import ChecksumMismatch, PublishRejected, TransferError
from tessera.generation.pool_client import KVPoolClient
from tessera.messages.control import (
    CompleteRequest,
    LoadReport,
    PlanRequest,
    PublishRequest,
    RouteRequest,
    RouteResponse,
    RouteUnit,
)
from tessera.messages.kvpool import MemoryNodeList
from tessera.messages.plan import Preparation, RequestPlan, UnitPlan, WriteGrant
from tessera.transport.arena import Arena
from tessera.transport.blocks import BlockHeader, BlockLayout
from tessera.wire import WIRE_VERSION, encode, from_wire

T = TypeVar("T")
_ids = itertools.count()


@dataclasses.dataclass
class Cluster:
    config: ClusterConfig
    directory: Path
    node: MemoryNodeProcess
    geometry: ModelGeometry

    @property
    def url(self) -> str:
        return self.config.control_url  # the internal plane: the tests act as cluster processes

    def layout(self) -> BlockLayout:
        return BlockLayout(self.geometry, self.config.block_tokens)


@contextlib.contextmanager
def cluster(pool_config: PoolConfig, directory: Path, model: Path, capacity: int = 64,
            write_timeout_s: float = 10.0) -> Iterator[Cluster]:
    """A retrieval role (control plane) and memory node kv0 speaking tcp (2 s transfer timeout)."""
    config = pool_config(directory, transport="tcp", capacity=capacity, timeout_s=2.0, model_source=str(model))
    config = dataclasses.replace(config, control=ControlConfig(admission="lru", write_timeout_s=write_timeout_s,
                                                               heartbeat_timeout_s=10.0))
    path = write_config(directory, config)
    retrieval = RoleProcess("retrieval", path)
    try:
        with MemoryNodeProcess.started(config, directory) as node:
            retrieval.wait_healthy(config.retrieval_url, timeout=120)
            boot = node.endpoint().boot_id

            def heard() -> bool:
                raw = signed_get(config, f"{config.control_url}/control/kvpool")
                return [n.boot_id for n in from_wire(MemoryNodeList, json.loads(raw)).nodes] == [boot]

            wait_for(heard, HANG_GUARD_S, "kv0's hello to reach the control plane", node.proc.proc)
            geometry = geometry_from_checkpoint(resolve(config.model), config.kv_dtype)
            yield Cluster(config, directory, node, geometry)
    finally:
        retrieval.stop()


@pytest.fixture(scope="module")
def shared_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
        pool_config: PoolConfig) -> Iterator[Cluster]:
    with cluster(pool_config, tmp_path_factory.mktemp("pool-cluster"), tiny_model) as c:
        yield c


@pytest.fixture
async def http(cluster_secret: Path) -> AsyncIterator[aiohttp.ClientSession]:
    """A session that signs its requests with the cluster secret, as the cluster's own roles do."""
    auth = ClusterAuth(read_secret(str(cluster_secret)))
    async with aiohttp.ClientSession(middlewares=(auth.client_middleware(),)) as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, msg: Any, cls: type[T]) -> T:
    async with http.post(url, data=encode(msg), headers={"Content-Type": "application/json"}) as resp:
        body = await resp.read()
        assert resp.status == 200, (url, resp.status, body)
        return from_wire(cls, orjson.loads(body))


async def plan_unit(http: aiohttp.ClientSession, c: Cluster, unit: str, n_tokens: int) -> UnitPlan:
    """Route and finalize a one-unit request as gen0 would (holding nothing locally)."""
    rid = f"req-{next(_ids)}"
    # gen0's heartbeat, as the real node sends it: only nodes the plane has heard are routed to
    async with http.post(f"{c.url}/control/load", data=encode(LoadReport(WIRE_VERSION, "gen0", 0))) as resp:
        assert resp.status == 200, await resp.text()
    route = await post(http, f"{c.url}/control/route", RouteRequest(WIRE_VERSION, rid, (RouteUnit(unit, n_tokens),)),
                       RouteResponse)
    plan = await post(http, f"{c.url}/control/plan", PlanRequest(WIRE_VERSION, rid, route.node), RequestPlan)
    async with http.post(f"{c.url}/control/complete", data=encode(CompleteRequest(WIRE_VERSION, rid))):
        pass
    (unit_plan,) = plan.units
    return unit_plan


async def stats(http: aiohttp.ClientSession, c: Cluster) -> dict[str, Any]:
    async with http.get(f"{c.url}/control/stats") as resp:
        return dict(await resp.json())


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = HANG_GUARD_S) -> None:
    for _ in range(int(timeout / 0.1)):
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


def same_state(a: UnitState, b: UnitState) -> bool:
    return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def fresh_state(c: Cluster, n_tokens: int, seed: int) -> UnitState:
    return random_state(n_tokens, seed, c.geometry)


async def granted(http: aiohttp.ClientSession, c: Cluster, unit: str, n: int) -> WriteGrant:
    p = await plan_unit(http, c, unit, n)
    assert p.preparation is Preparation.COMPUTE and p.grant is not None, p
    return p.grant


async def test_a_unit_is_readable_only_once_its_writer_published_every_block(
    shared_cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Pending is never a hit; after store() the next plan leases exactly the published epoch."""
    c = shared_cluster
    grant = await granted(http, c, "unit-published", 10)
    again = await plan_unit(http, c, "unit-published", 10)
    assert again.preparation is Preparation.COMPUTE and again.lease is None and again.grant is None
    state = fresh_state(c, 10, seed=1)
    pool = KVPoolClient(c.config, c.layout())
    try:
        await pool.store(grant, state)
        hit = await plan_unit(http, c, "unit-published", 10)
        assert hit.preparation is Preparation.REMOTE and hit.lease is not None
        assert (hit.lease.epoch, hit.lease.blocks) == (grant.epoch, grant.blocks)
        assert same_state(await pool.fetch(hit.lease, 10), state)
    finally:
        await pool.close()


async def test_stale_second_or_partial_writers_cannot_publish(shared_cluster: Cluster,
                                                             http: aiohttp.ClientSession) -> None:
    """The control plane answers 409 with the reason; the writer then publishes normally."""
    c = shared_cluster
    g = await granted(http, c, "unit-contested", 9)
    pool = KVPoolClient(c.config, c.layout())
    try:
        attempts = [
            (PublishRequest(WIRE_VERSION, g.unit_id, g.epoch, "gen1", g.blocks), "not the authorized writer"),
            (PublishRequest(WIRE_VERSION, g.unit_id, g.epoch + 100, g.writer, g.blocks), "stale epoch"),
            (PublishRequest(WIRE_VERSION, g.unit_id, g.epoch, g.writer, g.blocks[:-1]), "block set differs"),
        ]
        for msg, reason in attempts:
            with pytest.raises(PublishRejected, match=reason):
                await pool.control.publish(msg)
        await pool.store(g, fresh_state(c, 9, seed=2))
        with pytest.raises(PublishRejected, match="already published"):
            await pool.control.publish(PublishRequest(WIRE_VERSION, g.unit_id, g.epoch, g.writer, g.blocks))
    finally:
        await pool.close()


async def test_a_writer_killed_mid_write_never_publishes_and_its_blocks_return_after_the_grace(
    tiny_model: Path, tmp_path: Path, http: aiohttp.ClientSession, pool_config: PoolConfig
) -> None:
    """The reservation expires unpublished; its blocks stay quarantined (a write of the dead
    writer still lands after it died), then come back once the grace has passed."""
    with cluster(pool_config, tmp_path, tiny_model, capacity=4, write_timeout_s=1.0) as c:
        grant = await granted(http, c, "unit-orphaned", 14)  # 4 blocks of B = 4: the whole pool
        (tmp_path / "grant.json").write_bytes(encode(grant))
        cmd = [sys.executable, str(REPO / "tests" / "kvpool_writer.py"), str(tmp_path / "tessera.toml"),
               str(tmp_path / "grant.json"), "3"]
        with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env()) as writer:
            assert writer.stdout is not None and writer.stdin is not None
            try:
                assert await asyncio.to_thread(writer.stdout.readline) == "READY\n"
                c.node.pause()  # the writer's block writes are sent and sit unanswered...
                writer.stdin.write("go\n")
                writer.stdin.flush()
                await asyncio.sleep(0.5)
                writer.kill()  # ...when it dies
                writer.wait()
            finally:
                c.node.resume()  # and the node still applies what was sent
                if writer.poll() is None:
                    writer.kill()

        arena = Arena.attach(c.node.endpoint().shm_name)
        try:
            async def landed() -> bool:
                with contextlib.suppress(ChecksumMismatch):
                    return BlockHeader.unpack(arena.slot(grant.blocks[0].index)).epoch == grant.epoch
                return False

            await eventually(landed, "the dead writer's write lands")
        finally:
            arena.close()

        async def expired() -> bool:
            return (await stats(http, c))["shared_entries"] == 0

        await eventually(expired, "the reservation expires unpublished")
        assert (await stats(http, c))["shared_free_blocks"] == 0, "its blocks are quarantined, not free"
        blocked = await plan_unit(http, c, "unit-orphaned", 14)
        assert blocked.preparation is Preparation.COMPUTE and blocked.grant is None

        async def reclaimed() -> bool:
            return (await stats(http, c))["shared_free_blocks"] == 4

        await eventually(reclaimed, "the quarantined blocks return after the grace")
        again = await granted(http, c, "unit-orphaned", 14)
        assert again.epoch > grant.epoch


async def test_a_failed_write_cancels_the_reservation_with_a_settle_time(
    shared_cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """store() to a frozen memory node times out and cancels at once (long before the 10 s
    deadline); the blocks come back after the settle time; nothing was published."""
    c = shared_cluster
    before = (await stats(http, c))["shared_free_blocks"]
    entries = (await stats(http, c))["shared_entries"]
    grant = await granted(http, c, "unit-failed", 8)
    pool = KVPoolClient(c.config, c.layout())
    try:
        await pool.endpoints.get("kv0")
        c.node.pause()
        try:
            with pytest.raises(TransferError):
                await asyncio.wait_for(pool.store(grant, fresh_state(c, 8, seed=4)), HANG_GUARD_S)
        finally:
            c.node.resume()
        s = await stats(http, c)
        assert s["shared_entries"] == entries, "cancelled, not left to its deadline"
        assert s["shared_free_blocks"] == before - 2, "held for the settle time"

        async def settled() -> bool:
            return (await stats(http, c))["shared_free_blocks"] == before

        await eventually(settled, "blocks return after the settle time")
        assert (await plan_unit(http, c, "unit-failed", 8)).preparation is Preparation.COMPUTE
    finally:
        await pool.close()


async def test_a_restarted_memory_node_comes_back_empty_and_the_directory_drops_its_units(
    tiny_model: Path, tmp_path: Path, http: aiohttp.ClientSession, pool_config: PoolConfig
) -> None:
    """A new boot id in the hello drops the node's entries; the old lease reads nothing."""
    with cluster(pool_config, tmp_path, tiny_model) as c:
        grant = await granted(http, c, "unit-lost", 7)
        pool = KVPoolClient(c.config, c.layout())
        try:
            await pool.store(grant, fresh_state(c, 7, seed=5))
            hit = await plan_unit(http, c, "unit-lost", 7)
            assert hit.lease is not None
            old_boot = c.node.endpoint().boot_id
            c.node.kill()
            restarted = MemoryNodeProcess(c.config, c.directory / "tessera.toml", "kv0")
            try:
                new_boot = restarted.wait_healthy().boot_id

                async def rejoined() -> bool:
                    async with http.get(f"{c.url}/control/kvpool") as resp:
                        nodes = from_wire(MemoryNodeList, await resp.json()).nodes
                    return [n.boot_id for n in nodes] == [new_boot]

                await eventually(rejoined, "the control plane sees the new boot id")
                assert new_boot != old_boot
                assert (await stats(http, c))["shared_entries"] == 0
                assert (await plan_unit(http, c, "unit-lost", 7)).preparation is Preparation.COMPUTE
                for _ in range(2):  # the old lease: refused by the new incarnation, then reads nothing
                    with pytest.raises(TransferError):
                        await pool.fetch(hit.lease, 7, release=False)
            finally:
                restarted.stop()
        finally:
            await pool.close()


async def test_a_slow_writer_renews_its_grant_and_publishes_under_the_same_epoch(
    shared_cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """A unit computed late on a busy node: less than a write's time is left of its grant, so
    the writer renews it (same epoch and blocks, a new deadline) and publishes."""
    c = shared_cluster
    grant = await granted(http, c, "unit-late", 9)
    state = fresh_state(c, 9, seed=6)
    pool = KVPoolClient(c.config, c.layout())
    try:
        # the plan arrived long ago: 0.5 s of its 10 s deadline is left, under the renew margin
        late = time.monotonic() - grant.deadline_s + 0.5
        assert await pool.store(grant, state, received_at=late)
        assert pool.renewed == 1
        hit = await plan_unit(http, c, "unit-late", 9)
        assert hit.lease is not None and (hit.lease.epoch, hit.lease.blocks) == (grant.epoch, grant.blocks)
        assert same_state(await pool.fetch(hit.lease, 9), state)
        assert (await stats(http, c))["grants_renewed"] >= 1
    finally:
        await pool.close()


async def test_a_writer_whose_grant_lapsed_gets_a_new_reservation_and_keeps_the_unit(
    tiny_model: Path, tmp_path: Path, http: aiohttp.ClientSession, pool_config: PoolConfig
) -> None:
    """The reservation expired while the unit waited to be computed: the plane drops it, and
    the writer's renewal reserves anew (a new epoch) so the computed unit is still kept."""
    with cluster(pool_config, tmp_path, tiny_model, write_timeout_s=1.0) as c:
        grant = await granted(http, c, "unit-lapsed", 10)
        received = time.monotonic()

        async def dropped() -> bool:
            return (await stats(http, c))["shared_entries"] == 0

        await eventually(dropped, "the reservation expires unpublished")
        state = fresh_state(c, 10, seed=7)
        pool = KVPoolClient(c.config, c.layout())
        try:
            assert await pool.store(grant, state, received_at=received)
            hit = await plan_unit(http, c, "unit-lapsed", 10)
            assert hit.lease is not None and hit.lease.epoch > grant.epoch
            assert same_state(await pool.fetch(hit.lease, 10), state)
            assert (await stats(http, c))["grants_reissued"] == 1
        finally:
            await pool.close()


async def test_a_lapsed_grant_of_a_unit_someone_else_published_writes_nothing(
    shared_cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Renewal is refused when the shared tier holds the unit under another grant: the late
    writer neither writes nor fails; the published entry stays as it was."""
    c = shared_cluster
    grant = await granted(http, c, "unit-taken", 8)
    pool = KVPoolClient(c.config, c.layout())
    try:
        forged = dataclasses.replace(grant, epoch=grant.epoch + 1000)  # a grant the plane never issued
        assert not await pool.store(forged, fresh_state(c, 8, seed=8), received_at=time.monotonic() - 60.0)
        state = fresh_state(c, 8, seed=9)
        assert await pool.store(grant, state)
        hit = await plan_unit(http, c, "unit-taken", 8)
        assert hit.lease is not None and hit.lease.epoch == grant.epoch
        assert same_state(await pool.fetch(hit.lease, 8), state)
    finally:
        await pool.close()


async def test_a_unit_published_after_a_plan_said_compute_is_leased_late(
    shared_cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The late lease a queued request asks for: a lease once the unit is READY, none before,
    none for a node the plane does not know."""
    c = shared_cluster
    grant = await granted(http, c, "unit-late-lease", 6)
    pool = KVPoolClient(c.config, c.layout(), reader="gen0")
    try:
        assert await pool.late_lease("unit-late-lease") is None  # PENDING is never a hit
        state = fresh_state(c, 6, seed=10)
        assert await pool.store(grant, state)
        lease = await pool.late_lease("unit-late-lease")
        assert lease is not None and lease.epoch == grant.epoch
        assert same_state(await pool.fetch(lease, 6), state)
        assert await pool.control.late_lease("unit-late-lease", "gen9") is None
        assert (await stats(http, c))["late_leases"] == 1
    finally:
        await pool.close()
