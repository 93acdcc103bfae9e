"""``tessera up --replicas N``: a config for N retrieval replicas, with etcd and PostgreSQL if none is named.

:func:`replicated` yields the config the launcher starts: ``ha.replicas = N``, ``ha.etcd`` and
``retrieval.postgres_dsn`` as given (``--ha-etcd``, ``--store-dsn`` or the config file), and,
for whichever is missing, a local single-member server started here for as long as the
block lasts (:mod:`tessera.ha.servers`): etcd's data in ``<data_dir>/etcd``, PostgreSQL's in
``<data_dir>/postgres`` (a temporary folder when running as root: PostgreSQL runs as the
``postgres`` user, who cannot enter root's home). One machine, unreplicated servers: a way to
try failover of the retrieval role, not a production etcd or database.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tessera.config import ClusterConfig
from tessera.errors import ConfigError
from tessera.ha.servers import EtcdServer, PostgresServer


@contextlib.contextmanager
def replicated(config: ClusterConfig, replicas: int | None, etcd: str | None = None,
               store_dsn: str | None = None) -> Iterator[ClusterConfig]:
    """``config`` with the flags applied; the servers it lacks run until the block ends."""
    n = config.ha.replicas if replicas is None else replicas
    etcd = etcd or config.ha.etcd
    dsn = store_dsn or (config.retrieval.postgres_dsn if config.retrieval.store == "postgres" else "")
    if n == 1 and not etcd:
        yield config
        return
    with contextlib.ExitStack() as stack:
        if config.retrieval.data_dir:
            data = Path(config.retrieval.data_dir).expanduser()
        else:  # no data directory (tessera chaos): the servers' data goes with the run
            data = Path(tempfile.mkdtemp(prefix="tessera-ha-"))
            stack.callback(shutil.rmtree, data, True)
        if not etcd:
            _check(EtcdServer.missing(), "--ha-etcd")
            (data / "etcd").mkdir(parents=True, exist_ok=True)
            server = EtcdServer(data / "etcd")
            stack.callback(server.stop)
            etcd = server.start().endpoint
            print(f"tessera up: started a local etcd at {etcd} (data in {data / 'etcd'})", flush=True)
        if not dsn:
            _check(PostgresServer.missing(), "--store-dsn")
            temporary = os.geteuid() == 0
            pg = PostgresServer(None if temporary else data / "postgres")
            stack.callback(pg.remove if temporary else pg.stop)
            dsn = pg.start().dsn
            print(f"tessera up: started a local PostgreSQL ({dsn}; data in {pg.directory}"
                  + (", removed at exit: running as root" if temporary else "") + ")", flush=True)
        yield dataclasses.replace(
            config, ha=dataclasses.replace(config.ha, replicas=n, etcd=etcd),
            retrieval=dataclasses.replace(config.retrieval, store="postgres", postgres_dsn=dsn))


def _check(missing: str | None, flag: str) -> None:
    if missing:
        raise ConfigError(f"{missing}; install it, or name a running server ({flag})")
