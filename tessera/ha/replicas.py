"""Replica ``i`` of a replicated retrieval role: the same config on its own ports and index folder.

Every replica reads the one config file; ``tessera run --role retrieval --node rI`` picks
replica *i* (``r0`` is the config as written). Replica *i* listens on ``retrieval.port`` and
``retrieval.internal_port`` plus *i* × ``ha.replica_port_stride``, and keeps its ANN index
(a cache of the PostgreSQL store) in ``retrieval.data_dir/replica-i`` (a temporary folder
when ``data_dir`` is empty: it is rebuilt from the store at start).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tessera.config import ClusterConfig
from tessera.errors import ConfigError

_NAME = re.compile(r"r(\d+)")


def replica_name(index: int) -> str:
    return f"r{index}"


def replica_index(config: ClusterConfig, name: str | None) -> int:
    """The index of replica ``name`` (``r0``..); None or "main" is replica 0."""
    if name in (None, "", "main"):
        return 0
    found = _NAME.fullmatch(name or "")
    if found is None or int(found.group(1)) >= config.ha.replicas:
        raise ConfigError(f"no retrieval replica named {name!r}: ha.replicas = {config.ha.replicas} names "
                          + ", ".join(replica_name(i) for i in range(config.ha.replicas)))
    return int(found.group(1))


def replica_config(config: ClusterConfig, index: int) -> ClusterConfig:
    """``config`` as replica ``index`` serves it (replica 0: unchanged)."""
    if index == 0:
        return config
    r, stride = config.retrieval, config.ha.replica_port_stride * index
    data_dir = str(Path(r.data_dir).expanduser() / f"replica-{index}") if r.data_dir else ""
    return dataclasses.replace(config, retrieval=dataclasses.replace(
        r, port=r.port + stride, internal_port=r.internal_port + stride, data_dir=data_dir))


def replica_urls(config: ClusterConfig) -> list[tuple[str, str]]:
    """(public URL, internal URL) of every replica, replica 0 first."""
    return [(c.retrieval_url, c.control_url)
            for c in (replica_config(config, i) for i in range(config.ha.replicas))]
