"""The tcp block protocol: hello, pipelined answers in order, refusals, abandoned requests."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest

from tessera.config import TransportConfig
from tessera.errors import TransferError
from tessera.transport.arena import Arena, segment_name
from tessera.transport.base import NodeEndpoint, SlotIO
from tessera.transport.frames import BLOCK, HELLO, REQUEST, RESPONSE, Op, Status, pack_request
from tessera.transport.handshake import pack_auth
from tessera.transport.tcp import TcpTransport
from tessera.transport.tcp_server import BlockServer

SLOT = 4096
CAPACITY = 32
HANG_GUARD_S = 30.0  # only so that a failing test fails instead of hanging; never a time being measured


@contextlib.asynccontextmanager
async def block_server(limits: TransportConfig | None = None) -> AsyncIterator[tuple[BlockServer, NodeEndpoint]]:
    boot = uuid.uuid4().hex
    arena = Arena.create(segment_name("tcptest", boot), SLOT, CAPACITY, boot)
    server = BlockServer(arena, boot, limits=limits)
    await server.start("127.0.0.1", 0)
    try:
        yield server, NodeEndpoint(1, "tcptest", boot, CAPACITY, SLOT, arena.name, "127.0.0.1", server.port)
    finally:
        await server.close()
        arena.close()


@pytest.fixture
async def served() -> AsyncIterator[tuple[Arena, NodeEndpoint]]:
    async with block_server() as (server, ep):
        yield server.arena, ep


async def connect(ep: NodeEndpoint) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection past the handshake (this node has no secret: any AUTH frame will do)."""
    reader, writer = await asyncio.open_connection(ep.data_host, ep.data_port)
    magic, boot, slot, capacity, _ = HELLO.unpack(await reader.readexactly(HELLO.size))
    assert (magic, boot.decode(), slot, capacity) == (b"TKVTCP02", ep.boot_id, SLOT, CAPACITY)
    writer.write(pack_auth("gen0", b""))
    assert RESPONSE.unpack(await reader.readexactly(RESPONSE.size)) == (Status.OK, 0, 0, 0, 0)
    return reader, writer


async def answer(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    status, _, _, req_id, n = RESPONSE.unpack(await reader.readexactly(RESPONSE.size))
    return status, req_id, await reader.readexactly(n)


async def test_pipelined_requests_are_answered_in_order(served: tuple[Arena, NodeEndpoint]) -> None:
    """Several requests sent back to back get their answers in the same order."""
    arena, ep = served
    for slot in range(3):
        arena.slot(slot)[:4] = bytes([slot + 1]) * 4
    reader, writer = await connect(ep)
    payload = b"w" * 100
    writer.write(pack_request(Op.READ, 11, [(0, 4)]) + pack_request(Op.WRITE, 12, [(9, 100)]) + payload
                 + pack_request(Op.READ, 13, [(2, 4), (1, 4), (9, 3)]))
    assert await answer(reader) == (Status.OK, 11, b"\x01" * 4)
    assert await answer(reader) == (Status.OK, 12, b"")
    assert await answer(reader) == (Status.OK, 13, b"\x03" * 4 + b"\x02" * 4 + b"www")
    writer.close()


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (REQUEST.pack(9, 0, 0, 5, 0, 0, 0), "bad request header"),
        (pack_request(Op.READ, 5, [(CAPACITY, 8)]), "outside the arena"),
        (pack_request(Op.READ, 5, [(0, SLOT + 1)]), "outside the arena"),
        (REQUEST.pack(Op.WRITE, 0, 0, 5, 1, 0, 7) + BLOCK.pack(0, 8), "does not match"),
    ],
)
async def test_a_bad_request_is_refused_with_a_reason_and_the_connection_closed(
    served: tuple[Arena, NodeEndpoint], frame: bytes, reason: str
) -> None:
    """The node cannot trust the rest of that stream; other connections are unaffected."""
    _, ep = served
    reader, writer = await connect(ep)
    writer.write(frame)
    status, req_id, body = await answer(reader)
    assert (status, req_id) == (Status.ERROR, 5) and reason in body.decode()
    assert await reader.read() == b""  # closed
    writer.close()
    reader2, writer2 = await connect(ep)
    writer2.write(pack_request(Op.READ, 6, [(0, 1)]))
    assert (await answer(reader2))[:2] == (Status.OK, 6)
    writer2.close()


async def test_the_client_refuses_a_node_with_another_boot_id(served: tuple[Arena, NodeEndpoint]) -> None:
    """An endpoint from before a restart never reaches the new incarnation's slots."""
    _, ep = served
    stale = NodeEndpoint(1, ep.name, uuid.uuid4().hex, CAPACITY, SLOT, ep.shm_name, ep.data_host, ep.data_port)
    t = TcpTransport(TransportConfig(name="tcp", timeout_s=2.0))
    with pytest.raises(TransferError, match="restarted"):
        await t.write(stale, [SlotIO(0, memoryview(bytearray(8)))])
    await t.close()


async def test_an_abandoned_read_never_writes_into_its_buffers_and_the_connection_goes_on(
    served: tuple[Arena, NodeEndpoint],
) -> None:
    """A read cancelled mid-flight (a sibling transfer failed) is drained into scratch."""
    arena, ep = served
    for slot in range(CAPACITY):
        arena.slot(slot)[:] = bytes([slot]) * SLOT
    t = TcpTransport(TransportConfig(name="tcp"))
    await t.read(ep, [SlotIO(0, memoryview(bytearray(1)))])  # connected
    bufs = [memoryview(bytearray(SLOT)) for _ in range(CAPACITY)]
    task = asyncio.create_task(t.read(ep, [SlotIO(s, b) for s, b in enumerate(bufs)]))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    snapshot = [bytes(b) for b in bufs]
    out = memoryview(bytearray(SLOT))
    for _ in range(3):
        await t.read(ep, [SlotIO(7, out)])
    assert bytes(out) == bytes([7]) * SLOT
    assert [bytes(b) for b in bufs] == snapshot
    await t.close()


async def test_past_its_cap_a_peer_is_closed_before_the_hello_until_one_of_its_connections_ends() -> None:
    """A closed connection gives its room back: the peer's next connection is served again."""
    async with block_server(TransportConfig(max_connections_per_peer=1)) as (server, ep):
        reader, writer = await connect(ep)
        turned_away, other = await asyncio.open_connection(ep.data_host, ep.data_port)
        assert await turned_away.read() == b""  # not even the hello
        other.close()
        writer.close()
        async with asyncio.timeout(HANG_GUARD_S):
            while server.stats()["connections"]:
                await asyncio.sleep(0.01)
        reader, writer = await connect(ep)  # hello and handshake again
        writer.write(pack_request(Op.READ, 7, [(0, 1)]))
        assert (await answer(reader))[:2] == (Status.OK, 7)
        writer.close()
        assert server.stats()["refused_peer_connections"] == 1


async def test_closing_the_server_closes_connections_that_never_authenticated() -> None:
    """close() leaves nothing behind, whether a connection is authenticated or still silent."""
    async with block_server() as (server, ep):
        _, authenticated = await connect(ep)
        silent, silent_writer = await asyncio.open_connection(ep.data_host, ep.data_port)
        await silent.readexactly(HELLO.size)
        assert server.stats()["connections"] == 2
        await server.close()
        async with asyncio.timeout(HANG_GUARD_S):
            assert await silent.read() == b""
        assert server.stats()["connections"] == 0
        authenticated.close()
        silent_writer.close()
