"""Memory-node side of the ``tcp`` transport: serves slot reads and writes from the arena.

One :class:`asyncio.BufferedProtocol` per connection parses requests in place: headers and
block lists land in small preallocated buffers, write payloads are received straight into
the arena slots (no intermediate copy), and read payloads are handed to the socket as views
of the arena. Requests on a connection are answered in order, which is what lets a client
pipeline them. When the socket's send buffer fills up the node stops reading requests until
it drains, so a client that does not read its answers cannot grow the node's memory.

The server does not know which slot belongs to whom; the control plane decides that. With
a cluster secret a connection must first answer the node's challenge (:mod:`.handshake`),
which authenticates it as one generation node; then the server serves only requests whose
capability (the grant's or lease's token, see :mod:`.frames`) was issued to that node and
covers every slot they name; anything else is refused before a byte moves. A write grant
is single-use: each of its slots is written once under it (:mod:`.writes`). With an
``ssl`` context (the cluster's TLS certificate) the port speaks only TLS.

Connections are bounded before they cost anything (``[transport]`` ``max_connections``,
``max_connections_per_peer``, ``handshake_timeout_s``): the server accepts them itself, so a
connection past the port's cap or its peer's (remote address, :mod:`tessera.connections`)
is closed as it is accepted, before a TLS handshake, a hello or any read. An admitted one
must complete the handshake, TLS included, within ``handshake_timeout_s`` of its accept or it
is closed. A flood of silent connections thus holds at most ``max_connections`` descriptors,
each for at most the deadline, and the node's other ports keep theirs. Refusing rather than
closing an older connection is safe here: the cluster's clients hold a few authenticated
connections each for as long as they run, and nothing the deadline has not closed yet is
older than it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import ssl
import time
from typing import Any, cast

from tessera.auth import capability
from tessera.config import TransportConfig
from tessera.connections import ConnectionTable, peer_of
from tessera.ports import bind_listener
from tessera.transport.arena import Arena
from tessera.transport.frames import (
    BLOCK,
    CAP,
    FLAG_CAPABILITY,
    HELLO,
    HELLO_MAGIC,
    MAX_BLOCKS,
    REQUEST,
    RESPONSE,
    SLOT,
    Op,
    Status,
    unpack_blocks,
)
from tessera.transport.handshake import AUTH, AUTH_MAGIC, NONCE_BYTES, proof
from tessera.transport.terms import TermFence, term_of
from tessera.transport.writes import WriteLedger

log = logging.getLogger(__name__)
ACCEPT_BACKOFF_S = 0.1  # when accept fails (out of descriptors): try again after this, not in a busy loop


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, server: BlockServer) -> None:
        self.server = server
        # from the accept on, TLS handshake included; cancelled once the AUTH frame verifies
        self._deadline: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            server.limits.handshake_timeout_s, self._handshake_late)
        self.arena = server.arena
        self.transport: asyncio.Transport | None = None
        self._header = bytearray(REQUEST.size)
        self._blocks_raw = bytearray(BLOCK.size * 64)
        self._cap_raw = bytearray(CAP.size)
        self._cap: tuple[int, int, bytes] = (0, 0, b"")  # epoch, expires, mac of the current request
        self._mac = b""  # the handshake's proof
        self._flags = 0
        self._auth_raw = bytearray(AUTH.size)
        self._name_raw = bytearray(0)
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self.peer: str | None = None  # the generation node this connection authenticated as
        self._target = memoryview(self._auth_raw)
        self._got = 0
        self._phase = "auth"
        self._op = Op.READ
        self._req_id = 0
        self._payload = 0
        self._blocks: list[tuple[int, int]] = []
        self._next = 0
        self._closing = False
        self.writing_term: int | None = None  # the term of the write whose payload is arriving

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.write(HELLO.pack(HELLO_MAGIC, self.server.boot_id.encode()[:32].ljust(32, b"0"),
                                        self.arena.slot_bytes, self.arena.capacity, self._nonce))

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_deadline()
        self.server.lost(self)
        self.writing_term = None  # no byte of its payload lands any more

    def stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _handshake_late(self) -> None:
        self._deadline = None
        self.server.late_handshakes += 1
        if self.transport is not None:  # (still in TLS: the loop's ssl_handshake_timeout, the same, closes it)
            self._closing = True
            self.transport.abort()

    def pause_writing(self) -> None:
        assert self.transport is not None
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        assert self.transport is not None
        if not self._closing:
            self.transport.resume_reading()

    # --- receive -------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._got :]

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        while not self._closing and self._got == len(self._target):
            self._got = 0
            self._advance()

    def _expect(self, target: memoryview, phase: str) -> None:
        self._target, self._phase = target, phase

    def _advance(self) -> None:
        if self._phase == "auth":
            magic, n, self._mac = AUTH.unpack(self._auth_raw)
            if magic != AUTH_MAGIC:
                return self._refuse("the connection did not start with the data handshake (AUTH): this port serves "
                                    "tessera's tcp transport of the same version only")
            self._name_raw = bytearray(n)
            if n == 0:
                return self._authenticate()
            return self._expect(memoryview(self._name_raw), "name")
        if self._phase == "name":
            return self._authenticate()
        if self._phase == "header":
            op, flags, _, req_id, n, _, payload = REQUEST.unpack(self._header)
            self._req_id = req_id
            if op not in (Op.READ, Op.WRITE) or n > MAX_BLOCKS:
                return self._refuse(f"bad request header (op {op}, {n} blocks; at most {MAX_BLOCKS})")
            self._op, self._payload, self._flags = Op(op), payload, flags
            if n == 0 and not flags & FLAG_CAPABILITY:
                return self._respond_ok()
            if len(self._blocks_raw) < n * BLOCK.size:
                self._blocks_raw = bytearray(n * BLOCK.size)
            if n == 0:
                self._blocks = []
                return self._expect(memoryview(self._cap_raw), "cap")
            return self._expect(memoryview(self._blocks_raw)[: n * BLOCK.size], "blocks")
        if self._phase == "blocks":
            self._blocks = unpack_blocks(memoryview(self._blocks_raw), len(self._target) // BLOCK.size)
            for slot, length in self._blocks:
                if slot >= self.arena.capacity or length > self.arena.slot_bytes:
                    return self._refuse(f"slot {slot} ({length} B) outside the arena "
                                        f"({self.arena.capacity} slots of {self.arena.slot_bytes} B)")
            total = sum(length for _, length in self._blocks)
            if self._payload != (total if self._op is Op.WRITE else 0):
                return self._refuse(f"payload of {self._payload} B does not match the block list ({total} B)")
            if self._flags & FLAG_CAPABILITY:
                return self._expect(memoryview(self._cap_raw), "cap")
            if self.server.secret is not None:
                return self._refuse(f"{self._op.name.lower()} without a capability: this memory node serves "
                                    "only slots that the control plane granted or leased")
            return self._dispatch()
        if self._phase == "cap":
            epoch, expires, n_slots, mac = CAP.unpack(self._cap_raw)
            if n_slots > MAX_BLOCKS:
                return self._refuse(f"capability of {n_slots} slots; at most {MAX_BLOCKS}")
            self._cap = (epoch, expires, mac)
            if len(self._blocks_raw) < n_slots * SLOT.size:
                self._blocks_raw = bytearray(n_slots * SLOT.size)
            if n_slots == 0:
                return self._check_capability(())
            return self._expect(memoryview(self._blocks_raw)[: n_slots * SLOT.size], "capslots")
        if self._phase == "capslots":
            n_slots = len(self._target) // SLOT.size
            slots = tuple(s for (s,) in SLOT.iter_unpack(self._blocks_raw[: n_slots * SLOT.size]))
            return self._check_capability(slots)
        assert self._phase == "payload", self._phase
        self._next += 1
        self._next_payload()

    def _authenticate(self) -> None:
        name = self._name_raw.decode(errors="replace")
        secret = self.server.secret
        if secret is not None:
            want = proof(secret, self.server.node, self.server.boot_id, self._nonce, name)
            if not hmac.compare_digest(want, self._mac):
                return self._refuse(f"data handshake failed for {name!r}: the client does not hold the cluster "
                                    "secret, or answered another connection's challenge")
        self.peer = name
        self.stop_deadline()
        assert self.transport is not None  # acknowledged as request 0 (not counted as a request)
        self.transport.write(RESPONSE.pack(Status.OK, 0, 0, 0, 0))
        self._expect(memoryview(self._header), "header")

    def _check_capability(self, slots: tuple[int, ...]) -> None:
        secret = self.server.secret
        if secret is not None:
            epoch, expires, mac = self._cap
            op = self._op.name.lower()
            assert self.peer is not None  # requests are parsed only after the handshake
            want = capability(secret, op, self.server.node, self.peer, slots, epoch, expires)
            if not hmac.compare_digest(want, mac):
                return self._refuse(f"{op} capability is not valid for memory node {self.server.node} on a "
                                    f"connection authenticated as {self.peer!r} (forged, issued to another node, "
                                    "or for other slots or epoch)")
            if time.time() > expires:
                return self._refuse(f"{op} capability expired {time.time() - expires:.0f}s ago")
            allowed = set(slots)
            outside = [slot for slot, _ in self._blocks if slot not in allowed]
            if outside:
                return self._refuse(f"slot {outside[0]} is not covered by the {op} capability")
            stale = self.server.terms.refusal(epoch)
            if stale is not None:
                return self._refuse(stale)
            self.server.terms.observe(epoch)
            if self._op is Op.WRITE:
                written = [slot for slot, _ in self._blocks]
                reason = self.server.writes.refusal(written, epoch, mac)
                if reason is not None:
                    return self._refuse(reason)
                self.server.writes.record(written, epoch, expires, mac)
                self.writing_term = term_of(epoch)
        return self._dispatch()

    def _dispatch(self) -> None:
        if self._op is Op.READ:
            return self._respond_read()
        self._next = 0
        return self._next_payload()

    def _next_payload(self) -> None:
        while self._next < len(self._blocks) and self._blocks[self._next][1] == 0:
            self._next += 1
        if self._next == len(self._blocks):
            self.server.bytes_written += self._payload
            return self._respond_ok()
        slot, length = self._blocks[self._next]
        self._expect(self.arena.slot(slot, length), "payload")

    # --- respond -------------------------------------------------------------------------

    def _respond_ok(self) -> None:
        assert self.transport is not None
        self.writing_term = None
        self.server.requests += 1
        self.transport.write(RESPONSE.pack(Status.OK, 0, 0, self._req_id, 0))
        self._expect(memoryview(self._header), "header")

    def _respond_read(self) -> None:
        assert self.transport is not None
        self.server.requests += 1
        total = sum(length for _, length in self._blocks)
        self.server.bytes_read += total
        head = RESPONSE.pack(Status.OK, 0, 0, self._req_id, total)
        views = [self.arena.slot(slot, length) for slot, length in self._blocks]
        if total <= 64 << 10:  # small answers: one send
            self.transport.write(b"".join([head, *views]))
        else:  # one vectored send (uvloop) straight from the arena
            self.transport.writelines([head, *views])
        self._expect(memoryview(self._header), "header")

    def _refuse(self, reason: str) -> None:
        assert self.transport is not None
        log.warning("tcp block server: refusing request %d from %s: %s", self._req_id,
                    self.transport.get_extra_info("peername"), reason)
        body = reason.encode()[:4096]
        self.transport.write(RESPONSE.pack(Status.ERROR, 0, 0, self._req_id, len(body)) + body)
        self._closing = True
        self.transport.close()  # flushes the answer, then closes


class BlockServer:
    """``start(host, port)`` / ``close()``; ``port`` is the bound port (0 picks a free one).

    ``limits``: the ``[transport]`` section, read for the connection caps and the handshake deadline.
    """

    def __init__(self, arena: Arena, boot_id: str, secret: bytes | None = None, node: str = "",
                 ssl_context: ssl.SSLContext | None = None, limits: TransportConfig | None = None) -> None:
        self.arena = arena
        self.ssl = ssl_context  # TLS on the data port (the cluster's certificate), or None: plaintext
        self.boot_id = boot_id
        self.secret = secret  # None: no capabilities required (a cluster without a secret)
        self.node = node  # the name capabilities are bound to
        self.limits = limits or TransportConfig()
        self.writes = WriteLedger()  # makes write grants single-use (with a secret)
        self.terms = TermFence()  # refuses capabilities of a deposed leader's term (with a secret)
        self.connections: ConnectionTable[_Connection] = ConnectionTable()
        self.requests = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.refused = 0  # connections closed at accept: the port held max_connections
        self.refused_peer = 0  # ... their peer held max_connections_per_peer
        self.late_handshakes = 0  # connections closed: no handshake within handshake_timeout_s
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._attaching: set[asyncio.Task[None]] = set()
        self._warned: set[str] = set()  # what was logged in the current episode ("full", "accept", peers)
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._listener = bind_listener(host, port, f"memory node {self.node} data")
        self.port = int(self._listener.getsockname()[1])
        self._acceptor = asyncio.create_task(self._accept(self._listener), name=f"data port {self.port}")

    async def close(self) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
            await asyncio.gather(self._acceptor, return_exceptions=True)
            self._acceptor = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for task in list(self._attaching):
            task.cancel()
        await asyncio.gather(*self._attaching, return_exceptions=True)
        for conn in self.connections:
            conn.stop_deadline()
            if conn.transport is not None:
                conn.transport.abort()

    async def _accept(self, listener: socket.socket) -> None:
        """Accept, admit or close at once, hand admitted connections to the loop (TLS in a task of its own)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and the like: other descriptors are in use; keep the port alive
                if "accept" not in self._warned:
                    log.warning("tcp block server on port %d: accept failed, retrying: %s", self.port, exc)
                    self._warned.add("accept")
                await asyncio.sleep(ACCEPT_BACKOFF_S)
                continue
            self._warned.discard("accept")
            peer = peer_of(address)
            if not self._admits(peer):
                sock.close()  # before a byte is read or written, TLS included
                continue
            conn = _Connection(self)
            self.connections.add(conn, peer)
            task = asyncio.create_task(self._attach(conn, sock, peer))
            self._attaching.add(task)
            task.add_done_callback(self._attaching.discard)

    def _admits(self, peer: str) -> bool:
        limits = self.limits
        if len(self.connections) >= limits.max_connections:
            self.refused += 1
            self._warn_once("full", "%d connections open (transport.max_connections): closing new ones at accept",
                            len(self.connections))
            return False
        self._warned.discard("full")
        if self.connections.count(peer) >= limits.max_connections_per_peer:
            self.refused_peer += 1
            self._warn_once(peer, "%s holds %d connections (transport.max_connections_per_peer): closing its new ones "
                            "at accept", peer, self.connections.count(peer))
            return False
        self._warned.discard(peer)
        return True

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._warned:  # once per episode, not once per connection
            self._warned.add(what)
            log.warning("tcp block server on port %d: " + message, self.port, *args)

    async def _attach(self, conn: _Connection, sock: socket.socket, peer: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(
                lambda: conn, sock, ssl=self.ssl,
                ssl_handshake_timeout=self.limits.handshake_timeout_s if self.ssl is not None else None)
        except BaseException as exc:  # a failed or late TLS handshake; cancelled at close
            conn.stop_deadline()
            self.lost(conn)
            with contextlib.suppress(OSError):
                sock.close()
            if not isinstance(exc, OSError):
                raise
            log.debug("tcp block server: TLS handshake with %s failed: %s", peer, exc)

    def lost(self, conn: _Connection) -> None:
        """``conn`` is closed (or never got past TLS): its room is free."""
        peer = self.connections.remove(conn)
        if peer is not None and self.connections.count(peer) < self.limits.max_connections_per_peer:
            self._warned.discard(peer)

    def settled_term(self) -> int:
        """The newest term seen here once no write of an older term is still arriving (else 0).

        From then on nothing an earlier leader granted or leased can touch the arena: every
        new request of an older term is refused at its capability check. Reads are served the
        moment they pass it, so only writes can still be in progress.
        """
        newest = self.terms.newest
        if any(c.writing_term is not None and c.writing_term < newest for c in self.connections):
            return 0
        return newest

    def stats(self) -> dict[str, Any]:
        return {"connections": len(self.connections), "requests": self.requests,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "refused_connections": self.refused, "refused_peer_connections": self.refused_peer,
                "late_handshakes": self.late_handshakes}
