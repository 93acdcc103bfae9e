"""Every transport passes the same suite against a real memory node process on loopback.

Parametrized over ``shm``, ``tcp`` and ``mooncake``. The mooncake cases skip only when the
Mooncake Transfer Engine cannot be loaded here, and the skip says why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from helpers.kvpool import HANG_GUARD_S, TRANSPORTS, PoolConfig, skip_if_unavailable
from helpers.processes import MemoryNodeProcess, StartMemoryNode

from tessera.config import ClusterConfig
from tessera.errors import ConfigError, TransferError, TransferTimeout
from tessera.transport.base import NodeEndpoint, SlotIO, Transport, create_transport


@dataclasses.dataclass
class Node:
    transport: str
    config: ClusterConfig
    endpoint: NodeEndpoint
    process: MemoryNodeProcess


@pytest.fixture(scope="module", params=TRANSPORTS)
def shared_node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        pool_config: PoolConfig) -> Iterator[Node]:
    """One memory node per transport, shared by the tests that do not hurt it."""
    skip_if_unavailable(request.param)
    directory = tmp_path_factory.mktemp(f"kvpool-{request.param}")
    # transports move bytes; capabilities are the memory node's business (test_security.py)
    config = pool_config(directory, transport=request.param, capacity=64, secure=False)
    with MemoryNodeProcess.started(config, directory) as proc:
        yield Node(request.param, config, proc.endpoint(), proc)


@pytest.fixture
def own_node(shared_node: Node, tmp_path: Path, pool_config: PoolConfig,
        memory_node: StartMemoryNode) -> Iterator[Node]:
    """A memory node of the same transport that a test may stop or kill."""
    config = pool_config(tmp_path, transport=shared_node.transport, capacity=16, secure=False)
    with memory_node(config, tmp_path) as proc:
        yield Node(shared_node.transport, config, proc.endpoint(), proc)


@pytest.fixture
async def transports() -> AsyncIterator[list[Transport]]:
    made: list[Transport] = []
    yield made
    for t in made:
        await t.close()


def client(node: Node, made: list[Transport], **overrides: object) -> Transport:
    t = create_transport(dataclasses.replace(node.config.transport, **overrides))  # type: ignore[arg-type]
    made.append(t)
    return t


def blobs(n: int, size: int, seed: int) -> list[memoryview]:
    rng = random.Random(seed)
    return [memoryview(bytearray(rng.randbytes(size))) for _ in range(n)]


def empty(n: int, size: int) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


async def guarded(coro: object) -> None:
    await asyncio.wait_for(coro, HANG_GUARD_S)  # type: ignore[arg-type]


async def test_a_slot_round_trips(shared_node: Node, transports: list[Transport]) -> None:
    """What is written to a slot is what a later read returns."""
    t = client(shared_node, transports)
    ep = shared_node.endpoint
    (data,) = blobs(1, ep.slot_bytes, seed=1)
    await t.write(ep, [SlotIO(5, data)])
    (out,) = empty(1, ep.slot_bytes)
    await t.read(ep, [SlotIO(5, out)])
    assert bytes(out) == bytes(data)


async def test_a_batch_of_many_slots_round_trips_in_several_requests(
    shared_node: Node, transports: list[Transport]
) -> None:
    """A large batch in any slot order is split into bounded requests and lands intact."""
    ep = shared_node.endpoint
    t = client(shared_node, transports, max_inflight_bytes=8 * ep.slot_bytes)
    slots = random.Random(2).sample(range(ep.capacity_blocks), 48)
    data = blobs(len(slots), ep.slot_bytes, seed=3)
    await t.write(ep, [SlotIO(s, d) for s, d in zip(slots, data, strict=True)])
    out = empty(len(slots), ep.slot_bytes)
    await t.read(ep, [SlotIO(s, o) for s, o in zip(slots, out, strict=True)])
    assert [bytes(o) for o in out] == [bytes(d) for d in data]
    assert t.limiter.stats.requests >= 2 * 48 // 8


async def test_partial_blocks_touch_only_their_prefix(shared_node: Node, transports: list[Transport]) -> None:
    """A short write replaces the slot's first bytes and leaves the rest as it was."""
    t = client(shared_node, transports)
    ep = shared_node.endpoint
    full, short = blobs(1, ep.slot_bytes, seed=4)[0], blobs(1, 64 + 3 * 128, seed=5)[0]
    await t.write(ep, [SlotIO(7, full)])
    await t.write(ep, [SlotIO(7, short)])
    head, whole = empty(1, len(short))[0], empty(1, ep.slot_bytes)[0]
    await t.read(ep, [SlotIO(7, head), SlotIO(7, whole)])
    assert bytes(head) == bytes(short)
    assert bytes(whole) == bytes(short) + bytes(full[len(short):])


