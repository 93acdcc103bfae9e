"""Reading units from the pool: every block verified against the lease, over every transport."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from helpers.kvpool import (
    BLOCK_TOKENS,
    HANG_GUARD_S,
    TINY_GEOMETRY,
    TRANSPORTS,
    PoolConfig,
    random_state,
    skip_if_unavailable,
    tiny_layout,
)
from helpers.processes import MemoryNodeProcess, StartMemoryNode

from tessera.auth import CapabilityIssuer
from tessera.config import ClusterConfig
from tessera.engines.base import UnitState
from tessera.errors import ChecksumMismatch, TransferError, TransferTimeout
from tessera.generation.pool_client import KVPoolClient, capabilities
from tessera.messages.common import BlockRef
from tessera.messages.plan import ReadLease
from tessera.transport.arena import Arena
from tessera.transport.base import SlotIO
from tessera.transport.blocks import BlockLayout
from tessera.transport.unit_blocks import encode_unit

UNIT = "unit-x"
HOLDER = "gen3"  # the generation node the tests' leases and grants are issued to


@dataclasses.dataclass
class Cluster:
    config: ClusterConfig
    directory: Path


@pytest.fixture(scope="module", params=TRANSPORTS)
def two_nodes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        pool_config: PoolConfig) -> Iterator[Cluster]:
    """Memory nodes kv0 and kv1 speaking one transport."""
    skip_if_unavailable(request.param)
    directory = tmp_path_factory.mktemp(f"pool-{request.param}")
    config = pool_config(directory, transport=request.param, nodes=("kv0", "kv1"), capacity=32)
    with MemoryNodeProcess.started(config, directory, "kv0"), MemoryNodeProcess.started(config, directory, "kv1"):
        yield Cluster(config, directory)


@pytest.fixture
async def pool(two_nodes: Cluster) -> AsyncIterator[KVPoolClient]:
    client = KVPoolClient(two_nodes.config, tiny_layout())
    yield client
    await client.close()


def lease_for(issuer: CapabilityIssuer, blocks: tuple[BlockRef, ...], epoch: int = 5) -> ReadLease:
    return ReadLease("L1", UNIT, epoch, blocks, 30.0, issuer.issue("read", blocks, epoch, 30.0, holder=HOLDER))


async def put(issuer: CapabilityIssuer, pool: KVPoolClient, blocks: tuple[BlockRef, ...], state: UnitState,
              epoch: int = 5) -> None:
    """Write a unit's blocks the way a writer would, under capabilities the test signs as the plane."""
    views = encode_unit(pool.layout, state, UNIT, epoch)
    caps = capabilities(blocks, epoch, issuer.issue("write", blocks, epoch, 30.0, holder=HOLDER))
    for ref, view in zip(blocks, views, strict=True):
        await pool.transport.write(await pool.endpoints.get(ref.node), [SlotIO(ref.index, view, caps.get(ref.node))])


def spread(n_blocks: int, first: int = 0) -> tuple[BlockRef, ...]:
    return tuple(BlockRef("kv0" if i % 2 == 0 else "kv1", first + i) for i in range(n_blocks))


def assert_same_state(a: UnitState, b: UnitState) -> None:
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


async def test_a_unit_spread_over_two_memory_nodes_is_fetched_intact(pool: KVPoolClient,
        issuer: CapabilityIssuer) -> None:
    """Blocks on several nodes are read concurrently, verified, and assembled in order."""
    state = random_state(11, seed=1)  # 3 blocks, the last one partial
    blocks = spread(3)
    await put(issuer, pool, blocks, state)
    assert_same_state(await pool.fetch(lease_for(issuer, blocks), 11, release=False), state)


async def test_a_flipped_byte_in_a_stored_block_fails_the_fetch(pool: KVPoolClient, two_nodes: Cluster,
        issuer: CapabilityIssuer) -> None:
    """Corruption in the arena itself is caught by the reader's checksum."""
    state = random_state(8, seed=2)
    blocks = spread(2, first=10)
    await put(issuer, pool, blocks, state)
    ep = await pool.endpoints.get("kv1")
    arena = Arena.attach(ep.shm_name)
    try:
        arena.slot(blocks[1].index)[300] ^= 0x01
    finally:
        arena.close()
    # a signed cluster's reader finds it by the MAC (it skips the then redundant CRC-32)
    with pytest.raises(ChecksumMismatch, match="MAC mismatch" if pool.layout.mac_key else "crc32"):
        await pool.fetch(lease_for(issuer, blocks), 8, release=False)


class _RecordingControl:
    """The control client of a reader, recording what it reports."""

    def __init__(self) -> None:
        self.invalidated: list[tuple[str, int, str]] = []

    async def invalidate(self, unit_id: str, epoch: int, reader: str, reason: str) -> None:
        self.invalidated.append((unit_id, epoch, reader))

    async def close(self) -> None:
        pass


