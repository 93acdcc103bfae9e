"""Local etcd and PostgreSQL servers for a replicated retrieval role on one machine: free loopback ports.

Used by ``tessera up --replicas N`` when the config names no etcd / PostgreSQL (their data in
the data directory), by the HA tests and by ``bench/failover.py`` (in temporary folders).
Each class starts its server as a child process (the distribution's binaries: ``etcd`` from
``etcd-server``, ``initdb``/``postgres`` from the PostgreSQL server package), waits until it
answers, and stops it. ``missing()`` says why a server cannot be started here, so the tests
skip with that reason and ``tessera up`` says what to install. These are single-member,
unreplicated servers: fine to try failover of the retrieval role on one machine, not a
production etcd or database.

Neither lets in a local user without credentials: etcd wants a client certificate of its own CA
(:class:`EtcdServer`), PostgreSQL a password, and Tessera's role there is no superuser
(:class:`PostgresServer`). The credentials are 0600 files in the server's 0700 folder, readable
by the user running Tessera (and root); see "Trust model" in docs/high-availability.md.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tessera.ha.certificates import Certificates, issue, openssl_missing
from tessera.private_files import private_dir

ETCD = "etcd"
PG_BINARIES = ("initdb", "pg_ctl", "postgres")
PG_USER = "postgres"  # PostgreSQL refuses to run as root; tests running as root start it as this user
PG_ROLE = PG_DATABASE = "tessera"  # the retrieval replicas' role and its database


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
    """One single-member etcd on 127.0.0.1 (client and peer ports free), TLS with client certificates.

    Clients and the peer port must present a certificate of the folder's own CA
    (:mod:`tessera.ha.certificates`, in ``<directory>/tls``): a local user who cannot read
    ``client.key`` can neither read nor write the election, nor revoke or renew a lease.
    :meth:`access` is the ``[ha]`` fields a client needs.
    """

    @staticmethod
    def missing() -> str | None:
        if shutil.which(ETCD) is None:
            return "etcd is not installed (apt-get install -y etcd-server)"
        return openssl_missing()

    def __init__(self, directory: Path, *, flags: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = directory / "etcd.log"
        self.certificates = Certificates.in_folder(directory / "tls")
        self.flags = flags  # more etcd flags (tests: --auth-token-ttl)
        self.proc: subprocess.Popen[bytes] | None = None

    def access(self) -> dict[str, str]:
        """The ``[ha]`` fields of a client of this etcd: its endpoint, CA, client certificate and key."""
        c = self.certificates
        return {"etcd": self.endpoint, "etcd_ca_file": str(c.ca), "etcd_cert_file": str(c.client_cert),
                "etcd_key_file": str(c.client_key)}

    def start(self) -> EtcdServer:
        private_dir(self.directory)  # the data and the keys: this user's only
        c = issue(self.certificates.ca.parent)
        client, peer = f"https://127.0.0.1:{self.port}", f"https://127.0.0.1:{self.peer_port}"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [ETCD, "--name", "t0", "--data-dir", str(self.directory / "data"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"t0={peer}", "--initial-cluster-state", "new",
                 "--cert-file", str(c.server_cert), "--key-file", str(c.server_key),
                 "--client-cert-auth", "--trusted-ca-file", str(c.ca),
                 # the peer port serves lease renewals too: the same certificates guard it
                 "--peer-cert-file", str(c.server_cert), "--peer-key-file", str(c.server_key),
                 "--peer-client-cert-auth", "--peer-trusted-ca-file", str(c.ca),
                 # a short election timeout keeps the minimum lease TTL (1.5 x of it) at 1 s
                 "--heartbeat-interval", "100", "--election-timeout", "500", *self.flags],
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
    """One PostgreSQL cluster in a private folder on a free port, with a database ``tessera`` of role ``tessera``.

    Every connection needs a password (``scram-sha-256``); the server listens on 127.0.0.1 and on a
    socket in its 0700 folder. Two 0600 files there hold the passwords: ``postgres.password`` (the
    superuser's, used only by :meth:`start`, over the socket, to create the role and the
    database) and ``tessera.pgpass`` (libpq's password file of the role ``tessera``, named by
    :attr:`dsn` as ``passfile=``). ``pg_hba.conf`` lets the superuser in over the socket only and
    the role ``tessera`` into the database ``tessera`` only. That role logs in and owns the
    database; it is no superuser and no member of ``pg_execute_server_program``, so it cannot
    run programs here (``COPY ... TO PROGRAM``) nor reach another database.
    """

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
        self.superuser_password_file = self.directory / "postgres.password"
        self.password_file = self.directory / "tessera.pgpass"
        self.proc: subprocess.Popen[bytes] | None = None
        self.dsn = (f"host=127.0.0.1 port={self.port} user={PG_ROLE} dbname={PG_DATABASE} "
                    f"passfile={_conninfo_value(str(self.password_file))}")

    def _as_user(self) -> list[str]:
        if os.geteuid() != 0:
            return []
        return ["setpriv", f"--reuid={PG_USER}", f"--regid={PG_USER}", "--init-groups"]

    def start(self) -> PostgresServer:
        server_user = pwd.getpwnam(PG_USER) if os.geteuid() == 0 else None
        private_dir(self.directory)  # the socket, the passwords and the log: nobody else's
        if server_user is not None:
            os.chown(self.directory, server_user.pw_uid, server_user.pw_gid)
            self.log.touch()
            os.chown(self.log, server_user.pw_uid, server_user.pw_gid)
        # a cluster made before passwords (initdb --auth=trust): its superuser gets one below
        trusting = self.data.exists() and not self.superuser_password_file.exists()
        superuser = _secret(self.superuser_password_file, lambda pw: pw, server_user)
        if not self.data.exists():
            subprocess.run([*self._as_user(), "initdb", "-D", str(self.data), "-U", PG_USER, "--auth=scram-sha-256",
                            f"--pwfile={self.superuser_password_file}", "-E", "UTF8", "--no-sync"],
                           check=True, capture_output=True)
        hba = self.data / "pg_hba.conf"  # rewritten in place: it stays the server user's
        hba.write_text(_HBA_TRUSTING_SOCKET if trusting else _HBA)
        earlier = self.log.stat().st_size if self.log.exists() else 0  # a restart appends to the log
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*self._as_user(), "postgres", "-D", str(self.data), "-p", str(self.port), "-h", "127.0.0.1",
                 "-k", str(self.directory), "-c", "fsync=off"], stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)  # Ctrl-C of `tessera up` reaches the roles; stop() ends this
        proc = self.proc
        _wait_until(lambda: b"ready to accept connections" in self.log.read_bytes()[earlier:], proc, "postgres",
                    self.log)
        self._create_role(superuser, trusting)
        return self

    def _create_role(self, superuser: str, trusting: bool) -> None:
        """As the superuser, over the socket: the role ``tessera``, its password and its database."""
        import psycopg
        from psycopg import sql

        password = _secret(self.password_file, lambda pw: f"*:*:*:{PG_ROLE}:{pw}", None).rsplit(":", 1)[1]
        socket_dsn = f"host={_conninfo_value(str(self.directory))} port={self.port} user={PG_USER}"
        with psycopg.connect(socket_dsn + " dbname=postgres", password=superuser, autocommit=True) as conn:

            def verifier(user: str, pw: str) -> sql.Literal:  # the server and its log never see the password
                return sql.Literal(conn.pgconn.encrypt_password(pw.encode(), user.encode(), b"scram-sha-256").decode())

            if trusting:
                conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(PG_USER),
                                                                          verifier(PG_USER, superuser)))
                (self.data / "pg_hba.conf").write_text(_HBA)
                conn.execute("SELECT pg_reload_conf()")
            known = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (PG_ROLE,)).fetchone() is not None
            conn.execute(sql.SQL("{} ROLE {} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS "
                                 "PASSWORD {}").format(sql.SQL("ALTER" if known else "CREATE"),
                                                       sql.Identifier(PG_ROLE), verifier(PG_ROLE, password)))
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (PG_DATABASE,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(PG_DATABASE),
                                                                            sql.Identifier(PG_ROLE)))
            else:
                conn.execute(sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(PG_DATABASE),
                                                                              sql.Identifier(PG_ROLE)))
        if trusting:  # the tables an older Tessera made as the superuser become the role's
            with psycopg.connect(socket_dsn + f" dbname={PG_DATABASE}", password=superuser, autocommit=True) as conn:
                tables = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                                      "AND tableowner <> %s", (PG_ROLE,)).fetchall()
                for (table,) in tables:  # ALTER TABLE OWNER moves the table's serial sequences along
                    conn.execute(sql.SQL("ALTER TABLE public.{} OWNER TO {}").format(sql.Identifier(table),
                                                                                      sql.Identifier(PG_ROLE)))

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


# the superuser over the folder's socket only; the role tessera into its database only
_HBA = f"""# written by Tessera (tessera/ha/servers.py) at every start
local all {PG_USER} scram-sha-256
host {PG_DATABASE} {PG_ROLE} 127.0.0.1/32 scram-sha-256
"""
# the first start of a cluster made with trust: the socket (in a 0700 folder) lets the superuser
# in to set its password, then _HBA replaces this
_HBA_TRUSTING_SOCKET = f"""# written by Tessera (tessera/ha/servers.py) for one start
local all {PG_USER} trust
"""


def _conninfo_value(value: str) -> str:
    """``value`` quoted for a libpq key/value DSN."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _secret(path: Path, line: Callable[[str], str], owner: pwd.struct_passwd | None) -> str:
    """The line of file ``path`` (0600, of ``owner``, else of this user), written now with a new password."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(line(secrets.token_urlsafe(24)) + "\n")
        if owner is not None:
            os.chown(path, owner.pw_uid, owner.pw_gid)
    return path.read_text().strip()
