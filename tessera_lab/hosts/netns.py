"""A virtual network of hosts on one machine: network namespaces, veth pairs and one bridge.

Every host is a network namespace ``tsr<pid>-<host>`` with one interface ``eth0`` on a
private /24 and a loopback; the bridge lives in a namespace of its own (``tsr<pid>-sw``), so
nothing is added to the machine's own namespace and nothing is routed out of the virtual
network (no default route anywhere). Deleting the namespaces deletes every interface.

Faults are routing and filter rules inside the hosts' namespaces:

* :meth:`Network.block` drops, silently, what ``src`` sends to ``dst`` (optionally to one
  TCP port only): a policy-routing rule sends it into ``void0``, a veth with ARP off whose
  peer ignores it. Connections time out as on a cut cable; no error comes back. A block of
  one direction only is a one-way partition, a block of one port an unreachable endpoint.
* :meth:`Network.unplug` takes a host's cable out of the bridge (every link of it at once).
* :meth:`Network.redirect` sends new TCP connections from ``src`` to ``dst:port`` to a local
  port (an application-level proxy: :mod:`tessera_lab.hosts.proxy`); it needs nftables.
* :meth:`Network.heal` undoes all of it.

A crashed harness leaves namespaces behind: :func:`remove_leftovers` deletes those whose
harness process is gone (every :class:`Network` calls it before it creates its own).

This module knows nothing about Tessera's roles; :mod:`tessera_lab.hosts.cluster` maps roles to
hosts.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

NETNS_DIR = Path("/run/netns")
PREFIX = "tsr"
SUBNET = ipaddress.ip_network("10.213.0.0/24")  # only ever inside our own namespaces
CLONE_NEWNET = 0x40000000
VOID_TABLE = 100  # routing table whose only route leads into void0
PROXY_MARK = 0x7A  # sockets of a proxy carry this mark: redirects skip them
_LEFTOVER = re.compile(rf"^{PREFIX}(\d+)-")
T = TypeVar("T")


class NetworkError(RuntimeError):
    pass


def unavailable() -> str | None:
    """Why this process cannot build a virtual network, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and a bridge)"
    if shutil.which("ip") is None:
        return "needs iproute2 (the ip command)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except NetworkError as exc:
        return f"cannot create namespaces, bridges and veth pairs here: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def has_nftables() -> bool:
    """The kernel's packet filter is usable (nft installed): delays and redirects work."""
    return shutil.which("nft") is not None


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str], input_text: str | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, input=input_text, check=False)
    if done.returncode != 0:
        raise NetworkError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete the namespaces of harnesses that are gone (and kill what still runs in them)."""
    removed = []
    names = sorted(p.name for p in NETNS_DIR.iterdir()) if NETNS_DIR.is_dir() else []
    for name in names:
        m = _LEFTOVER.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        delete_namespace(name)
        removed.append(name)
    return removed


def delete_namespace(name: str) -> None:
    """Kill every process in namespace ``name``, then delete it (its interfaces go with it)."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=False).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def enter(namespace: str) -> None:
    """Move the calling *thread* into ``namespace`` (sockets it creates from now on live there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise NetworkError(f"setns({namespace}): {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def call_in(namespace: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` in a new thread inside ``namespace``; its result or its exception.

    Children the function starts are forked from that thread, so they start inside the
    namespace too (and a death signal tied to the thread fires when ``fn`` returns).
    """
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            enter(namespace)
            result.append(fn())
        except BaseException as exc:  # handed to the caller below
            error.append(exc)

    thread = threading.Thread(target=body, name=f"netns-{namespace}")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    port: str  # its cable's name on the bridge


