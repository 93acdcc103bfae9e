"""One HTTP listener with limits (``[listener]``): open connections, per peer, idle, the request head's deadline.

aiohttp closes a connection that waits longer than ``keepalive_timeout`` for a complete
request head (from its start, or from the end of its previous response), and bounds what a
head may hold (8190 B per line and field, ``max_headers`` fields). It does not bound how
many connections a listener holds, so :class:`ListenerSite` counts them, per listener and
per peer (remote address, :mod:`tessera.connections`), and decides as each is accepted,
before a byte is read:

* a peer at ``max_connections_per_peer`` gets in by closing its own least recently active
  *idle* connection (one without a request in flight); a peer whose every connection has a
  request in flight is refused. One address cannot take the listener, and a client that
  shares its address with an attacker (every local process is 127.0.0.1) gets in for as long
  as the attacker's connections are idle;
* from :data:`REAP_SHARE` of ``max_connections`` on, each new connection closes the least
  recently active idle connection of any peer, and past ``max_connections`` with none idle
  the new one is closed. Idle kept-alive connections (a client's pool, or an attacker's)
  cannot fill the listener: only requests in flight can.

A request is in flight from its complete head until its response is written. Nothing else is
protected: a connection between requests, or one still sending a head (real clients send a
head in one piece), may be closed to make room, as at any keep-alive timeout. A pipelined
head queued behind the answered one goes with it, which RFC 9112 (9.3.2) has clients retry;
aiohttp clients retry idempotent requests on a closed kept-alive connection. The health
checks (:data:`CLOSE_AFTER`) are answered with ``Connection: close`` whatever the load:
checkers open a connection per probe anyway, and a kept-alive one would hold a slot idle
for the whole interval between probes, for nothing but a handshake saved every few
seconds; unconditional, so a prober sees the same behaviour under attack as without.

A new connection also gets ``header_timeout_s`` for its first complete head; later heads on
a kept-alive connection are bounded by ``idle_timeout_s`` (aiohttp's keep-alive timer runs
until the head is complete). With TLS the handshake has ``header_timeout_s`` too, and the
connection is counted from its end. A request refused before its body was read (401, 408,
413) closes its connection after at most :data:`LINGER_S` of reading and dropping what is
left of the body (aiohttp's longer default would let a client that announced a body and
never sent it hold a connection slot per refusal).

This module knows nothing about routes, authentication or any role, beyond the health
checks' paths.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import ssl
from typing import Any

from aiohttp import web
from yarl import URL

from tessera.config import ListenerConfig
from tessera.connections import ConnectionTable, peer_of

log = logging.getLogger(__name__)
LINGER_S = 1.0  # reading a refused request's unsent body, so its sender gets the answer rather than a reset
# from this share of max_connections on, a new connection closes the least active idle one: short of
# the cap, so the descriptors of connections still being closed stay within it
REAP_SHARE = 0.9
CLOSE_AFTER = frozenset({"/health", "/health/live", "/health/ready"})  # answered with Connection: close


class ListenerSite(web.BaseSite):
    """A TCP site of an :class:`aiohttp.web.AppRunner` whose connections obey ``limits``."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: ListenerConfig, *,
                 sock: socket.socket | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self.host, self.port, self.limits = host, port, limits
        self._sock = sock  # already bound (a busy port fails at once, before any start-up ran)
        self.connections: ConnectionTable[_Connection] = ConnectionTable()
        self.refused = 0  # connections closed at accept: the listener was full of requests in flight
        self.refused_peer = 0  # ... their peer's were
        self.reaped = 0  # idle connections closed to make room for a new one
        self.late_heads = 0  # connections closed: no complete first head within header_timeout_s
        self._reap_at = math.ceil(REAP_SHARE * limits.max_connections)
        self._full = False
        self._reaping = False
        self._crowded: set[str] = set()  # peers refused since they last dropped below their cap

    @property
    def name(self) -> str:
        return str(URL.build(scheme="https" if self._ssl_context else "http", host=self.host, port=self.port))

    @property
    def open(self) -> int:
        """Admitted connections not yet closed."""
        return len(self.connections)

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None, "runner.setup() before start()"
        inner = server.request_factory

        def noting_heads(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
            if isinstance(protocol, _Connection):
                protocol.request_started()
                if message.url.path in CLOSE_AFTER and not message.should_close:
                    message = message._replace(should_close=True)  # aiohttp answers Connection: close, then closes
            return inner(message, payload, protocol, writer, task)

        server.request_factory = noting_heads  # read by each connection as it is created
        loop = asyncio.get_running_loop()
        handshake_s = self.limits.header_timeout_s if self._ssl_context else None
        if self._sock is not None:
            self._server = await loop.create_server(
                lambda: _Connection(self, server, loop), sock=self._sock, ssl=self._ssl_context,
                backlog=self._backlog, ssl_handshake_timeout=handshake_s)
        else:
            self._server = await loop.create_server(
                lambda: _Connection(self, server, loop), self.host, self.port, ssl=self._ssl_context,
                backlog=self._backlog, reuse_address=True, ssl_handshake_timeout=handshake_s)
        if self.port == 0:
            self.port = int(self._server.sockets[0].getsockname()[1])

    # --- called by the connections -------------------------------------------------------

    def admit(self, conn: _Connection, peer: str) -> bool:
        """Make room for ``conn`` of ``peer`` by closing idle connections, or refuse it."""
        table = self.connections
        victim: _Connection | None = None
        if table.count(peer) >= self.limits.max_connections_per_peer:
            victim = table.least_active_idle(peer)
            if victim is None:
                self.refused_peer += 1
                if peer not in self._crowded:  # once per episode and peer, not once per connection
                    log.warning("%s: %s has %d connections with requests in flight (listener.max_connections_per_"
                                "peer): closing its new ones until some end", self.name, peer, table.count(peer))
                    self._crowded.add(peer)
                return False
            self._reap(victim)  # the new connection takes its place: the listener holds no more than before
        elif len(table) >= self._reap_at and (victim := table.least_active_idle()) is not None:
            if not self._reaping:
                log.info("%s: %d of %d connections open: closing idle ones, least recently active first, to make "
                         "room for new ones", self.name, len(table), self.limits.max_connections)
                self._reaping = True
            self._reap(victim)
        if len(table) >= self.limits.max_connections:
            self.refused += 1
            if not self._full:
                log.warning("%s: %d connections with requests in flight (listener.max_connections): closing new "
                            "ones until some end", self.name, len(table))
                self._full = True
            return False
        table.add(conn, peer)
        table.idle(conn)  # no request yet: the header deadline bounds it, and it may make room for another
        return True

    def _reap(self, victim: _Connection) -> None:
        self.reaped += 1
        self.release(victim)  # at once: the room is the new connection's now, whenever the old one is lost
        victim.force_close()

    def release(self, conn: _Connection) -> None:
        peer = self.connections.remove(conn)
        if peer is None:
            return  # reaped earlier
        open_ = len(self.connections)
        self._full = self._full and open_ >= self.limits.max_connections
        self._reaping = self._reaping and open_ >= self._reap_at
        if peer in self._crowded and self.connections.count(peer) < self.limits.max_connections_per_peer:
            self._crowded.discard(peer)


class _Connection(web.RequestHandler):
    """aiohttp's connection handler, counted by its site, idle between requests, with a deadline for its first head."""

    def __init__(self, site: ListenerSite, server: web.Server, loop: asyncio.AbstractEventLoop) -> None:
        limits = site.limits
        super().__init__(server, loop=loop, keepalive_timeout=limits.idle_timeout_s, max_headers=limits.max_headers,
                         lingering_time=LINGER_S, access_log=None)  # type: ignore[arg-type]  # None: no access log (aiohttp checks truthiness)
        self._site = site
        self._timers = loop
        self._admitted = False
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._site.admit(self, peer_of(transport.get_extra_info("peername"))):
            transport.close()  # before reading anything; aiohttp never sees this connection
            return
        self._admitted = True
        super().connection_made(transport)
        self._head_deadline = self._timers.call_later(self._site.limits.header_timeout_s, self._head_late)

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            self._site.connections.touch(self)
            super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._site.release(self)
        self._first_head_in()
        super().connection_lost(exc)

    def request_started(self) -> None:
        """A complete head, about to be handled: in flight until its response is written."""
        self._first_head_in()
        self._site.connections.busy(self)

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:  # answered (or its client is gone): nothing of it is lost if the connection is closed now
            self._site.connections.idle(self)

    def _first_head_in(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = None
        self._site.late_heads += 1
        self.force_close()
