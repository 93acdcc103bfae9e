"""The tcp data plane from the attacker's side: sniffing, replaying, skipping the handshake, exhaustion.

Real sockets and a real :class:`BlockServer` under a cluster secret. A recording proxy sits
between a generation node and the memory node, as a sniffer on the network would, and the
tests then try to spend what it saw on connections of their own. The exhaustion tests open
silent connections from other loopback addresses (127.0.0.2 ...: other peers on Linux) while
a generation node's transport, from 127.0.0.1, moves blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import ssl
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers.kvpool import PoolConfig, tiny_layout

from tessera.auth import CapabilityIssuer, ClusterAuth
from tessera.config import SecurityConfig, TransportConfig
from tessera.errors import TransferError
from tessera.generation.pool_client import capabilities
from tessera.kvpool.node import MemoryNode
from tessera.messages.common import BlockRef
from tessera.transport.arena import Arena, segment_name
from tessera.transport.base import NodeEndpoint, SlotIO
from tessera.transport.frames import HELLO, REQUEST, RESPONSE, Capability, Op, Status, pack_request
from tessera.transport.handshake import AUTH, DataPlaneCredentials, pack_auth, proof
from tessera.transport.tcp import TcpTransport
from tessera.transport.tcp_server import BlockServer

SECRET = b"fedcba9876543210fedcba9876543210"
SLOT, CAPACITY = 4096, 16
VICTIM, OTHER = "gen-a", "gen-b"
HANG_GUARD_S = 30.0  # only so that a failing test fails instead of hanging; never a time being measured


@dataclass
class Recorder:
    """A TCP forwarder that keeps every byte it forwards (``up``: client -> node, ``down``: back)."""

    target: tuple[str, int]
    up: bytearray = field(default_factory=bytearray)
    down: bytearray = field(default_factory=bytearray)
    port: int = 0
    _server: asyncio.Server | None = None
    _handlers: list[asyncio.Task[None]] = field(default_factory=list)
    _writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.append(task)
        up_r, up_w = await asyncio.open_connection(*self.target)
        self._writers += [writer, up_w]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, log: bytearray) -> None:
            with contextlib.suppress(OSError):
                while chunk := await src.read(65536):
                    log += chunk
                    dst.write(chunk)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_w, self.up), pipe(up_r, writer, self.down))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)


@dataclass
class Node:
    server: BlockServer
    arena: Arena
    ep: NodeEndpoint
    issuer: CapabilityIssuer

    def via(self, port: int) -> NodeEndpoint:
        """The same node reached through another port (the recording proxy)."""
        return NodeEndpoint(1, "kv0", self.ep.boot_id, CAPACITY, SLOT, self.arena.name, "127.0.0.1", port)

    def cap(self, op: str, slots: list[int], holder: str) -> Capability:
        blocks = tuple(BlockRef("kv0", s) for s in slots)
        return capabilities(blocks, 3, self.issuer.issue(op, blocks, 3, 30.0, holder=holder))["kv0"]


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    key.chmod(0o600)
    return cert, key


def contexts(files: tuple[Path, Path]) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(str(files[0]), str(files[1]))
    return server, ssl.create_default_context(cafile=str(files[0]))


@contextlib.asynccontextmanager
async def memory_node(server_ssl: ssl.SSLContext | None = None,
                      limits: TransportConfig | None = None) -> AsyncIterator[Node]:
    boot = uuid.uuid4().hex
    arena = Arena.create(segment_name("attack", boot), SLOT, CAPACITY, boot)
    server = BlockServer(arena, boot, SECRET, "kv0", server_ssl, limits=limits)
    await server.start("127.0.0.1", 0)
    try:
        yield Node(server, arena, NodeEndpoint(1, "kv0", boot, CAPACITY, SLOT, arena.name, "127.0.0.1", server.port),
                   CapabilityIssuer(SECRET))
    finally:
        await server.close()
        arena.close()


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    async with memory_node() as n:
        yield n


@contextlib.asynccontextmanager
async def transport(name: str, client_ssl: ssl.SSLContext | None = None, secret: bytes = SECRET,
                    timeout_s: float = 5.0) -> AsyncIterator[TcpTransport]:
    t = TcpTransport(TransportConfig(name="tcp", timeout_s=timeout_s), DataPlaneCredentials(secret, name, client_ssl))
    try:
        yield t
    finally:
        await t.close()


@contextlib.asynccontextmanager
async def recorder(target: NodeEndpoint) -> AsyncIterator[Recorder]:
    rec = Recorder((target.data_host, target.data_port))
    await rec.start()
    try:
        yield rec
    finally:
        await rec.close()


def secret_block() -> bytes:
    return b"tenant-text:" + secrets.token_bytes(SLOT - 12)


async def victim_reads(node: Node, payload: bytes, via: Recorder, client_ssl: ssl.SSLContext | None = None) -> bytes:
    """gen-a writes ``payload`` to slot 4 and reads it back through the sniffer; returns what it read."""
    async with transport(VICTIM, client_ssl) as t:
        await t.write(node.ep, [SlotIO(4, memoryview(bytearray(payload)), node.cap("write", [4], VICTIM))])
        out = bytearray(SLOT)
        await t.read(node.via(via.port), [SlotIO(4, memoryview(out), node.cap("read", [4], VICTIM))])
    return bytes(out)


async def raw(ep: NodeEndpoint) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes, bytes]:
    """A plain socket to the data port: (reader, writer, boot id, this connection's nonce)."""
    reader, writer = await asyncio.open_connection(ep.data_host, ep.data_port)
    _, boot, _, _, nonce = HELLO.unpack(await reader.readexactly(HELLO.size))
    return reader, writer, boot, nonce


async def refusal(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, bytes]:
    """The node's answer, which must be an ERROR; (reason, every byte the node sent until it closed)."""
    head = await reader.readexactly(RESPONSE.size)
    status, _, _, _, n = RESPONSE.unpack(head)
    body = await reader.readexactly(n)
    try:
        rest = await asyncio.wait_for(reader.read(), 5.0)
    except ConnectionResetError:  # closed with our unread bytes still queued: the kernel resets
        rest = b""
    writer.close()
    assert status == Status.ERROR, (status, body)
    assert rest == b"", "the node sent more after refusing"
    return body.decode(), head + body + rest


def captured_request(up: bytes) -> bytes:
    """The read request a sniffer saw after the victim's handshake: header, block list, capability."""
    _, n, _ = AUTH.unpack_from(up, 0)
    return up[AUTH.size + n :]


async def test_a_sniffed_read_capability_is_useless_on_any_other_connection(node: Node) -> None:
    """Regression: a sniffed read request, replayed, leaked part of the victim's block; now none of it comes back."""
    payload = secret_block()
    async with recorder(node.ep) as sniffer:
        assert await victim_reads(node, payload, sniffer) == payload  # the victim itself is served
    assert payload[:64] in bytes(sniffer.down)  # plaintext: a sniffer sees blocks in flight (TLS is below)
    stolen = captured_request(bytes(sniffer.up))
    assert REQUEST.unpack_from(stolen)[0] == Op.READ

    # 1. replay the victim's whole stream, handshake included, on a fresh connection
    reader, writer, _, _ = await raw(node.ep)
    writer.write(bytes(sniffer.up))
    reason, seen = await refusal(reader, writer)
    assert "handshake failed" in reason and payload[:16] not in seen

    # 2. another cluster node, properly authenticated as itself, presents the sniffed lease
    reader, writer, boot, nonce = await raw(node.ep)
    writer.write(pack_auth(OTHER, proof(SECRET, "kv0", boot.decode(), nonce, OTHER)))
    assert RESPONSE.unpack(await reader.readexactly(RESPONSE.size))[0] == Status.OK
    writer.write(stolen)
    reason, seen = await refusal(reader, writer)
    assert f"authenticated as {OTHER!r}" in reason and payload[:16] not in seen

    # 3. the same through the client library: gen-b's transport cannot spend gen-a's lease
    async with transport(OTHER) as t:
        out = bytearray(SLOT)
        with pytest.raises(TransferError, match="not valid"):
            await t.read(node.ep, [SlotIO(4, memoryview(out), node.cap("read", [4], VICTIM))])
        assert bytes(out) == bytes(SLOT)


async def test_a_sniffed_write_grant_cannot_be_spent_by_another_node(node: Node) -> None:
    """A write grant names its writer: another node cannot write the slots, even before the writer does."""
    grant = node.cap("write", [6], VICTIM)
    async with transport(OTHER) as t:
        with pytest.raises(TransferError, match="not valid"):
            await t.write(node.ep, [SlotIO(6, memoryview(bytearray(b"evil" * 16)), grant)])
    assert bytes(node.arena.slot(6)[:64]) == bytes(64)
    async with transport(VICTIM) as t:  # the writer's own grant is still unspent
        await t.write(node.ep, [SlotIO(6, memoryview(bytearray(b"good" * 16)), grant)])
    assert bytes(node.arena.slot(6)[:64]) == b"good" * 16


async def test_a_connection_that_skips_or_forges_the_handshake_is_refused_before_any_block(node: Node) -> None:
    node.arena.slot(2)[:16] = b"K" * 16
    cap = node.cap("read", [2], VICTIM)
    reader, writer, _, _ = await raw(node.ep)  # no handshake: a request straight away
    writer.write(pack_request(Op.READ, 1, [(2, 16)], cap))
    reason, seen = await refusal(reader, writer)
    assert "did not start with the data handshake" in reason and b"K" * 16 not in seen

    reader, writer, boot, nonce = await raw(node.ep)  # a handshake without the secret
    guessed = b"not-the-cluster-secret-000000000"
    writer.write(pack_auth(VICTIM, proof(guessed, "kv0", boot.decode(), nonce, VICTIM)) +
                 pack_request(Op.READ, 1, [(2, 16)], cap))
    reason, seen = await refusal(reader, writer)
    assert "handshake failed" in reason and b"K" * 16 not in seen

    async with transport(VICTIM, secret=guessed) as t:  # the client library says why
        with pytest.raises(TransferError, match="handshake failed"):
            await t.read(node.ep, [SlotIO(2, memoryview(bytearray(16)), cap)])


async def test_with_tls_the_wire_carries_neither_blocks_nor_capabilities(tls_files: tuple[Path, Path]) -> None:
    server_ctx, client_ctx = contexts(tls_files)
    payload = secret_block()
    async with memory_node(server_ctx) as n, recorder(n.ep) as sniffer:
        assert await victim_reads(n, payload, sniffer, client_ctx) == payload
        mac = n.cap("read", [4], VICTIM).mac
    wire = bytes(sniffer.up) + bytes(sniffer.down)
    assert len(sniffer.down) > SLOT  # the block did cross this link, encrypted
    assert payload[:16] not in wire and payload[-16:] not in wire
    assert mac[:16] not in wire and b"tenant-text" not in wire and VICTIM.encode() not in wire


async def test_a_tls_data_port_refuses_plaintext_and_untrusting_clients(tls_files: tuple[Path, Path],
        tmp_path: Path) -> None:
    server_ctx, client_ctx = contexts(tls_files)
    async with memory_node(server_ctx) as n:
        n.arena.slot(1)[:16] = b"S" * 16
        cap = n.cap("read", [1], VICTIM)
        reader, writer = await asyncio.open_connection(n.ep.data_host, n.ep.data_port)
        writer.write(pack_auth(VICTIM, b"") + pack_request(Op.READ, 1, [(1, 16)], cap))
        seen = await asyncio.wait_for(reader.read(), 10.0)  # the TLS layer rejects it and closes
        assert b"S" * 16 not in seen and HELLO.pack(b"TKVTCP02", b"0" * 32, 0, 0, b"\0" * 32)[:8] not in seen
        writer.close()
        async with transport(VICTIM, None, timeout_s=1.0) as t:  # the library without TLS gets nothing
            out = bytearray(16)
            with pytest.raises(TransferError):
                await t.read(n.ep, [SlotIO(1, memoryview(out), cap)])
            assert bytes(out) == bytes(16)
        async with transport(VICTIM, ssl.create_default_context()) as t:  # does not trust the cluster's cert
            with pytest.raises(TransferError, match="CERTIFICATE_VERIFY_FAILED"):
                await t.read(n.ep, [SlotIO(1, memoryview(bytearray(16)), cap)])
        async with transport(VICTIM, client_ctx) as t:  # the cluster's own client is served
            out = bytearray(16)
            await t.read(n.ep, [SlotIO(1, memoryview(out), cap)])
            assert bytes(out) == b"S" * 16


def test_the_credentials_follow_the_cluster_tls_material(tls_files: tuple[Path, Path]) -> None:
    """A cluster process's data connections use TLS exactly when its HTTP listeners do."""
    plain = DataPlaneCredentials.of(ClusterAuth(SECRET), VICTIM)
    assert (plain.secret, plain.name, plain.ssl) == (SECRET, VICTIM, None)
    tls = DataPlaneCredentials.of(ClusterAuth(SECRET, SecurityConfig(
        tls_cert_file=str(tls_files[0]), tls_key_file=str(tls_files[1]))), VICTIM)
    assert isinstance(tls.ssl, ssl.SSLContext) and tls.ssl.verify_mode == ssl.CERT_REQUIRED


async def test_a_memory_node_of_a_tls_cluster_serves_its_data_port_over_tls(
        tls_files: tuple[Path, Path], tmp_path: Path, pool_config: PoolConfig) -> None:
    """The kvpool role and a generation node's credentials both take TLS from ``[security]``."""
    base = pool_config(tmp_path)
    config = dataclasses.replace(base, security=dataclasses.replace(
        base.security, tls_cert_file=str(tls_files[0]), tls_key_file=str(tls_files[1])))
    node = MemoryNode(config, config.kvpools[0], tiny_layout())
    await node.start()
    try:
        assert node.server.ssl is not None
        auth = ClusterAuth.from_config(config)
        issuer = CapabilityIssuer(auth.secret or b"")
        ep = node.endpoint()
        blocks = (BlockRef(ep.name, 3),)
        payload = secret_block()[: ep.slot_bytes]

        def cap(op: str, holder: str) -> Capability:
            return capabilities(blocks, 9, issuer.issue(op, blocks, 9, 30.0, holder=holder))[ep.name]

        creds = DataPlaneCredentials.of(auth, VICTIM)
        t = TcpTransport(TransportConfig(name="tcp", timeout_s=2.0), creds)
        try:
            await t.write(ep, [SlotIO(3, memoryview(bytearray(payload)), cap("write", VICTIM))])
            out = bytearray(len(payload))
            await t.read(ep, [SlotIO(3, memoryview(out), cap("read", VICTIM))])
            assert bytes(out) == payload
            with pytest.raises(TransferError, match="not valid"):  # bound to its holder over TLS too
                await t.read(ep, [SlotIO(3, memoryview(bytearray(16)), cap("read", OTHER))])
        finally:
            await t.close()
        async with transport(VICTIM, None, secret=auth.secret or b"", timeout_s=1.0) as plain:
            with pytest.raises(TransferError):
                await plain.read(ep, [SlotIO(3, memoryview(bytearray(16)), cap("read", VICTIM))])
    finally:
        await node.stop()
        node.close_arena()


async def silent(ep: NodeEndpoint, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection from ``source`` that will never send a byte."""
    return await asyncio.open_connection(ep.data_host, ep.data_port, local_addr=(source, 0))


async def hello_then_closed(reader: asyncio.StreamReader) -> bool:
    """Whether the node said hello on this connection; either way, wait until the node closes it."""
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            seen = await reader.read()
    except ConnectionResetError:
        seen = b""
    return len(seen) == HELLO.size


async def written_and_read(node: Node, t: TcpTransport, slot: int) -> bool:
    """gen-a writes a block to ``slot`` and reads it back over ``t``: whether it came back intact."""
    payload = secret_block()
    await t.write(node.ep, [SlotIO(slot, memoryview(bytearray(payload)), node.cap("write", [slot], VICTIM))])
    out = bytearray(SLOT)
    await t.read(node.ep, [SlotIO(slot, memoryview(out), node.cap("read", [slot], VICTIM))])
    return bytes(out) == payload


async def test_silent_connections_past_the_caps_are_closed_at_accept_while_blocks_keep_moving() -> None:
    """Regression: the data port took every connection it was offered (silent ones used the memory node's
    every descriptor and its HTTP port went dark). Now past its address's cap or the port's, a connection
    is closed as it is accepted, before the hello, and a generation node's transfers go on."""
    limits = TransportConfig(name="tcp", max_connections=8, max_connections_per_peer=3, handshake_timeout_s=60.0)
    async with memory_node(limits=limits) as node, transport(VICTIM) as t:
        flood = [await silent(node.ep, "127.0.0.2") for _ in range(5)]
        for reader, _ in flood[:3]:  # admitted: the node says hello and waits for the handshake
            await reader.readexactly(HELLO.size)
        for reader, _ in flood[3:]:  # past the address's cap: closed unanswered
            assert not await hello_then_closed(reader)
        assert await written_and_read(node, t, 1)  # another address (127.0.0.1): served
        flood += [await silent(node.ep, f"127.0.0.{i}") for i in (3, 3, 3, 4, 4)]
        for reader, _ in flood[5:9]:  # up to the port's cap of 8, with gen-a's connection
            await reader.readexactly(HELLO.size)
        assert not await hello_then_closed(flood[9][0])  # past the port's cap: closed unanswered
        stats = node.server.stats()
        assert (stats["connections"], stats["refused_peer_connections"], stats["refused_connections"]) == (8, 2, 1)
        assert await written_and_read(node, t, 2)  # gen-a's authenticated connection carries on
        for _, writer in flood:
            writer.close()


async def test_a_connection_that_does_not_authenticate_in_time_is_closed_and_blocks_keep_moving() -> None:
    """Regression: a connection could stay unauthenticated for ever. Now one that has not completed the
    handshake within transport.handshake_timeout_s is closed, silent or sending its AUTH frame slowly;
    an authenticated connection has no such deadline."""
    limits = TransportConfig(name="tcp", handshake_timeout_s=0.5)
    async with memory_node(limits=limits) as node, transport(VICTIM) as t:
        assert await written_and_read(node, t, 1)  # gen-a authenticated before any deadline ran out
        quiet_reader, quiet = await silent(node.ep, "127.0.0.2")
        slow_reader, slow = await silent(node.ep, "127.0.0.2")
        _, boot, _, _, nonce = HELLO.unpack(await slow_reader.readexactly(HELLO.size))
        slow.write(pack_auth(VICTIM, proof(SECRET, "kv0", boot.decode(), nonce, VICTIM))[:20])  # never the rest
        assert await hello_then_closed(quiet_reader)
        assert await slow_reader.read() == b""
        assert node.server.stats()["late_handshakes"] == 2
        assert await written_and_read(node, t, 2)  # on the same connection, long past the deadline
        assert node.server.stats()["connections"] == 1
        quiet.close()
        slow.close()


async def test_a_tls_data_port_caps_connections_before_the_tls_handshake(tls_files: tuple[Path, Path]) -> None:
    """With TLS a connection is counted from its accept, not from the end of a TLS handshake that a silent
    client never starts: past the cap it is closed at once, and within the cap the deadline closes it."""
    server_ctx, client_ctx = contexts(tls_files)
    limits = TransportConfig(name="tcp", max_connections_per_peer=2, handshake_timeout_s=1.0)
    async with memory_node(server_ctx, limits) as node, transport(VICTIM, client_ctx) as t:
        flood = [await silent(node.ep, "127.0.0.2") for _ in range(3)]
        assert not await hello_then_closed(flood[2][0])  # closed at accept, before any ClientHello
        assert node.server.stats()["refused_peer_connections"] == 1
        assert await written_and_read(node, t, 1)  # gen-a's TLS connection is served meanwhile
        for reader, _ in flood[:2]:
            assert not await hello_then_closed(reader)  # no TLS, no hello: closed at the deadline
        assert node.server.stats()["connections"] == 1
        for _, writer in flood:
            writer.close()
