"""Fencing by term on a memory node's data port, seen from a deposed leader's side.

A real tcp block server with a cluster secret; two control planes' capability issuers share
the secret and differ only in their term (the high half of every epoch they issue).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from tessera.auth import CapabilityIssuer
from tessera.config import TransportConfig
from tessera.errors import TransferError
from tessera.generation.pool_client import capabilities
from tessera.messages.common import BlockRef
from tessera.transport.arena import Arena, segment_name
from tessera.transport.base import NodeEndpoint, SlotIO
from tessera.transport.handshake import DataPlaneCredentials
from tessera.transport.tcp import TcpTransport
from tessera.transport.tcp_server import BlockServer
from tessera.transport.terms import TERM_SHIFT, TermFence

SECRET = b"0123456789abcdef0123456789abcdef"
SLOT = 4096
OLD, NEW = 41, 57  # the deposed leader's term and its successor's (etcd revisions: any larger number)


@pytest.fixture
async def node() -> AsyncIterator[tuple[BlockServer, NodeEndpoint]]:
    boot = uuid.uuid4().hex
    arena = Arena.create(segment_name("fence", boot), SLOT, 16, boot)
    server = BlockServer(arena, boot, SECRET, "kv0")
    await server.start("127.0.0.1", 0)
    try:
        yield server, NodeEndpoint(1, "kv0", boot, 16, SLOT, arena.name, "127.0.0.1", server.port)
    finally:
        await server.close()
        arena.close()


async def write(ep: NodeEndpoint, slot: int, term: int, counter: int) -> None:
    """Write one slot under a write capability that the leader of ``term`` issued."""
    blocks = (BlockRef("kv0", slot),)
    epoch = term << TERM_SHIFT | counter
    token = CapabilityIssuer(SECRET).issue("write", blocks, epoch, 30.0, holder="gen0")
    cap = capabilities(blocks, epoch, token)["kv0"]
    t = TcpTransport(TransportConfig(name="tcp"), DataPlaneCredentials(SECRET))
    try:
        await t.write(ep, [SlotIO(slot, memoryview(bytearray(64)), cap)])
    finally:
        await t.close()


async def test_a_deposed_leaders_write_is_refused_once_the_new_term_was_seen(
        node: tuple[BlockServer, NodeEndpoint]) -> None:
    """After one write under term 57, a still-valid grant of term 41 cannot write any slot."""
    server, ep = node
    await write(ep, 1, OLD, 1)  # before the successor: the old leader's grants still work
    await write(ep, 2, NEW, 1)
    assert server.terms.newest == NEW
    with pytest.raises(TransferError, match="older than term 57"):
        await write(ep, 3, OLD, 2)  # a slot the new leader never touched: refused all the same
    await write(ep, 4, NEW, 2)


async def test_a_forged_capability_does_not_raise_the_term() -> None:
    """Only a capability that verified moves the fence (a forged high term cannot lock out the leader)."""
    fence = TermFence()
    fence.observe(NEW << TERM_SHIFT)
    assert fence.refusal(OLD << TERM_SHIFT | 5) is not None
    assert fence.refusal(NEW << TERM_SHIFT | 9) is None
    assert fence.refusal((NEW + 1) << TERM_SHIFT) is None


async def test_a_forged_high_term_write_leaves_the_fence_where_it_was(node: tuple[BlockServer, NodeEndpoint]) -> None:
    """A write whose MAC does not verify is refused and does not record its term."""
    server, ep = node
    blocks = (BlockRef("kv0", 5),)
    epoch = (NEW + 100) << TERM_SHIFT
    token = CapabilityIssuer(b"not-the-cluster-secret-0123456789").issue("write", blocks, epoch, 30.0,
                                                                      holder="gen0")
    t = TcpTransport(TransportConfig(name="tcp"), DataPlaneCredentials(SECRET))
    try:
        with pytest.raises(TransferError, match="not valid"):
            await t.write(ep, [SlotIO(5, memoryview(bytearray(64)), capabilities(blocks, epoch, token)["kv0"])])
    finally:
        await t.close()
    assert server.terms.newest == 0
    await write(ep, 6, OLD, 1)


async def test_the_term_is_settled_only_once_no_older_write_is_still_arriving(
        node: tuple[BlockServer, NodeEndpoint]) -> None:
    """The plane ends a memory node's restart fence when the node reports the new term
    settled. A deposed leader's write whose payload is still arriving when the new term is learned
    could land after that report, so the term is not settled until that write ends (or its
    connection does); a new request of the old term is refused meanwhile."""
    import asyncio

    from tessera.transport.frames import HELLO, RESPONSE, Op, Status, pack_request
    from tessera.transport.handshake import pack_auth, proof

    server, ep = node
    blocks = (BlockRef("kv0", 7),)
    epoch = OLD << TERM_SHIFT | 3
    token = CapabilityIssuer(SECRET).issue("write", blocks, epoch, 30.0, holder="gen0")
    cap = capabilities(blocks, epoch, token)["kv0"]
    reader, writer = await asyncio.open_connection(ep.data_host, ep.data_port)
    hello = HELLO.unpack(await reader.readexactly(HELLO.size))
    nonce = hello[-1]
    writer.write(pack_auth("gen0", proof(SECRET, "kv0", ep.boot_id, nonce, "gen0")))
    assert RESPONSE.unpack(await reader.readexactly(RESPONSE.size))[0] == Status.OK
    payload = b"p" * 64
    writer.write(pack_request(Op.WRITE, 1, [(7, len(payload))], cap) + payload[:10])  # the rest withheld
    await writer.drain()
    for _ in range(200):  # until the server has checked the capability and is taking the payload
        if any(c.writing_term == OLD for c in server.connections):
            break
        await asyncio.sleep(0.01)
    server.terms.observe_term(NEW)  # the new leader's signed term arrives (a hello answer)
    assert server.settled_term() == 0  # the old write may still land
    with pytest.raises(TransferError, match="older than term 57"):
        await write(ep, 8, OLD, 4)
    writer.write(payload[10:])
    assert RESPONSE.unpack(await reader.readexactly(RESPONSE.size))[0] == Status.OK
    assert server.settled_term() == NEW
    writer.close()
