"""Listener limits from the attacker's side: raw sockets against a real memory node process.

The attacker can reach a listener's port and holds no cluster secret. Each test is one
attack that once worked and must fail now: bodies buffered before the 401, connections held
open without a request, no bound on how many, and idle kept-alive connections filling the
listener. Two peers are two source addresses: every 127.x.y.z is loopback on Linux, so a
test binds its client sockets to 127.0.0.2, 127.0.0.3 ... to be another peer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from helpers.http import serving
from helpers.kvpool import PoolConfig
from helpers.processes import MemoryNodeProcess

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig, ListenerConfig
from tessera.config_file import load_config
from tessera.connections import ConnectionTable, peer_of
from tessera.errors import ConfigError
from tessera.http import MAX_BODY

HANG_GUARD_S = 30.0  # only so that a failing test fails instead of hanging; never a time being measured
CAP = 8  # listener.max_connections of the node under test
PER_PEER = 3  # listener.max_connections_per_peer of the `peered` node
ATTACKER, VICTIM = "127.0.0.2", "127.0.0.3"
BODY = b"0123456789"  # of the signed requests held in flight


@dataclasses.dataclass
class Node:
    config: ClusterConfig
    host: str
    port: int


def started(directory: Path, pool_config: PoolConfig, limits: ListenerConfig) -> Iterator[Node]:
    config = dataclasses.replace(pool_config(directory, capacity=4), listener=limits)
    with MemoryNodeProcess.started(config, directory) as proc:
        yield Node(config, proc.node.host, proc.node.port)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, pool_config: PoolConfig) -> Iterator[Node]:
    """Memory node kv0 (secret on): 1.5 s for a first request head, 2 s idle."""
    yield from started(tmp_path_factory.mktemp("listener"), pool_config,
                       ListenerConfig(header_timeout_s=1.5, idle_timeout_s=2.0))


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory, pool_config: PoolConfig) -> Iterator[Node]:
    """Memory node kv0 whose listener holds at most CAP connections (deadlines far away)."""
    yield from started(tmp_path_factory.mktemp("capped"), pool_config,
                       ListenerConfig(max_connections=CAP, header_timeout_s=120.0, idle_timeout_s=120.0))


@pytest.fixture(scope="module")
def peered(tmp_path_factory: pytest.TempPathFactory, pool_config: PoolConfig) -> Iterator[Node]:
    """Memory node kv0: at most CAP connections, PER_PEER per address (deadlines far away)."""
    yield from started(tmp_path_factory.mktemp("peered"), pool_config,
                       ListenerConfig(max_connections=CAP, max_connections_per_peer=PER_PEER,
                                      header_timeout_s=120.0, idle_timeout_s=120.0))


def connect(node: Node, source: str = "127.0.0.1") -> socket.socket:
    """A connection from ``source`` (another 127.x.y.z is another peer)."""
    return socket.create_connection((node.host, node.port), timeout=HANG_GUARD_S, source_address=(source, 0))


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the hang guard fails the test)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def read_response_head(sock: socket.socket) -> bytes:
    """The status line and headers (and whatever part of the body came with them)."""
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = sock.recv(65536)
        if not chunk:
            break
        out += chunk
    return out


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One whole response with a Content-Length: (status, body)."""
    out = read_response_head(sock)
    head, _, body = out.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of a response"
        body += chunk
    return status_of(out), body


def get_metrics(sock: socket.socket, host: str) -> int:
    """GET /metrics (open on a loopback node without keys), which leaves the connection kept alive."""
    sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return read_response(sock)[0]


def kept_alive(count: int, node: Node, source: str, stack: ExitStack) -> list[socket.socket]:
    """``count`` connections from ``source``, one after the other, each after one answered request, left idle."""
    socks = []
    for _ in range(count):
        sock = stack.enter_context(connect(node, source))
        assert get_metrics(sock, node.host) == 200
        socks.append(sock)
    return socks


def in_flight(node: Node, stack: ExitStack) -> socket.socket:
    """A connection whose signed request is in flight: its head is in, the node waits for its body.

    ``Expect: 100-continue``: the node's "100 Continue" says its handler has the request.
    Send :data:`BODY` to have it answered.
    """
    sock = stack.enter_context(connect(node))
    signed = ClusterAuth.from_config(node.config).headers("GET", f"http://{node.host}:{node.port}/info", BODY)
    sock.sendall(f"GET /info HTTP/1.1\r\nHost: {node.host}\r\nContent-Length: {len(BODY)}\r\n"
                 f"Expect: 100-continue\r\nX-Tessera-Auth: {signed['X-Tessera-Auth']}\r\n\r\n".encode())
    assert status_of(read_response_head(sock)) == 100
    return sock


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