async def test_a_reader_reports_a_corrupt_entry_so_it_is_invalidated(two_nodes: Cluster,
        issuer: CapabilityIssuer) -> None:
    """Regression: on a checksum failure the reader only forgot endpoints; the entry stayed leasable."""
    control = _RecordingControl()
    pool = KVPoolClient(two_nodes.config, tiny_layout(), control=control, reader=HOLDER)  # type: ignore[arg-type]
    try:
        state = random_state(8, seed=4)
        blocks = spread(2, first=20)
        await put(issuer, pool, blocks, state, epoch=7)
        arena = Arena.attach((await pool.endpoints.get("kv0")).shm_name)
        try:
            arena.slot(blocks[0].index)[200] ^= 0x01
        finally:
            arena.close()
        with pytest.raises(ChecksumMismatch):
            await pool.fetch(lease_for(issuer, blocks, epoch=7), 8, release=False)
        assert control.invalidated == [(UNIT, 7, HOLDER)]
    finally:
        await pool.close()


# each case writes slots no other test wrote: a memory node takes one write per slot and grant
@pytest.mark.parametrize(("epoch", "n_tokens", "first"), [(6, 8, 14), (5, 7, 16)])
async def test_a_lease_that_does_not_describe_the_blocks_fails_the_fetch(
    pool: KVPoolClient, epoch: int, n_tokens: int, first: int, issuer: CapabilityIssuer
) -> None:
    """Another epoch (a stale writer's blocks) or another length is a failed fetch, not data."""
    blocks = spread(2, first=first)
    await put(issuer, pool, blocks, random_state(8, seed=3))
    with pytest.raises(ChecksumMismatch):
        await pool.fetch(lease_for(issuer, blocks, epoch), n_tokens, release=False)


async def test_reading_never_written_slots_fails_the_fetch(pool: KVPoolClient, issuer: CapabilityIssuer) -> None:
    """A zeroed slot has no header; it is never returned as a unit state."""
    with pytest.raises(ChecksumMismatch, match="no block header"):
        await pool.fetch(lease_for(issuer, (BlockRef("kv0", 31),)), 4, release=False)


@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "shm"])
async def test_killing_a_memory_node_during_a_read_fails_it_fast_with_a_typed_error(
    tmp_path: Path, transport: str, issuer: CapabilityIssuer, pool_config: PoolConfig, memory_node: StartMemoryNode
) -> None:
    """The reader sees a TransferError from the dead peer, well before its timeout."""
    skip_if_unavailable(transport)
    config = pool_config(tmp_path, transport=transport, capacity=16, timeout_s=20.0)
    with memory_node(config, tmp_path) as node:
        client = KVPoolClient(config, tiny_layout())
        try:
            blocks = tuple(BlockRef("kv0", i) for i in range(4))
            await put(issuer, client, blocks, random_state(16, seed=4))
            node.pause()  # the read request is sent and sits unanswered...
            fetch = asyncio.create_task(client.fetch(lease_for(issuer, blocks), 16, release=False))
            await asyncio.sleep(0.5)
            assert not fetch.done()
            node.kill()  # ...until the node dies under it
            with pytest.raises(TransferError) as info:
                await asyncio.wait_for(fetch, HANG_GUARD_S)
            assert not isinstance(info.value, TransferTimeout)
        finally:
            with contextlib.suppress(Exception):
                await client.close()


async def test_a_copy_that_could_outlive_its_lease_is_not_started(pool: KVPoolClient, issuer: CapabilityIssuer) -> None:
    """Leased blocks are protected only until the lease ends; with less than a transfer timeout
    left the reader falls back instead of racing reclamation."""
    blocks = spread(1, first=25)
    await put(issuer, pool, blocks, random_state(4, seed=5))
    lease = lease_for(issuer, blocks)
    with pytest.raises(TransferError, match="left"):
        await pool.fetch(lease, 4, release=False, received_at=time.monotonic() - lease.ttl_s + 1.0)
    await pool.fetch(lease, 4, release=False, received_at=time.monotonic())


async def test_a_memory_node_with_another_block_layout_is_refused(two_nodes: Cluster, issuer: CapabilityIssuer) -> None:
    """Slots sized for another model or block_tokens are never read as this node's blocks."""
    client = KVPoolClient(two_nodes.config, BlockLayout(TINY_GEOMETRY, BLOCK_TOKENS * 2))
    try:
        with pytest.raises(TransferError, match="block_tokens"):
            await client.fetch(lease_for(issuer, (BlockRef("kv0", 0),)), 4, release=False)
    finally:
        await client.close()
