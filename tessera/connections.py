"""The open connections of one listening port, counted per peer, with the idle ones in order.

A *peer* is the remote IP address (:func:`peer_of`): every address is one peer, as nginx's
``limit_conn`` keys on ``$binary_remote_addr``, loopback included (127.0.0.1 and 127.0.0.2
are two peers). Among the connections, the *idle* ones are kept in order of their last
activity, least recent first, so that a listener short of room knows which to close.

This module decides nothing: the HTTP listener (:mod:`tessera.listener`) and the tcp data
port (:mod:`tessera.transport.tcp_server`) apply their own limits with it. It knows nothing
about sockets beyond the shape of a peer address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

C = TypeVar("C", bound=Hashable)


def peer_of(address: object) -> str:
    """The peer of a socket's remote ``address`` (``getpeername()``): its IP, IPv4-mapped IPv6 as IPv4."""
    host = address[0] if isinstance(address, tuple) and address else address
    text = str(host)
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:  # not an IP (a unix socket's path): the address itself
        return text
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


class ConnectionTable(Generic[C]):
    """``add`` / ``remove`` connections by peer; ``idle`` / ``busy`` / ``touch``; ``least_active_idle``."""

    def __init__(self) -> None:
        self._peer: dict[C, str] = {}
        self._count: dict[str, int] = {}
        # dicts as ordered sets: insertion order is the order of last activity, least recent first
        self._idle: dict[C, None] = {}
        self._idle_of: dict[str, dict[C, None]] = {}

    def __len__(self) -> int:
        return len(self._peer)

    def __contains__(self, conn: object) -> bool:
        return conn in self._peer

    def __iter__(self) -> Iterator[C]:
        return iter(list(self._peer))  # a copy: callers close connections while iterating

    def count(self, peer: str) -> int:
        """Connections of ``peer`` in the table."""
        return self._count.get(peer, 0)

    def add(self, conn: C, peer: str) -> None:
        """A new connection of ``peer``, busy until :meth:`idle` says otherwise."""
        assert conn not in self._peer, conn
        self._peer[conn] = peer
        self._count[peer] = self._count.get(peer, 0) + 1

    def remove(self, conn: C) -> str | None:
        """Forget ``conn``; its peer, or None when it was not (or no longer) in the table."""
        if conn not in self._peer:
            return None
        self.busy(conn)
        peer = self._peer.pop(conn)
        left = self._count[peer] - 1
        if left:
            self._count[peer] = left
        else:
            del self._count[peer]
        return peer

    def idle(self, conn: C) -> None:
        """``conn`` holds no request now; it becomes the most recently active idle connection."""
        peer = self._peer.get(conn)
        if peer is None:
            return
        self.busy(conn)
        self._idle[conn] = None
        self._idle_of.setdefault(peer, {})[conn] = None

    def busy(self, conn: C) -> None:
        """``conn`` holds a request: it is not a candidate for closing."""
        if conn not in self._idle:
            return
        del self._idle[conn]
        peer = self._peer[conn]
        of = self._idle_of[peer]
        del of[conn]
        if not of:
            del self._idle_of[peer]

    def touch(self, conn: C) -> None:
        """Activity on ``conn`` (bytes arrived): an idle one moves to the most recent end."""
        if conn in self._idle:
            self.idle(conn)

    def least_active_idle(self, peer: str | None = None) -> C | None:
        """The idle connection (of ``peer``, or of any peer) whose last activity is oldest, or None."""
        pool = self._idle if peer is None else self._idle_of.get(peer, {})
        return next(iter(pool), None)
