"""``tessera up --replicas N``: a config for N retrieval replicas, with etcd and PostgreSQL if none is named.

:func:`replicated` yields the config the launcher starts: ``ha.replicas = N``, ``ha.etcd`` and
``retrieval.postgres_dsn`` as given (``--ha-etcd``, ``--store-dsn`` or the config file), and,
for whichever is missing, a local single-member server started here for as long as the
block lasts (:mod:`tessera.ha.servers`): etcd's data in ``<data_dir>/etcd``, PostgreSQL's in
``<data_dir>/postgres`` (a temporary folder when running as root: PostgreSQL runs as the
``postgres`` user, who cannot enter root's home). One machine, unreplicated servers: a way to
try failover of the retrieval role, not a production etcd or database. Their credentials (etcd's
client certificate, the PostgreSQL role's passfile) go into the config the roles get; a named
etcd or database is reached with the credentials the config gives (``[ha]`` ``etcd_*``,
``retrieval.postgres_password_file``), checked here before any role starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tessera.config import ClusterConfig
from tessera.errors import ConfigError
from tessera.ha.servers import EtcdServer, PostgresServer
from tessera.private_files import check_private


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
        ha: dict[str, Any] = {"etcd": etcd}  # a named etcd: with the credentials [ha] gives
        if not etcd:
            _check(EtcdServer.missing(), "--ha-etcd")
            server = EtcdServer(data / "etcd")
            stack.callback(server.stop)
            ha = {**server.start().access(), "etcd_user": "", "etcd_password_file": ""}
            print(f"tessera up: started a local etcd at {server.endpoint} (TLS; only the client certificate in "
                  f"{server.certificates.client_cert.parent} gets in; data in {data / 'etcd'})", flush=True)
        retrieval: dict[str, Any] = {"postgres_dsn": dsn}  # a named database: its password as configured
        if not dsn:
            _check(PostgresServer.missing(), "--store-dsn")
            temporary = os.geteuid() == 0
            pg = PostgresServer(None if temporary else data / "postgres")
            stack.callback(pg.remove if temporary else pg.stop)
            retrieval = {"postgres_dsn": pg.start().dsn, "postgres_password_file": ""}
            print(f"tessera up: started a local PostgreSQL ({pg.dsn}: the role tessera, its password in that "
                  f"passfile; data in {pg.directory}" + (", removed at exit: running as root" if temporary else "")
                  + ")", flush=True)
        out = dataclasses.replace(
            config, ha=dataclasses.replace(config.ha, replicas=n, **ha),
            retrieval=dataclasses.replace(config.retrieval, store="postgres", **retrieval))
        check_credentials(out)
        yield out


def check_credentials(config: ClusterConfig) -> None:
    """Read every credential file the replicas will: a missing or readable-by-others one fails here, before any role."""
    from tessera.ha.etcd_client import etcd_password, tls_credentials

    etcd_password(config.ha)
    tls_credentials(config.ha)
    if config.retrieval.postgres_password_file:  # read by each replica's store (retrieval/store/postgres.py)
        check_private(Path(config.retrieval.postgres_password_file).expanduser(), "retrieval.postgres_password_file")


def _check(missing: str | None, flag: str) -> None:
    if missing:
        raise ConfigError(f"{missing}; install it, or name a running server ({flag})")