async def test_concurrent_batches_never_exceed_the_bounds(shared_node: Node, transports: list[Transport]) -> None:
    """In-flight bytes and outstanding requests stay within [transport] limits under load."""
    ep = shared_node.endpoint
    t = client(shared_node, transports, max_inflight_bytes=3 * ep.slot_bytes, max_outstanding=2)
    groups = [list(range(i * 4, i * 4 + 4)) for i in range(10)]
    data = [blobs(4, ep.slot_bytes, seed=10 + i) for i in range(10)]
    held = await t.limiter.acquire(2 * ep.slot_bytes)  # so that the first requests must queue
    writes = asyncio.gather(*(t.write(ep, [SlotIO(s, d) for s, d in zip(g, ds, strict=True)])
                              for g, ds in zip(groups, data, strict=True)))
    await asyncio.sleep(0.05)
    assert t.limiter.stats.waited > 0 and not writes.done()
    t.limiter.release(held)
    await writes
    outs = [empty(4, ep.slot_bytes) for _ in groups]
    await asyncio.gather(*(t.read(ep, [SlotIO(s, o) for s, o in zip(g, os_, strict=True)])
                           for g, os_ in zip(groups, outs, strict=True)))
    assert [[bytes(o) for o in os_] for os_ in outs] == [[bytes(d) for d in ds] for ds in data]
    stats = t.limiter.stats
    assert stats.peak_bytes <= 3 * ep.slot_bytes and stats.peak_outstanding <= 2
    assert (t.limiter.bytes, t.limiter.outstanding) == (0, 0)


async def test_a_transfer_that_cannot_finish_in_time_raises_transfer_timeout(
    shared_node: Node, transports: list[Transport]
) -> None:
    """With the whole budget taken, a read waits, then fails with TransferTimeout (not a hang)."""
    ep = shared_node.endpoint
    t = client(shared_node, transports, timeout_s=0.3)
    held = await t.limiter.acquire(t.limiter.max_bytes)
    with pytest.raises(TransferTimeout):
        await guarded(t.read(ep, [SlotIO(0, empty(1, 64)[0])]))
    t.limiter.release(held)
    await t.read(ep, [SlotIO(0, empty(1, 64)[0])])  # and it recovers


async def test_slots_outside_the_arena_are_refused(shared_node: Node, transports: list[Transport]) -> None:
    """A slot index past capacity or a buffer larger than a slot is a TransferError."""
    t = client(shared_node, transports)
    ep = shared_node.endpoint
    with pytest.raises(TransferError, match="does not fit"):
        await t.read(ep, [SlotIO(ep.capacity_blocks, empty(1, 64)[0])])
    with pytest.raises(TransferError, match="does not fit"):
        await t.write(ep, [SlotIO(0, empty(1, ep.slot_bytes + 1)[0])])


async def test_a_dead_memory_node_is_a_transfer_error(own_node: Node, transports: list[Transport]) -> None:
    """Reading from a killed node fails with a typed error instead of hanging."""
    ep = own_node.endpoint
    t = client(own_node, transports, timeout_s=2.0)
    await t.write(ep, [SlotIO(1, blobs(1, 256, seed=6)[0])])
    own_node.process.kill()
    with pytest.raises(TransferError):
        await guarded(t.read(ep, [SlotIO(1, empty(1, 256)[0])]))


async def test_a_memory_node_that_stops_answering_times_out(own_node: Node, transports: list[Transport]) -> None:
    """A frozen node (SIGSTOP) makes two-sided transports time out; shm reads stay one-sided."""
    ep = own_node.endpoint
    t = client(own_node, transports, timeout_s=1.0)
    data = blobs(1, 256, seed=7)[0]
    await t.write(ep, [SlotIO(2, data)])
    own_node.process.pause()
    try:
        out = empty(1, 256)[0]
        if own_node.transport == "shm":
            await guarded(t.read(ep, [SlotIO(2, out)]))  # no request ever reaches the node
            assert bytes(out) == bytes(data)
        else:
            with pytest.raises(TransferTimeout):
                await guarded(t.read(ep, [SlotIO(2, out)]))
    finally:
        own_node.process.resume()


async def test_a_restarted_memory_node_is_not_mistaken_for_the_old_one(
    own_node: Node, transports: list[Transport]
) -> None:
    """An endpoint of the previous incarnation is refused by the new one (new boot id)."""
    ep = own_node.endpoint
    t = client(own_node, transports, timeout_s=2.0)
    await t.write(ep, [SlotIO(3, blobs(1, 256, seed=8)[0])])
    own_node.process.stop()
    path = own_node.process.proc.log_path.parent / "tessera.toml"
    restarted = MemoryNodeProcess(own_node.config, path, "kv0")
    try:
        new = restarted.wait_healthy()
        assert new.boot_id != ep.boot_id
        with pytest.raises(TransferError):
            await guarded(t.read(ep, [SlotIO(3, empty(1, 256)[0])]))
        out = empty(1, 256)[0]
        await t.read(new, [SlotIO(3, out)])
        assert bytes(out) == bytes(256), "a restarted node comes back empty"
    finally:
        restarted.stop()


def test_an_unknown_transport_name_lists_the_known_ones(pool_config: PoolConfig) -> None:
    with pytest.raises(ConfigError, match="shm, tcp"):
        create_transport(dataclasses.replace(pool_config(Path(os.devnull).parent).transport, name="carrier-pigeon"))