def test_an_unsigned_request_is_refused_before_its_body_is_sent(node: Node) -> None:
    """Regression: the internal plane read a whole body (up to 64 MiB) before answering 401."""
    with connect(node) as sock:
        sock.sendall(f"POST /info HTTP/1.1\r\nHost: {node.host}\r\nContent-Length: {MAX_BODY}\r\n\r\n".encode())
        head = read_response_head(sock)  # no byte of the body was sent
    assert status_of(head) == 401 and b"Connection: close" in head


def test_a_chunked_or_oversized_body_is_refused_before_it_is_read(node: Node) -> None:
    """Signed or not, a chunked body (411) or one longer than the limit (413) is refused from the head."""
    url = f"http://{node.host}:{node.port}/info"
    auth = ClusterAuth.from_config(node.config)
    for framing, want in (("Transfer-Encoding: chunked", 411), (f"Content-Length: {MAX_BODY + 1}", 413)):
        signed = auth.headers("POST", url, b"x")
        with connect(node) as sock:
            sock.sendall(f"POST /info HTTP/1.1\r\nHost: {node.host}\r\n{framing}\r\n"
                         f"X-Tessera-Auth: {signed['X-Tessera-Auth']}\r\n\r\n".encode())
            assert status_of(read_response_head(sock)) == want, framing


def test_a_connection_that_never_completes_a_request_head_is_closed(node: Node) -> None:
    """Regression: idle and slow-head connections stayed open (1,500 of them for 40 s and more)."""
    with connect(node) as silent, connect(node) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        slow.settimeout(0.2)
        closed = False
        for _ in range(int(HANG_GUARD_S / 0.2)):  # one byte of a header value at a time, slowloris-style
            try:
                slow.sendall(b"a")
                if slow.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed, "a head dribbled one byte at a time kept its connection open"
        assert read_until_closed(silent) == b""  # closed without an answer


def test_an_idle_kept_alive_connection_is_closed(node: Node) -> None:
    """After a complete request, a connection that sends nothing more is closed (listener.idle_timeout_s)."""
    with connect(node) as sock:
        assert get_metrics(sock, node.host) == 200
        assert read_until_closed(sock) == b""  # closed by the node, with no further answer


def test_a_health_check_is_answered_with_connection_close(node: Node) -> None:
    """A health check does not keep its connection: it would hold a slot idle until the next probe."""
    for path in ("/health", "/health/live", "/health/ready"):
        with connect(node) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {node.host}\r\n\r\n".encode())
            answer = read_until_closed(sock)  # closed by the node right after the answer
            assert b"Connection: close" in answer.partition(b"\r\n\r\n")[0], (path, answer[:300])


def test_one_address_polling_health_on_kept_alive_connections_cannot_crowd_out_another(peered: Node) -> None:
    """Regression: one attacker's kept-alive connections, each sending GET /health now and then, held every
    slot of a generation node's listener, and no chat was served. Now none of them keeps its slot."""
    with ExitStack() as stack:
        for _ in range(2 * CAP):
            sock = stack.enter_context(connect(peered, ATTACKER))
            with contextlib.suppress(OSError):  # the attacker does not care how each attempt ends
                sock.sendall(f"GET /health HTTP/1.1\r\nHost: {peered.host}\r\n\r\n".encode())
                read_response_head(sock)
        with connect(peered, VICTIM) as victim:
            assert get_metrics(victim, peered.host) == 200


def test_one_address_holds_at_most_its_cap_and_makes_room_from_its_own_idle_connections(peered: Node) -> None:
    """An address's new connection past max_connections_per_peer closes that address's least recently active
    idle one: it is served, the address never holds more than its cap, and other addresses keep theirs."""
    with ExitStack() as stack:
        victim = kept_alive(1, peered, VICTIM, stack)[0]
        attacker = kept_alive(2 * CAP, peered, ATTACKER, stack)  # every one of them was served
        for sock in attacker[:-PER_PEER]:
            assert read_until_closed(sock) == b""  # closed by the node to make room, unanswered
        for sock in [*attacker[-PER_PEER:], victim]:
            assert get_metrics(sock, peered.host) == 200


def test_a_listener_full_of_idle_kept_alive_connections_still_takes_a_new_client(capped: Node) -> None:
    """Regression: idle kept-alive connections held every slot and a new client was closed unanswered.
    Now near the cap a new connection closes the least recently active idle one, and is served."""
    with ExitStack() as stack:
        held = kept_alive(CAP, capped, "127.0.0.1", stack)
        newcomer = stack.enter_context(connect(capped, VICTIM))
        assert get_metrics(newcomer, capped.host) == 200
        assert read_until_closed(held[0]) == b""  # the least recently active one made room
        for sock in held[1:]:
            assert get_metrics(sock, capped.host) == 200


