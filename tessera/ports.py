"""Listening ports: who holds one, binding before any slow start-up, free ports for benches.

A role binds its listeners first and loads its model afterwards, so a port that another
process holds fails the role within a second, naming the port and (when it can be found) the
process holding it. The launcher uses :func:`holds_port` to tell its own child's ``/health``
from another cluster's answering on the same port.

This module knows nothing about roles; it reads ``/proc`` (Linux) or psutil when installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from pathlib import Path

from tessera.config import ClusterConfig
from tessera.errors import TesseraError

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


class PortInUse(TesseraError):
    """A listener's port is held by another process; the message names the port and the holder."""


def _listen_inodes(port: int, net: str = "/proc/net") -> set[str] | None:
    """Socket inodes listening on ``port`` (any address) in the network namespace whose tables
    are under ``net``, or None where they are unreadable."""
    found: set[str] = set()
    readable = False
    for table in (f"{net}/tcp", f"{net}/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            cols = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if len(cols) > 9 and cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                found.add(cols[9])
    return found if readable else None


def _pid_sockets(pid: int) -> set[str]:
    """Inodes of the sockets ``pid`` has open (empty when its fds cannot be read)."""
    out: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = str(fd.readlink())
                if link.startswith("socket:["):
                    out.add(link[8:-1])
    return out


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def holder(port: int) -> str:
    """``"pid 123 (python3)"`` of the process listening on ``port``, or ``""`` when unknown."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    except Exception:
        pass
    inodes = _listen_inodes(port) or set()
    if inodes:
        with contextlib.suppress(OSError):
            for proc in Path("/proc").iterdir():
                if proc.name.isdigit() and _pid_sockets(int(proc.name)) & inodes:
                    name = _name(int(proc.name))
                    return f"pid {proc.name}" + (f" ({name})" if name else "")
    return ""


def holds_port(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the listening socket of ``port``; None when /proc cannot tell."""
    # the tables of pid's own network namespace: a role may run in another one (tessera_lab/hosts)
    inodes = _listen_inodes(port, f"/proc/{pid}/net")
    if inodes is None:
        return None
    return bool(inodes & _pid_sockets(pid))


def in_use_message(host: str, port: int, what: str = "") -> str:
    who = holder(port)
    return (f"port {port} on {host}{f' ({what})' if what else ''} is in use" + (f" by {who}" if who else "")
            + "; stop that process or choose another port")


def bind_listener(host: str, port: int, what: str = "") -> socket.socket:
    """A listening socket on ``host:port`` (SO_REUSEADDR, like aiohttp's); PortInUse if it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == 98 or "in use" in str(exc):  # EADDRINUSE
            raise PortInUse(in_use_message(host, port, what)) from None
        raise
    sock.setblocking(False)
    return sock


def listeners(config: ClusterConfig) -> list[tuple[str, int, str]]:
    """Every (host, port, what) a cluster of ``config`` listens on."""
    r = config.retrieval
    out = [(r.host, r.port, "retrieval"), (r.internal_host, r.internal_port, "retrieval internal")]
    for i in range(1, config.ha.replicas):  # replica i: the same ports + i x stride (tessera.ha.replicas)
        step = i * config.ha.replica_port_stride
        out += [(r.host, r.port + step, f"retrieval replica r{i}"),
                (r.internal_host, r.internal_port + step, f"retrieval replica r{i} internal")]
    for kv in config.kvpools:
        out += [(kv.host, kv.port, f"kvpool {kv.name}"), (kv.host, kv.data_port, f"kvpool {kv.name} data")]
    out += [(g.host, g.port, f"generation {g.name}") for g in config.generation]
    return out


def check_free(config: ClusterConfig) -> None:
    """PortInUse naming the first listener of ``config`` whose port another process holds."""
    for host, port, what in listeners(config):
        if port:
            bind_listener(host, port, what).close()


def on_free_ports(config: ClusterConfig) -> ClusterConfig:
    """``config`` with every listener on a free port of its host, so that a bench or the demo
    runs beside a cluster already serving on the configured ports."""
    held: list[socket.socket] = []
    try:
        def free(host: str) -> int:
            sock = bind_listener(host, 0)
            held.append(sock)  # kept open until every port is picked: no port is handed out twice
            return int(sock.getsockname()[1])

        r = config.retrieval
        return dataclasses.replace(
            config,
            retrieval=dataclasses.replace(r, port=free(r.host), internal_port=free(r.internal_host)),
            kvpools=tuple(dataclasses.replace(kv, port=free(kv.host), data_port=free(kv.host))
                          for kv in config.kvpools),
            generation=tuple(dataclasses.replace(g, port=free(g.host)) for g in config.generation))
    finally:
        for sock in held:
            sock.close()
