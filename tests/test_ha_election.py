"""Leader election on a real etcd: one leader at a time, growing terms, a partitioned leader stops first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aetcd
import pytest

from tessera.config import HAConfig
from tessera.ha.election import Election, Leader
from tessera.ha.etcd_client import connect
from tessera.ha.servers import EtcdServer

TTL = 2  # etcd with a 500 ms election timeout grants leases of at least ~1 s


@pytest.fixture
async def clients(etcd: EtcdServer) -> AsyncIterator[list[aetcd.Client]]:
    """Three independent etcd clients, one per candidate process."""
    made = [connect(HAConfig(**etcd.access())) for _ in range(3)]
    yield made
    for c in made:
        await c.close()


async def test_the_first_candidate_leads_and_the_next_one_waits_for_its_resignation(
        clients: list[aetcd.Client]) -> None:
    """A second candidate leads only after the first resigns, and under a larger term."""
    a, b = (Election(c, "/t/leader", ttl_s=TTL, margin_s=0.5) for c in clients[:2])
    first = await a.campaign(b"r0")
    second = asyncio.create_task(b.campaign(b"r1"))
    await asyncio.sleep(0.3)
    assert not second.done(), "two leaders at once"
    assert await a.leader() == Leader(b"r0", first.term)
    await first.resign()
    successor = await asyncio.wait_for(second, 10)
    assert successor.term > first.term
    assert await b.leader() == Leader(b"r1", successor.term)
    await successor.resign()


async def test_a_leader_that_cannot_renew_stops_before_its_successor_starts(clients: list[aetcd.Client]) -> None:
    """A partitioned leader (renewals hang) is no longer valid when the next candidate becomes leader."""
    a, b = (Election(c, "/t/leader", ttl_s=TTL, margin_s=0.5) for c in clients[:2])
    first = await a.campaign(b"r0")
    assert first.valid

    async def partitioned(lease_id: int) -> None:
        await asyncio.Event().wait()

    clients[0].refresh_lease = partitioned  # type: ignore[method-assign]
    successor = await asyncio.wait_for(b.campaign(b"r1"), 15)
    assert not first.valid and first.lost.is_set(), "the old leader still thinks it leads"
    assert successor.valid and successor.term > first.term
    await successor.resign()
    await first.close()


async def test_observers_see_each_new_leader(clients: list[aetcd.Client]) -> None:
    """observe() yields the leader, then its successor after a failover."""
    a, b, watcher = (Election(c, "/t/leader", ttl_s=TTL, margin_s=0.5) for c in clients)
    seen: list[Leader | None] = []
    first = await a.campaign(b"r0")

    async def observe() -> None:
        async for leader in watcher.observe():
            seen.append(leader)
            if leader is not None and leader.value == b"r1":
                return

    observer = asyncio.create_task(observe())
    second = asyncio.create_task(b.campaign(b"r1"))
    await asyncio.sleep(0.2)
    await first.resign()
    successor = await asyncio.wait_for(second, 10)
    await asyncio.wait_for(observer, 10)
    assert seen[0] == Leader(b"r0", first.term)
    assert seen[-1] == Leader(b"r1", successor.term)
    await successor.resign()
