"""A replicated cluster for the failover tests and bench/failover.py: real etcd, PostgreSQL and roles.

Two retrieval replicas (``[ha]``, ``retrieval.store = "postgres"``), one memory node, one
generation node, all as child processes of a :class:`~tessera.launcher.LocalCluster`; etcd and
PostgreSQL as children of this process (:mod:`tessera.ha.servers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.cluster import StartCluster, cluster_config, free_port
from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig, HAConfig
from tessera.ha.replicas import replica_config
from tessera.ha.servers import EtcdServer, PostgresServer
from tessera.launcher import Child, LocalCluster

STRIDE = 7  # replica 1 listens on the ports of replica 0 + STRIDE


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def port_pair() -> int:
    """A free port whose + STRIDE is free too (the second replica's)."""
    while True:
        port = free_port()
        if _free(port + STRIDE):
            return port


def replicated_config(model: str, etcd: EtcdServer, pg: PostgresServer, *, lease_ttl_s: int = 2, nodes: int = 1,
                      max_inflight: int = 64, **control: Any) -> ClusterConfig:
    """Two replicas on etcd and PostgreSQL, one memory node, ``nodes`` generation nodes; ``control`` overrides."""
    control = {"heartbeat_timeout_s": 3.0, "write_timeout_s": 4.0, "lease_ttl_s": 4.0, **control}
    cfg = cluster_config(model, nodes=nodes, kvpools=1, max_inflight=max_inflight, **control)
    return dataclasses.replace(
        cfg,
        retrieval=dataclasses.replace(cfg.retrieval, port=port_pair(), internal_port=port_pair(),
                                      store="postgres", postgres_dsn=pg.dsn, max_unit_tokens=256),
        composition=dataclasses.replace(cfg.composition, recompute_tokens=4),
        ha=HAConfig(**etcd.access(), election="/test/leader", lease_ttl_s=lease_ttl_s, renew_margin_s=0.5,
                    replicas=2, replica_port_stride=STRIDE, retry_after_s=1))


def replica_child(cluster: LocalCluster, index: int) -> Child:
    return next(c for c in cluster.children if c.role == "retrieval" and c.node == f"r{index}")


def leads(config: ClusterConfig, index: int) -> bool:
    """Replica ``index``'s internal plane answers (only the leader's does; the others say 503)."""
    url = replica_config(config, index).control_url + "/control/stats"
    req = urllib.request.Request(url, headers=ClusterAuth.from_config(config).headers("GET", url))
    try:
        with urllib.request.urlopen(req, timeout=2.0) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def leader_index(config: ClusterConfig, timeout: float = 60.0) -> int:
    """The replica that leads, once one does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i in range(config.ha.replicas):
            if leads(config, i):
                return i
        time.sleep(0.1)
    raise TimeoutError("no retrieval replica leads")


def start_servers(directory: Path) -> tuple[EtcdServer, PostgresServer]:
    return EtcdServer(directory).start(), PostgresServer().start()


@contextlib.contextmanager
def replicated_cluster(model: str, tmp_path_factory: pytest.TempPathFactory, start: StartCluster,
                       **config: Any) -> Iterator[LocalCluster]:
    """A replicated cluster of ``model`` (``replicated_config`` with ``config``) over an etcd and a
    PostgreSQL of its own, all stopped on exit; skips, saying why, without their server binaries."""
    for missing in (EtcdServer.missing(), PostgresServer.missing()):
        if missing:
            pytest.skip(missing)
    etcd, pg = start_servers(tmp_path_factory.mktemp("etcd"))
    try:
        cluster = start(replicated_config(model, etcd, pg, **config), tmp_path_factory.mktemp("replicated"))
        yield cluster
        cluster.stop()
    finally:
        etcd.stop()
        pg.remove()