def test_past_max_connections_with_every_request_in_flight_new_connections_are_closed(capped: Node) -> None:
    """Regression: a listener held every connection it was offered. Once each of its CAP connections has a
    request in flight, a new one is closed at once, unanswered, and no request in flight is cut for it."""
    with ExitStack() as stack:
        busy = [in_flight(capped, stack) for _ in range(CAP)]
        extra = stack.enter_context(connect(capped, VICTIM))
        assert read_until_closed(extra) == b""  # closed at once, unanswered
        for sock in busy:
            sock.sendall(BODY)
            assert read_response(sock)[0] == 200  # every request in flight is served
        with connect(capped, VICTIM) as again:  # answered, they are idle now: room for a new one
            assert get_metrics(again, capped.host) == 200


def test_the_connection_to_close_is_the_least_recently_active_idle_one_and_never_a_busy_one() -> None:
    """The table offers idle connections in order of last activity, overall or of one peer, never a busy one."""
    table: ConnectionTable[str] = ConnectionTable()
    for conn, peer in (("a1", "10.0.0.1"), ("b1", "10.0.0.2"), ("a2", "10.0.0.1")):
        table.add(conn, peer)
        table.idle(conn)
    assert (table.least_active_idle(), table.least_active_idle("10.0.0.1")) == ("a1", "a1")
    table.touch("a1")  # bytes arrived on a1: the least recently active ones are now b1, then a2
    assert (table.least_active_idle(), table.least_active_idle("10.0.0.1")) == ("b1", "a2")
    table.busy("b1")
    table.busy("a2")
    assert (table.least_active_idle(), table.least_active_idle("10.0.0.2")) == ("a1", None)
    assert table.remove("a1") == "10.0.0.1" and table.remove("a1") is None
    assert (len(table), table.count("10.0.0.1"), table.least_active_idle()) == (2, 1, None)
    assert peer_of(("::ffff:127.0.0.2", 80, 0, 0)) == peer_of(("127.0.0.2", 80)) == "127.0.0.2"


def test_listener_limits_are_read_from_the_config_file(tmp_path: Path) -> None:
    """[listener] in tessera.toml sets the limits; a bad value is refused naming the key."""
    path = tmp_path / "t.toml"
    path.write_text('base = "default"\n[listener]\nmax_connections = 3\nheader_timeout_s = 2\n'
                    'max_connections_per_peer = 2\n')
    limits = load_config(path).listener
    assert (limits.max_connections, limits.header_timeout_s, limits.max_connections_per_peer) == (3, 2, 2)
    path.write_text('base = "default"\n[listener]\nmax_connections = 0\n')
    with pytest.raises(ConfigError, match=r"listener\.max_connections = 0"):
        load_config(path)


async def test_an_authenticated_public_body_that_trickles_is_refused_with_408(tmp_path: Path) -> None:
    """Regression: the public API read a body for as long as the client took, so a valid key
    and a head announcing 100 bytes, then nothing, held a handler (and its admission slot) open-ended.
    The public middleware, with the real key ring, now gives the body ``body_timeout_s``; without a key
    the request is refused before any of its body is read."""
    import asyncio
    import hashlib

    from aiohttp import web

    from tessera.http import application
    from tessera.tenants import KeyRing, public_middleware

    keys_path = tmp_path / "keys.toml"
    digest = hashlib.sha256(b"sk-live-1").hexdigest()
    keys_path.write_text(f'[[tenants]]\nname = "acme"\nscopes = ["docs"]\nkeys_sha256 = ["{digest}"]\n')
    keys_path.chmod(0o600)
    app = application([public_middleware(KeyRing.load(str(keys_path)), body_timeout_s=0.5)])
    reached: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        reached.append(await request.read())
        return web.json_response({"ok": True})

    app.router.add_post("/v1/chat/completions", handler)
    async with serving(app) as port:
        async def exchange(head: bytes, body: bytes = b"") -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + body)
            await writer.drain()
            async with asyncio.timeout(HANG_GUARD_S):
                answer = await reader.read()  # until the server closes
            writer.close()
            return answer

        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n")
        slow = await exchange(head + b"Authorization: Bearer sk-live-1\r\n\r\n", b"{")
        assert slow.startswith(b"HTTP/1.1 408"), slow[:200]
        assert b"did not arrive within 0.5s" in slow and b"invalid_request_error" in slow
        anonymous = await exchange(head + b"\r\n")
        assert anonymous.startswith(b"HTTP/1.1 401"), anonymous[:200]
        body = b'{"a": 1}'
        ok = await exchange(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                            b"Authorization: Bearer sk-live-1\r\nContent-Length: %d\r\n\r\n" % len(body), body)
        assert ok.startswith(b"HTTP/1.1 200"), ok[:200]
        assert reached == [body]  # only the complete, authenticated body reached a handler
