"""``tcp`` transport: our compact binary block protocol (:mod:`.frames`) on asyncio.

One connection per memory node (per node we speak for, see :mod:`.handshake`), requests
pipelined on it; TLS when the credentials carry a context. Read answers are received with
``recv_into`` straight into the caller's buffers (:class:`asyncio.BufferedProtocol`), so a
block is copied once, by the kernel. A request whose caller gave up (cancelled because a
sibling transfer failed) is *abandoned*: the rest of its answer is drained into a scratch
buffer and never reaches the caller's memory. A timeout or error drops the connection.
aiohttp is for control messages only: its body handling is far slower for block payloads.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from tessera.config import TransportConfig
from tessera.errors import TransferError
from tessera.transport.base import NodeEndpoint, SlotIO, Transport, register_transport
from tessera.transport.frames import (
    HELLO,
    HELLO_MAGIC,
    MAX_ERROR_BYTES,
    RESPONSE,
    Op,
    Status,
    pack_request,
)
from tessera.transport.handshake import DataPlaneCredentials, pack_auth, proof


@dataclass(eq=False)
class _Pending:
    req_id: int
    op: Op
    views: list[memoryview]  # READ: where the answer goes (non-empty views only)
    fut: asyncio.Future[None]
    abandoned: bool = False
    index: int = 0
    offset: int = 0
    error: bytearray = field(default_factory=bytearray)


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, node: NodeEndpoint, secret: bytes | None, name: str) -> None:
        loop = asyncio.get_running_loop()
        self.node = node
        self.secret = secret
        self.name = name  # the generation node this connection authenticates as
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[None] = loop.create_future()
        self.failure: TransferError | None = None
        self.pending: deque[_Pending] = deque()
        self._writable = asyncio.Event()
        self._writable.set()
        self._ids = itertools.count(1)
        self._hello = bytearray(HELLO.size)
        self._response = bytearray(RESPONSE.size)
        self._scratch = bytearray(256 << 10)
        self._target = memoryview(self._hello)
        self._got = 0
        self._phase = "hello"
        self._body_left = 0
        self._status = Status.OK

    # --- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(TransferError(f"connection to memory node {self.node.name} lost"
                                 + (f": {exc}" if exc else " (peer closed it)")))

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._phase == "body":
            head = self.pending[0]
            if self._status is Status.ERROR:
                return memoryview(self._scratch)[: self._body_left]
            if head.abandoned:
                return memoryview(self._scratch)[: min(len(self._scratch), self._body_left)]
            return head.views[head.index][head.offset :]
        return self._target[self._got :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._phase == "body":
            return self._body_received(nbytes)
        self._got += nbytes
        if self._got < len(self._target):
            return
        self._got = 0
        if self._phase == "hello":
            return self._hello_received()
        self._response_received()

    # --- parsing -------------------------------------------------------------------------

    def _hello_received(self) -> None:
        magic, boot, slot_bytes, capacity, nonce = HELLO.unpack(self._hello)
        boot_id = boot.decode(errors="replace")
        if magic != HELLO_MAGIC:
            return self._fail(TransferError(f"{self.node.data_host}:{self.node.data_port} is not a tessera "
                                            f"memory node (hello {magic!r})"))
        if (boot_id, slot_bytes, capacity) != (self.node.boot_id, self.node.slot_bytes, self.node.capacity_blocks):
            return self._fail(TransferError(
                f"memory node {self.node.name} is boot {boot_id} with {capacity} slots of {slot_bytes} B, expected "
                f"boot {self.node.boot_id} with {self.node.capacity_blocks} of {self.node.slot_bytes} B "
                "(it restarted empty)"))
        self._phase, self._target = "response", memoryview(self._response)
        # answer the challenge; the node acknowledges it as request 0, which completes ``ready``
        mac = b"" if self.secret is None else proof(self.secret, self.node.name, boot_id, nonce, self.name)
        assert self.transport is not None
        self.pending.append(_Pending(0, Op.READ, [], self.ready))
        self.transport.write(pack_auth(self.name, mac))

    def _response_received(self) -> None:
        status, _, _, req_id, body = RESPONSE.unpack(self._response)
        if not self.pending or self.pending[0].req_id != req_id or status not in (Status.OK, Status.ERROR):
            return self._fail(TransferError(
                f"memory node {self.node.name}: unexpected answer {req_id} (status {status})"))
        head = self.pending[0]
        self._status = Status(status)
        expected = sum(len(v) for v in head.views) if head.op is Op.READ else 0
        if (self._status is Status.OK and body != expected) or \
                (self._status is Status.ERROR and body > MAX_ERROR_BYTES):
            return self._fail(TransferError(f"memory node {self.node.name}: answer of {body} B, expected {expected}"))
        if body == 0:
            return self._complete()
        self._phase, self._body_left = "body", body

    def _body_received(self, nbytes: int) -> None:
        head = self.pending[0]
        self._body_left -= nbytes
        if self._status is Status.ERROR:
            head.error += self._scratch[:nbytes]
        elif not head.abandoned:
            head.offset += nbytes
            if head.offset == len(head.views[head.index]):
                head.index, head.offset = head.index + 1, 0
        if self._body_left == 0:
            self._phase = "response"
            self._complete()

    def _complete(self) -> None:
        head = self.pending.popleft()
        if head.fut.done():
            return
        if self._status is Status.ERROR:
            reason = head.error.decode(errors="replace")
            head.fut.set_exception(TransferError(f"memory node {self.node.name} refused the request: {reason}"))
        else:
            head.fut.set_result(None)

    def _fail(self, error: TransferError) -> None:
        if self.failure is None:
            self.failure = error
        self._writable.set()  # wake senders so that they see the failure
        if self.transport is not None:
            self.transport.abort()
        for fut in [self.ready, *(p.fut for p in self.pending)]:
            if not fut.done():
                fut.set_exception(self.failure)
                fut.exception()  # retrieved: a failed hello nobody awaits is not an error to log
        self.pending.clear()

    # --- client side ---------------------------------------------------------------------

    async def request(self, op: Op, ios: Sequence[SlotIO]) -> None:
        await self._writable.wait()
        if self.failure is not None:
            raise self.failure
        assert self.transport is not None
        views = [io.buf for io in ios if len(io.buf)] if op is Op.READ else []
        pending = _Pending(next(self._ids), op, views, asyncio.get_running_loop().create_future())
        # no await between queueing and sending: the answer order is the send order
        self.pending.append(pending)
        head = pack_request(op, pending.req_id, [(io.slot, len(io.buf)) for io in ios], ios[0].cap if ios else None)
        if op is Op.WRITE:
            self.transport.writelines([head, *(io.buf for io in ios if len(io.buf))])
        else:
            self.transport.write(head)
        try:
            await pending.fut
        except asyncio.CancelledError:
            pending.abandoned = True  # the rest of its answer goes to scratch, never to io.buf
            raise

    def close(self) -> None:
        self._fail(TransferError(f"connection to memory node {self.node.name} closed by the client"))


@register_transport("tcp")
class TcpTransport(Transport):
    def __init__(self, config: TransportConfig, credentials: DataPlaneCredentials | None = None) -> None:
        super().__init__(config, credentials)
        self._conns: dict[tuple[str, str], _Connection] = {}  # (memory node, who we speak for)
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def _speaker(self, ios: Sequence[SlotIO]) -> str:
        """The node this request's connection must be authenticated as."""
        name = self.credentials.name
        if name is not None:
            return name
        cap = ios[0].cap if ios else None
        return "" if cap is None else cap.holder

    async def _connection(self, node: NodeEndpoint, speaker: str) -> _Connection:
        key = (node.name, speaker)
        conn = self._conns.get(key)
        if conn is not None and conn.failure is None and conn.node == node:
            return conn
        async with self._locks.setdefault(key, asyncio.Lock()):
            conn = self._conns.get(key)
            if conn is not None and conn.failure is None and conn.node == node:
                return conn
            self._drop(key)
            loop = asyncio.get_running_loop()
            creds = self.credentials
            _, conn = await loop.create_connection(lambda: _Connection(node, creds.secret, speaker), node.data_host,
                                                   node.data_port, ssl=creds.ssl,
                                                   server_hostname=node.data_host if creds.ssl else None)
            try:
                await conn.ready
            except BaseException:
                conn.close()
                raise
            self._conns[key] = conn
            return conn

    async def _read(self, node: NodeEndpoint, ios: Sequence[SlotIO]) -> None:
        await (await self._connection(node, self._speaker(ios))).request(Op.READ, ios)

    async def _write(self, node: NodeEndpoint, ios: Sequence[SlotIO]) -> None:
        await (await self._connection(node, self._speaker(ios))).request(Op.WRITE, ios)

    def _drop(self, key: tuple[str, str]) -> None:
        conn = self._conns.pop(key, None)
        if conn is not None:
            conn.close()

    def forget(self, node: str) -> None:
        for key in [k for k in self._conns if k[0] == node]:
            self._drop(key)

    async def close(self) -> None:
        for key in list(self._conns):
            self._drop(key)
