"""One HTTP listener with limits (``[listener]``): open connections, the request head's deadline, idle.

aiohttp closes a connection that waits longer than ``keepalive_timeout`` for a complete
request head (from its start, or from the end of its previous response), and bounds what a
head may hold (8190 B per line and field, ``max_headers`` fields). It does not bound how
many connections a listener holds, so :class:`ListenerSite` counts them: past
``max_connections`` a new connection is closed as soon as it is accepted, before a byte is
read, and the open ones carry on. A new connection also gets ``header_timeout_s`` for its
first complete head; later heads on a kept-alive connection are bounded by
``idle_timeout_s`` (aiohttp's keep-alive timer runs until the head is complete). With TLS
the handshake has ``header_timeout_s`` too. A request refused before its body was read
(401, 408, 413) closes its connection after at most :data:`LINGER_S` of reading and dropping
what is left of the body (aiohttp's longer default would let a client that announced a body
and never sent it hold a connection slot per refusal).

This module knows nothing about routes, authentication or any role.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Any

from aiohttp import web
from yarl import URL

from tessera.config import ListenerConfig

log = logging.getLogger(__name__)
LINGER_S = 1.0  # reading a refused request's unsent body, so its sender gets the answer rather than a reset


class ListenerSite(web.BaseSite):
    """A TCP site of an :class:`aiohttp.web.AppRunner` whose connections obey ``limits``."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: ListenerConfig, *,
                 sock: socket.socket | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self.host, self.port, self.limits = host, port, limits
        self._sock = sock  # already bound (a busy port fails at once, before any start-up ran)
        self.open = 0  # admitted connections not yet lost
        self.refused = 0  # connections closed at accept: the listener was full
        self.late_heads = 0  # connections closed: no complete first head within header_timeout_s
        self._full = False

    @property
    def name(self) -> str:
        return str(URL.build(scheme="https" if self._ssl_context else "http", host=self.host, port=self.port))

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None, "runner.setup() before start()"
        inner = server.request_factory

        def noting_heads(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
            if isinstance(protocol, _Connection):
                protocol.head_complete()
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

    def admit(self) -> bool:
        if self.open >= self.limits.max_connections:
            self.refused += 1
            if not self._full:  # once per episode, not once per connection
                log.warning("%s: %d connections open (listener.max_connections): closing new ones until "
                            "some end", self.name, self.open)
                self._full = True
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1
        if self.open < self.limits.max_connections:
            self._full = False


class _Connection(web.RequestHandler):
    """aiohttp's connection handler, counted by its site and given a deadline for its first head."""

    def __init__(self, site: ListenerSite, server: web.Server, loop: asyncio.AbstractEventLoop) -> None:
        limits = site.limits
        super().__init__(server, loop=loop, keepalive_timeout=limits.idle_timeout_s, max_headers=limits.max_headers,
                         lingering_time=LINGER_S, access_log=None)  # type: ignore[arg-type]  # None: no access log (aiohttp checks truthiness)
        self._site = site
        self._timers = loop
        self._admitted = False
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._site.admit():
            transport.close()  # before reading anything; aiohttp never sees this connection
            return
        self._admitted = True
        super().connection_made(transport)
        self._head_deadline = self._timers.call_later(self._site.limits.header_timeout_s, self._head_late)

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._site.release()
        self.head_complete()
        super().connection_lost(exc)

    def head_complete(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = None
        self._site.late_heads += 1
        self.force_close()
