"""Shared test helpers: free ports, the one config builder, the one fake clock, real role processes."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import socket
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tessera.auth import ClusterAuth, create_secret
from tessera.config import ClusterConfig
from tessera.config_file import dump_toml, load_config
from tessera.launcher import role_env, spawn_role, wait_healthy

REPO = Path(__file__).resolve().parents[1]


_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A free loopback port never handed out before in this process.

    The kernel may hand the same just-closed port to two calls; one config then names it twice
    and is refused ("port already used"), which made the hypothesis plane machine flaky.
    """
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


@functools.cache
def shared_secret_file() -> Path:
    """One cluster secret (0600) for every test cluster of this pytest process."""
    path = Path(tempfile.mkdtemp(prefix="tessera-test-")) / "cluster.secret"
    create_secret(path)
    return path


def with_secret(config: ClusterConfig) -> ClusterConfig:
    """``config`` with the tests' cluster secret and a free internal port."""
    return dataclasses.replace(
        config, security=dataclasses.replace(config.security, secret_file=str(shared_secret_file())),
        retrieval=dataclasses.replace(config.retrieval, internal_port=free_port()))


def signed_get(config: ClusterConfig, url: str, timeout: float = 10.0) -> bytes:
    """GET an internal URL as a process of the cluster (signed with its secret)."""
    req = urllib.request.Request(url, headers=ClusterAuth.from_config(config).headers("GET", url))
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return bytes(resp.read())


def write_config(directory: Path, config: ClusterConfig, name: str = "tessera.toml") -> Path:
    path = directory / name
    path.write_text(dump_toml(config))
    return path


def child_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: a role's environment that imports this checkout."""
    return role_env(PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


class RoleProcess:
    """One ``tessera run --role ...`` process (the launcher's own runner) with its output in a log file."""

    def __init__(self, role: str, config_path: Path, node: str | None = None, log_dir: Path | None = None) -> None:
        self.role = role
        self.node = node
        self.log_path = (log_dir or config_path.parent) / f"{role}-{node or 'main'}.log"
        self.child = spawn_role(role, node, config_path, self.log_path, url="", env=child_env())
        self.proc = self.child.proc

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, url: str, timeout: float = 60.0) -> None:
        self.child.url = url
        wait_healthy([self.child], timeout)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait for a clean drain; SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.child.log_file.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.child.log_file.close()


@contextlib.contextmanager
def running(role: str, config_path: Path, url: str, node: str | None = None,
            timeout: float = 60.0) -> Iterator[RoleProcess]:
    proc = RoleProcess(role, config_path, node)
    try:
        proc.wait_healthy(url, timeout)
        yield proc
    finally:
        proc.stop()


class Clock:
    """The one fake clock of the tests: time moves only when a test advances it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def cluster_config(model_source: str | None = None, *, nodes: int = 2, local_blocks: int = 1024, kvpools: int = 1,
                   kv_blocks: int = 1024, block_tokens: int | None = None, transport: str = "shm",
                   max_inflight: int = 64, threads: int = 1, **control: Any) -> ClusterConfig:
    """The embedded default cluster on free loopback ports, with a chosen model and a few knobs.

    The one config builder of the tests: in-process control planes and real clusters alike.
    """
    base = load_config()
    gen_proto, pool_proto = base.generation[0], base.kvpools[0]
    return dataclasses.replace(
        base,
        block_tokens=block_tokens or base.block_tokens,
        model=dataclasses.replace(base.model, source=model_source or base.model.source, threads=threads),
        control=dataclasses.replace(base.control, **control),
        transport=dataclasses.replace(base.transport, name=transport, timeout_s=2.0),
        retrieval=dataclasses.replace(base.retrieval, port=free_port(), internal_port=free_port()),
        kvpools=tuple(dataclasses.replace(pool_proto, name=f"kv{i}", port=free_port(), data_port=free_port(),
                                          capacity_blocks=kv_blocks)
                      for i in range(kvpools)),
        generation=tuple(
            dataclasses.replace(gen_proto, name=f"gen{i}", port=free_port(), local_capacity_blocks=local_blocks,
                                max_inflight=max_inflight)
            for i in range(nodes)),
    )
