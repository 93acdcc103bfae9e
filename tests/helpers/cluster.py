"""Cluster configs on free loopback ports, config files, and calls made as a process of a cluster."""

from __future__ import annotations

import dataclasses
import os
import socket
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig
from tessera.config_file import dump_toml, load_config
from tessera.launcher import LocalCluster, role_env

REPO = Path(__file__).resolve().parents[2]

# the ``start_cluster`` fixtures: (config, log_dir) -> a healthy cluster, stopped at teardown
StartCluster = Callable[[ClusterConfig, Path], LocalCluster]

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


def with_secret_file(config: ClusterConfig, secret_file: Path) -> ClusterConfig:
    """``config`` with the given cluster secret (the ``cluster_secret`` fixture) and a free internal port."""
    return dataclasses.replace(
        config, security=dataclasses.replace(config.security, secret_file=str(secret_file)),
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