@dataclass
class Network:
    """Hosts on one bridge. Create with :meth:`create`; :meth:`destroy` removes everything."""

    tag: str
    hosts: dict[str, Host] = field(default_factory=dict)
    _rules: list[tuple[str, int]] = field(default_factory=list)  # (namespace, rule priority)
    _redirects: set[str] = field(default_factory=set)  # namespaces with an nft table of ours
    _unplugged: set[str] = field(default_factory=set)
    _next_priority: int = 1000

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    @classmethod
    def create(cls, names: list[str]) -> Network:
        """One host per name, addresses .1, .2, ... of :data:`SUBNET` in that order."""
        remove_leftovers()
        net = cls(f"{PREFIX}{os.getpid()}")
        assert len(names) < SUBNET.num_addresses - 2, names
        try:
            _ip("netns", "add", net.switch)
            _ip("-n", net.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", net.switch, "link", "set", "dev", "br0", "up")
            for i, name in enumerate(names):
                net._add_host(name, str(SUBNET.network_address + i + 1), f"p{i}")
        except BaseException:
            net.destroy()
            raise
        return net

    def _add_host(self, name: str, address: str, port: str) -> None:
        ns = f"{self.tag}-{name}"  # == namespace_name(name)
        _ip("netns", "add", ns)
        self.hosts[name] = Host(name, ns, address, port)
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.switch, "link", "set", "dev", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", "dev", port, "up")
        _ip("-n", ns, "link", "set", "dev", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "dev", "eth0", "up")
        # the void: a veth with ARP off; what is routed into it is dropped without an error
        _ip("-n", ns, "link", "add", "void0", "type", "veth", "peer", "name", "void1")
        for dev in ("void0", "void1"):
            _ip("-n", ns, "link", "set", "dev", dev, "arp", "off", "up")
        _ip("-n", ns, "route", "add", "default", "dev", "void0", "table", str(VOID_TABLE))

    def destroy(self) -> None:
        for host in self.hosts.values():
            delete_namespace(host.namespace)
        delete_namespace(self.switch)
        self.hosts.clear()
        self._rules.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def address(self, host: str) -> str:
        return self.hosts[host].address

    def namespace(self, host: str) -> str:
        return self.hosts[host].namespace

    # --- faults --------------------------------------------------------------------------

    def block(self, src: str, dst: str, port: int | None = None) -> None:
        """Drop what ``src`` sends to ``dst`` (to TCP ``port`` only, if given); ``dst`` still reaches ``src``."""
        ns = self.namespace(src)
        prio = self._next_priority
        self._next_priority += 1
        match = ["to", self.address(dst)]
        if port is not None:
            match += ["ipproto", "tcp", "dport", str(port)]
        _ip("-n", ns, "rule", "add", *match, "lookup", str(VOID_TABLE), "priority", str(prio))
        self._rules.append((ns, prio))

    def cut(self, a: str, b: str) -> None:
        """Partition ``a`` from ``b`` both ways (each still reaches every other host)."""
        self.block(a, b)
        self.block(b, a)

    def isolate(self, host: str, from_hosts: list[str]) -> None:
        for other in from_hosts:
            self.cut(host, other)

    def unplug(self, host: str) -> None:
        """Take ``host``'s cable out of the bridge: it reaches nobody and nobody reaches it."""
        _ip("-n", self.switch, "link", "set", "dev", self.hosts[host].port, "down")
        self._unplugged.add(host)

    def redirect(self, src: str, dst: str, port: int, local_port: int) -> None:
        """New TCP connections from ``src`` to ``dst:port`` go to ``127.0.0.1:local_port`` on ``src``.

        Sockets marked :data:`PROXY_MARK` (the proxy's own) are not redirected.
        """
        ns = self.namespace(src)
        if ns not in self._redirects:
            _run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input_text=(
                "table ip tessera {\n"
                "  chain out { type nat hook output priority -100; policy accept; }\n"
                "}\n"))
            self._redirects.add(ns)
        _run(["ip", "netns", "exec", ns, "nft", "add", "rule", "ip", "tessera", "out", "ip", "daddr",
              self.address(dst), "tcp", "dport", str(port), "meta", "mark", "!=", hex(PROXY_MARK),
              "redirect", "to", f":{local_port}"])

    def drop_connections(self, src: str, dst: str, port: int) -> None:
        """Reset ``src``'s open TCP connections to ``dst:port`` (so new ones take a redirect)."""
        subprocess.run(["ip", "netns", "exec", self.namespace(src), "ss", "-K", "dst", self.address(dst),
                        "dport", "=", str(port)], capture_output=True, check=False)

    def heal(self) -> None:
        """Every block, unplugged cable and redirect undone."""
        for ns, prio in self._rules:
            subprocess.run(["ip", "-n", ns, "rule", "del", "priority", str(prio)], capture_output=True, check=False)
        self._rules.clear()
        for ns in self._redirects:
            subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "ip", "tessera"],
                           capture_output=True, check=False)
        self._redirects.clear()
        for host in self._unplugged:
            _ip("-n", self.switch, "link", "set", "dev", self.hosts[host].port, "up")
        self._unplugged.clear()

    @contextlib.contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """The calling thread inside ``host`` for the block, then back where it was."""
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            enter(self.namespace(host))
            yield
        finally:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.setns(back, CLONE_NEWNET)
            os.close(back)


def namespace_name(host: str, pid: int | None = None) -> str:
    """The namespace :meth:`Network.create` gives ``host`` in process ``pid`` (default: this one)."""
    return f"{PREFIX}{os.getpid() if pid is None else pid}-{host}"
