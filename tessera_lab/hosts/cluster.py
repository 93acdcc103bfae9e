"""A whole cluster with every role on a host of its own (tessera_lab/hosts/netns.py), as real processes.

The hosts: ``cp`` (the retrieval role: public API and control plane), one per memory node,
one per generation node, named after the node, and ``client`` (no role: where the harness
itself, its load and its checks run). :func:`host_config` rewrites a cluster config so each
node listens on its host's address; every role is then started with ``tessera run --role
ROLE --config`` on that one file, through ``ip netns exec`` of its host, and the roles talk
over the virtual network only: tcp transport between hosts, the cluster secret on every
internal request, API keys on the public API (it is no longer on loopback).

:class:`HostCluster` is a :class:`~tessera.launcher.LocalCluster` whose children start
inside their hosts: while it runs, the thread that started it is inside ``client`` (so
health checks, the load and the checker reach the hosts' addresses); :meth:`HostCluster.stop`
brings it back and deletes the network. It knows nothing about faults (see nemesis.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from tessera.config import ClusterConfig
from tessera.launcher import LocalCluster, with_secret
from tessera_lab.hosts.netns import CLONE_NEWNET, Network, enter

CONTROL_HOST = "cp"
CLIENT_HOST = "client"


def host_names(config: ClusterConfig) -> list[str]:
    """Every host of ``config``'s cluster, in the order their addresses are handed out."""
    return [CONTROL_HOST, *(n.name for n in config.kvpools), *(n.name for n in config.generation), CLIENT_HOST]


def address_of(config: ClusterConfig, host: str) -> str:
    from tessera_lab.hosts.netns import SUBNET

    return str(SUBNET.network_address + host_names(config).index(host) + 1)


def write_api_key(directory: Path) -> tuple[Path, str]:
    """A keys file with one admin tenant allowed every scope, and its key (0600)."""
    key = "tsk-" + secrets.token_hex(16)
    path = directory / "keys.toml"
    path.write_text(f'[[tenants]]\nname = "harness"\nscopes = ["*"]\nkeys = ["{key}"]\nadmin = true\n')
    path.chmod(0o600)
    return path, key


def host_config(config: ClusterConfig, directory: Path) -> tuple[ClusterConfig, str]:
    """``config`` with every node on its host's address, tcp transport, a secret, API keys, a data dir.

    Returns the config and the API key of its keys file.
    """
    keys_file, key = write_api_key(directory)
    cp = address_of(config, CONTROL_HOST)
    cfg = dataclasses.replace(
        config,
        retrieval=dataclasses.replace(config.retrieval, host=cp, internal_host=cp,
                                      data_dir=config.retrieval.data_dir or str(directory / "units")),
        kvpools=tuple(dataclasses.replace(n, host=address_of(config, n.name)) for n in config.kvpools),
        generation=tuple(dataclasses.replace(n, host=address_of(config, n.name)) for n in config.generation),
        transport=dataclasses.replace(config.transport, name="tcp"),
        security=dataclasses.replace(config.security, keys_file=str(keys_file)),
    )
    return with_secret(cfg, directory), key


def resize(config: ClusterConfig, hosts: int) -> ClusterConfig:
    """``tessera chaos --hosts N``: the retrieval role, one memory node and N - 2 generation nodes.

    The generation nodes copy the config's first one (names gen0, gen1, ...; ports kept apart).
    """
    if hosts < 3:
        raise ValueError(f"--hosts {hosts}: need at least 3 (the retrieval role, a memory node, a generation node)")
    proto = config.generation[0]
    gens = tuple(dataclasses.replace(proto, name=f"gen{i}", port=proto.port + i) for i in range(hosts - 2))
    return dataclasses.replace(config, kvpools=config.kvpools[:1], generation=gens)


class HostCluster(LocalCluster):
    """Every role of ``config`` on its own host of a virtual network created at :meth:`start`."""

    def __init__(self, config: ClusterConfig, log_dir: Path | None = None, quiet: bool = False) -> None:
        super().__init__(config, log_dir, quiet)
        self.config, self.api_key = host_config(self.config, self.log_dir)
        self.config_path.write_text(_dump(self.config))
        self.network: Network | None = None
        self._home: int | None = None  # the starting thread's own namespace, while inside client

    @property
    def net(self) -> Network:
        assert self.network is not None, "the hosts are not up"
        return self.network

    def _prefix(self, role: str, node: str) -> Sequence[str]:
        host = CONTROL_HOST if role == "retrieval" else node
        return ("ip", "netns", "exec", self.net.namespace(host))

    def _check_ports(self) -> None:
        # the addresses exist only inside the hosts' namespaces: each role binds its own port
        # first thing and exits naming a busy one, which the launcher reports
        pass

    def start(self, timeout: float = 180.0) -> None:
        self.network = Network.create(host_names(self.config))
        self._say("hosts: " + ", ".join(f"{h.name} {h.address} (netns {h.namespace})"
                                        for h in self.network.hosts.values()))
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            enter(self.network.namespace(CLIENT_HOST))
            super().start(timeout)
        except BaseException:
            self._leave()
            raise

    def stop(self, timeout: float = 20.0) -> None:
        try:
            super().stop(timeout)
        finally:
            self._leave()

    def _leave(self) -> None:
        if self._home is not None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.setns(self._home, CLONE_NEWNET)
            os.close(self._home)
            self._home = None
        if self.network is not None:
            self.network.destroy()
            self.network = None


def _dump(config: ClusterConfig) -> str:
    from tessera.config_file import dump_toml

    return dump_toml(config)
