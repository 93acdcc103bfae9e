"""Local etcd and PostgreSQL servers for a replicated retrieval role on one machine: free loopback ports.

Used by ``tessera up --replicas N`` when the config names no etcd / PostgreSQL (their data in
the data directory), by the HA tests and by ``bench/failover.py`` (in temporary folders).
Each class starts its server as a child process (the distribution's binaries: ``etcd`` from
``etcd-server``, ``initdb``/``postgres`` from the PostgreSQL server package), waits until it
answers, and stops it. ``missing()`` says why a server cannot be started here, so the tests
skip with that reason and ``tessera up`` says what to install. These are single-member,
unreplicated servers: fine to try failover of the retrieval role on one machine, not a
production etcd or database.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ETCD = "etcd"
PG_BINARIES = ("initdb", "pg_ctl", "postgres")
PG_USER = "postgres"  # PostgreSQL refuses to run as root; tests running as root start it as this user


_GIVEN: set[int] = set()


def free_port() -> int:
    """A free loopback port not handed out before by this process."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_until(ok: object, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        if callable(ok) and ok():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer within {timeout}s: {log.read_text()[-2000:]}")


class EtcdServer:
    """One single-member etcd on 127.0.0.1 (client and peer ports free)."""

    @staticmethod
    def missing() -> str | None:
        return None if shutil.which(ETCD) else "etcd is not installed (apt-get install -y etcd-server)"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = directory / "etcd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EtcdServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [ETCD, "--name", "t0", "--data-dir", str(self.directory / "data"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"t0={peer}", "--initial-cluster-state", "new",
                 # a short election timeout keeps the minimum lease TTL (1.5 x of it) at 1 s
                 "--heartbeat-interval", "100", "--election-timeout", "500"],
                stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)  # Ctrl-C of `tessera up` reaches the roles; stop() ends this
        proc = self.proc
        _wait_until(lambda: _answers(self.port) and b"ready to serve client requests" in self.log.read_bytes(),
                    proc, "etcd", self.log)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class PostgresServer:
    """One PostgreSQL cluster in a temp dir on a free port, with a database ``tessera``."""

    @staticmethod
    def missing() -> str | None:
        absent = [b for b in PG_BINARIES if shutil.which(b) is None]
        if absent:
            return f"PostgreSQL server binaries missing: {', '.join(absent)}"
        if os.geteuid() == 0:
            try:
                pwd.getpwnam(PG_USER)
            except KeyError:
                return f"running as root and there is no {PG_USER!r} user to start PostgreSQL as"
        return None

    def __init__(self, directory: Path | None = None) -> None:
        # by default not under pytest's tmp_path: that is root-only (0700), and PostgreSQL may
        # run as another user
        self.directory = directory or Path(tempfile.mkdtemp(prefix="tessera-pg-"))
        self.data = self.directory / "pgdata"
        self.port = free_port()
        self.log = self.directory / "postgres.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.dsn = f"host=127.0.0.1 port={self.port} user={PG_USER} dbname=tessera"

    def _as_user(self) -> list[str]:
        if os.geteuid() != 0:
            return []
        return ["setpriv", f"--reuid={PG_USER}", f"--regid={PG_USER}", "--init-groups"]

    def start(self) -> PostgresServer:
        if not self.data.exists():
            self.directory.mkdir(parents=True, exist_ok=True)
            if os.geteuid() == 0:
                user = pwd.getpwnam(PG_USER)
                os.chown(self.directory, user.pw_uid, user.pw_gid)
                self.log.touch()
                os.chown(self.log, user.pw_uid, user.pw_gid)
            subprocess.run([*self._as_user(), "initdb", "-D", str(self.data), "-U", PG_USER, "--auth=trust",
                            "-E", "UTF8", "--no-sync"], check=True, capture_output=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*self._as_user(), "postgres", "-D", str(self.data), "-p", str(self.port), "-h", "127.0.0.1",
                 "-k", str(self.directory), "-c", "fsync=off"], stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)  # Ctrl-C of `tessera up` reaches the roles; stop() ends this
        proc = self.proc
        _wait_until(lambda: b"ready to accept connections" in self.log.read_bytes(), proc, "postgres", self.log)
        import psycopg

        with psycopg.connect(self.dsn.replace("dbname=tessera", "dbname=postgres"), autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = 'tessera'").fetchone() is None:
                conn.execute("CREATE DATABASE tessera")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
