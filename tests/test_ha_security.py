"""Authenticated coordination: what a local user without the credentials can do to `[ha]`'s etcd and PostgreSQL.

The attacker is the machine's ``nobody`` (the tests run as root and drop to it in a child
process): it reaches every loopback port, but none of the 0600 credential files. The servers are
the ones ``tessera up --replicas`` starts (:func:`tessera.ha.local.replicated`), checked with the
credentials it hands the roles. Regression tests for a local user who, with the servers open,
made every generation node follow a fake control plane (etcd without authentication) and ran a
shell command as ``postgres`` (a PostgreSQL that trusted every local connection as superuser).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aetcd import rpc
from helpers.cluster import REPO, cluster_config

from tessera.config import ClusterConfig, HAConfig, RetrievalConfig
from tessera.errors import ConfigError
from tessera.ha.discovery import follow_leader
from tessera.ha.election import Election, Leader
from tessera.ha.etcd_client import connect, etcd_password
from tessera.ha.local import replicated
from tessera.ha.servers import EtcdServer, PostgresServer
from tessera.retrieval.store.postgres import dsn_with_secret

NOBODY = 65534
ELECTION = "/tessera/retrieval/leader"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the user nobody needs root")


def as_nobody(script: str, args: dict[str, Any]) -> dict[str, str]:
    """Run ``script`` (Python, ``args`` as JSON on stdin, a JSON dict on stdout) as the user nobody."""
    done = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           sys.executable, "-c", script], input=json.dumps(args), capture_output=True, text=True,
                          cwd="/", env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "HOME": "/nonexistent"},
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def assert_all_refused(outcomes: dict[str, str], *errors: str) -> None:
    """Every attempt failed, with one of ``errors`` (a bug in the attack would fail with another)."""
    done = {attempt: outcome for attempt, outcome in outcomes.items()
            if not outcome.startswith(tuple(f"refused: {e}:" for e in (*errors, "PermissionError")))}
    assert not done, f"nobody got through, or failed for another reason: {done}"


@pytest.fixture(scope="module")
def up() -> Iterator[ClusterConfig]:
    """The config `tessera up --replicas 2` hands its roles, with the etcd and PostgreSQL it started."""
    for missing in (EtcdServer.missing(), PostgresServer.missing()):
        if missing:
            pytest.skip(missing)
    with replicated(cluster_config("unused-model", nodes=1), 2) as config:
        yield config


@pytest.fixture
async def holder(up: ClusterConfig) -> AsyncIterator[Election]:
    """The election as a replica sees it, through the client the config's credentials make."""
    election = Election(connect(up.ha), up.ha.election, ttl_s=5, margin_s=1.0)
    yield election
    await election.client.close()


# the end of every attack script: try to read the credential files, then print the outcomes
_READ_SECRETS = r"""
for path in a["secrets"]:
    try:
        open(path, "rb").read()
        out[f"read {path}"] = "done"
    except OSError as exc:
        out[f"read {path}"] = f"refused: {type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

_ETCD_ATTACK = r"""
import asyncio, json, sys
import aetcd
from tessera.config import HAConfig
from tessera.ha.etcd_client import connect
a = json.load(sys.stdin)
host, port = a["etcd"].split(":")
out = {}

async def attempt(name, client, act):
    try:
        await asyncio.wait_for(act(client), 15)
        out[name] = "done"
    except Exception as exc:
        out[name] = f"refused: {type(exc).__name__}: {exc}"[:300]
    finally:
        await client.close()

async def main():
    # what the attacker had: a plain client; and one over TLS that trusts the CA (a public certificate)
    for kind, make in (("plaintext", lambda: aetcd.Client(host=host, port=int(port), timeout=5)),
                       ("tls-without-certificate", lambda: connect(HAConfig(etcd=a["etcd"],
                                                                            etcd_ca_file=a["ca_copy"])))):
        await attempt(f"{kind} put", make(), lambda c: c.put(a["fake_key"].encode(), b"http://127.0.0.1:1"))
        await attempt(f"{kind} delete", make(), lambda c: c.delete_prefix(a["prefix"].encode()))
        await attempt(f"{kind} revoke", make(), lambda c: c.revoke_lease(a["lease"]))

asyncio.run(main())
""" + _READ_SECRETS


@needs_root
async def test_a_local_user_without_the_client_certificate_cannot_touch_the_election(
        up: ClusterConfig, holder: Election) -> None:
    """The user nobody cannot put or delete election keys in `tessera up`'s etcd, nor revoke a candidate's lease."""
    lease = await holder.client.lease(30)
    key = holder.prefix + f"{lease.id:x}".encode()
    await holder.client.put(key, b"http://127.0.0.1:8401", lease)
    fd, name = tempfile.mkstemp(suffix=".crt")  # etcd's CA certificate is public: a copy nobody can read
    os.close(fd)
    ca_copy = Path(name)
    shutil.copy(up.ha.etcd_ca_file or os.devnull, ca_copy)
    ca_copy.chmod(0o644)
    try:
        outcomes = await asyncio.to_thread(as_nobody, _ETCD_ATTACK, {
            "etcd": up.ha.etcd, "ca_copy": str(ca_copy), "prefix": up.ha.election + "/",
            "fake_key": up.ha.election + "/1", "lease": lease.id,
            "secrets": [up.ha.etcd_key_file or "/nonexistent", up.ha.etcd_cert_file or "/nonexistent"]})
    finally:
        ca_copy.unlink()
    assert_all_refused(outcomes, "ConnectionFailedError")  # no TLS handshake without the client certificate
    assert await holder.leader() == Leader(b"http://127.0.0.1:8401", (await holder.client.get(key)).create_revision)
    assert (await holder.client.get(key)).lease == lease.id
    await holder.client.revoke_lease(lease.id)


_PG_ATTACK = r"""
import json, sys
import psycopg
a = json.load(sys.stdin)
out = {}
for name, dsn in a["dsns"].items():
    try:
        psycopg.connect(dsn, connect_timeout=10).close()
        out[name] = "done"
    except Exception as exc:
        out[name] = f"refused: {type(exc).__name__}: {exc}"[:300]
""" + _READ_SECRETS


@needs_root
def test_a_local_user_without_the_password_cannot_connect_to_postgres(up: ClusterConfig) -> None:
    """The user nobody reaches `tessera up`'s PostgreSQL but gets in as neither the superuser nor Tessera's role."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    given = conninfo_to_dict(up.retrieval.postgres_dsn)
    passfile = str(given.pop("passfile", "/nonexistent"))
    port = given["port"]
    dsns = {f"{user} over tcp to {db}": make_conninfo(host="127.0.0.1", port=port, user=user, dbname=db)
            for user in ("postgres", "tessera", "nobody") for db in ("postgres", "tessera")}
    folder = Path(passfile).parent
    dsns["postgres over the socket"] = make_conninfo(host=str(folder), port=port, user="postgres", dbname="postgres")
    outcomes = as_nobody(_PG_ATTACK, {"dsns": dsns, "secrets": [passfile, str(folder / "postgres.password")]})
    assert_all_refused(outcomes, "OperationalError")


@needs_root
def test_tessera_s_own_role_is_no_superuser_and_runs_no_programs(up: ClusterConfig) -> None:
    """The role the replicas log in as cannot `COPY ... TO PROGRAM`, nor make itself superuser."""
    import psycopg

    with psycopg.connect(dsn_with_secret(up.retrieval), autocommit=True) as conn:
        row = conn.execute("SELECT current_user, rolsuper, pg_has_role('pg_execute_server_program', 'USAGE'), "
                           "pg_has_role('pg_read_server_files', 'USAGE') FROM pg_roles "
                           "WHERE rolname = current_user").fetchone()
        assert row == ("tessera", False, False, False), row
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="pg_execute_server_program"):
            conn.execute("COPY (SELECT 1) TO PROGRAM 'true'")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("ALTER ROLE tessera SUPERUSER")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT pg_read_file('PG_VERSION')")
        conn.execute("CREATE TABLE IF NOT EXISTS probe (x INT)")  # its own database: it keeps units there
        conn.execute("DROP TABLE probe")


async def test_replicas_elect_and_fail_over_with_the_credentials_up_gives_them(up: ClusterConfig) -> None:
    """Two candidates on `tessera up`'s etcd: one leads, it resigns, the other leads under a larger term."""
    a, b = (Election(connect(up.ha), "/t/failover", ttl_s=2, margin_s=0.5) for _ in range(2))
    try:
        first = await a.campaign(b"r0")
        second = asyncio.create_task(b.campaign(b"r1"))
        await asyncio.sleep(0.3)
        assert not second.done(), "two leaders at once"
        await first.close()  # dies without resigning: its lease runs out
        successor = await asyncio.wait_for(second, 10)
        assert successor.term > first.term and await a.leader() == Leader(b"r1", successor.term)
        await successor.resign()
    finally:
        await a.client.close()
        await b.client.close()


def test_a_replica_writes_units_with_the_passfile_up_gives_it(up: ClusterConfig, tmp_path: Path) -> None:
    """The replicas' store opens `tessera up`'s database as the role tessera, the password never in the config."""
    from tessera.retrieval.store.postgres import PgUnitRecords

    assert "password" not in up.retrieval.postgres_dsn.replace("passfile", "")
    records = PgUnitRecords(dsn_with_secret(up.retrieval), tmp_path, "fp")
    try:
        assert records.record_term(7) and not records.record_term(6)
    finally:
        records.close()


def test_a_postgres_folder_made_with_trust_gets_passwords_and_keeps_its_units(postgres: PostgresServer) -> None:
    """A cluster made by an older `tessera up` (initdb --auth=trust, the superuser's tables) is locked on restart."""
    import psycopg

    postgres.stop()  # the fixture's server, made anew below as an older Tessera made it
    shutil.rmtree(postgres.data)
    postgres.superuser_password_file.unlink()
    subprocess.run([*postgres._as_user(), "initdb", "-D", str(postgres.data), "-U", "postgres", "--auth=trust",
                    "--no-sync"], check=True, capture_output=True)
    old = subprocess.Popen([*postgres._as_user(), "postgres", "-D", str(postgres.data), "-p", str(postgres.port),
                            "-k", str(postgres.directory), "-h", ""], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        socket = f"host={postgres.directory} port={postgres.port} user=postgres"
        for _ in range(200):
            with contextlib.suppress(psycopg.OperationalError):
                psycopg.connect(socket + " dbname=postgres", autocommit=True).close()
                break
            time.sleep(0.05)
        with psycopg.connect(socket + " dbname=postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE tessera")
        with psycopg.connect(socket + " dbname=tessera", autocommit=True) as conn:
            conn.execute("CREATE TABLE units (key BIGSERIAL PRIMARY KEY, text TEXT)")
            conn.execute("INSERT INTO units (text) VALUES ('kept')")
    finally:
        old.send_signal(signal.SIGINT)
        old.wait(15)
    postgres.start()
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT text FROM units").fetchall() == [("kept",)]
        conn.execute("INSERT INTO units (text) VALUES ('new')")  # the role owns the table and its sequence now
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(f"host=127.0.0.1 port={postgres.port} user=postgres dbname=tessera").close()


# --- an external etcd with users (etcd's auth enabled) -------------------------------------------------------


async def _enable_auth(etcd: EtcdServer, user: str, password: str, prefix: bytes) -> None:
    """etcd's auth on, as `etcdctl user add root; role add ...; auth enable` would: ``user`` may use ``prefix``."""
    client = connect(HAConfig(**etcd.access()))
    await client.connect()
    try:
        auth = rpc.AuthStub(client.channel)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=secrets.token_urlsafe(16)))
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"))
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="election"))
        await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name="election", perm=rpc.Permission(
            permType=rpc.Permission.READWRITE, key=prefix, range_end=prefix[:-1] + bytes([prefix[-1] + 1]))))
        await auth.UserAdd(rpc.AuthUserAddRequest(name=user, password=password))
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role="election"))
        await auth.AuthEnable(rpc.AuthEnableRequest())
    finally:
        await client.close()


@pytest.fixture
def etcd_with_users(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, Path]]:
    """An etcd with auth enabled and tokens forgotten after 1 s unused; the user ``replica``'s password file."""
    reason = EtcdServer.missing()
    if reason:
        pytest.skip(reason)
    server = EtcdServer(tmp_path_factory.mktemp("etcd-users"), flags=("--auth-token-ttl", "1")).start()
    password_file = tmp_path_factory.mktemp("secret") / "etcd.password"
    password = secrets.token_urlsafe(16)
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    asyncio.run(_enable_auth(server, "replica", password, b"/t/"))
    yield server, password_file
    server.stop()


async def test_an_etcd_user_campaigns_and_a_follower_outlives_its_token(
        etcd_with_users: tuple[EtcdServer, Path]) -> None:
    """With ha.etcd_user: the election works; a watcher whose token ran out while idle sees the next leader."""
    etcd, password_file = etcd_with_users
    ha = HAConfig(**etcd.access(), etcd_user="replica", etcd_password_file=str(password_file), election="/t/leader",
                  lease_ttl_s=2, renew_margin_s=0.5)
    seen: list[Leader | None] = []
    follower = asyncio.create_task(follow_leader(ha, seen.append))
    candidate = Election(connect(ha), ha.election, ttl_s=2, margin_s=0.5)
    try:
        await asyncio.sleep(2.5)  # the follower's token is forgotten: it only watched
        leadership = await candidate.campaign(b"r0")
        for _ in range(100):
            if Leader(b"r0", leadership.term) in seen:
                break
            await asyncio.sleep(0.1)
        assert Leader(b"r0", leadership.term) in seen, seen
        await asyncio.sleep(2.5)  # longer than a token lives: the leader keeps its lease all the same
        assert leadership.valid
        await leadership.resign()
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await candidate.client.close()


async def test_a_wrong_etcd_password_or_none_is_refused(etcd_with_users: tuple[EtcdServer, Path],
                                                        tmp_path: Path) -> None:
    """The client certificate alone, or the user with another password, may not write the election."""
    import aetcd.exceptions

    etcd, _ = etcd_with_users
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password")
    wrong.chmod(0o600)
    wrong_user = HAConfig(**etcd.access(), etcd_user="replica", etcd_password_file=str(wrong))
    for ha in (HAConfig(**etcd.access()), wrong_user):
        client = connect(ha)
        try:
            with pytest.raises(aetcd.exceptions.ClientError):
                await client.put(b"/t/leader/1", b"fake")
        finally:
            await client.close()


# --- configuration -------------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("fields", "says"), [
    ({"etcd_cert_file": "c.crt"}, "set both ha.etcd_cert_file and ha.etcd_key_file"),
    ({"etcd_cert_file": "c.crt", "etcd_key_file": "c.key"}, "set ha.etcd_ca_file"),
    ({"etcd_password_file": "p"}, "name the etcd user"),
])
def test_incomplete_etcd_credentials_are_refused_saying_what_to_add(fields: dict[str, str], says: str) -> None:
    """A client certificate without its key or CA, or a password without a user, is a config error."""
    with pytest.raises(ConfigError, match=says):
        HAConfig(etcd="127.0.0.1:2379", **fields)


@pytest.mark.unit
@pytest.mark.parametrize("dsn", ["host=db password=hunter2 dbname=tessera", "postgresql://tessera:hunter2@db/tessera",
                                 "postgresql://db/tessera?password=hunter2"])
def test_a_password_in_the_dsn_is_refused_and_never_echoed(dsn: str) -> None:
    """The DSN goes into every role's copied config and `tessera up`'s output: no password in it."""
    with pytest.raises(ConfigError, match="postgres_password_file") as raised:
        RetrievalConfig(store="postgres", postgres_dsn=dsn)
    assert "hunter2" not in str(raised.value)


@pytest.mark.unit
def test_secret_files_readable_by_others_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An etcd or PostgreSQL password file of mode 0644 is refused, naming the chmod; no password at all too."""
    loose = tmp_path / "password"
    loose.write_text("secret")
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        etcd_password(HAConfig(etcd="e:1", etcd_user="u", etcd_password_file=str(loose)))
    with pytest.raises(ConfigError, match="chmod 600"):
        dsn_with_secret(RetrievalConfig(store="postgres", postgres_dsn="host=db", postgres_password_file=str(loose)))
    monkeypatch.delenv("TESSERA_ETCD_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match="TESSERA_ETCD_PASSWORD"):
        etcd_password(HAConfig(etcd="e:1", etcd_user="u"))


@pytest.mark.unit
def test_up_with_a_named_etcd_checks_its_credentials_before_starting_anything(tmp_path: Path) -> None:
    """`tessera up --replicas` with an external etcd refuses a client key others may read, naming the key."""
    key = tmp_path / "client.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    key.chmod(0o644)
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    base = cluster_config("unused-model", nodes=1)
    config = dataclasses.replace(
        base, retrieval=dataclasses.replace(base.retrieval, store="postgres", postgres_dsn="host=db dbname=tessera"),
        ha=HAConfig(etcd="etcd.internal:2379", etcd_ca_file=str(tmp_path / "ca.pem"), etcd_cert_file="c.pem",
                    etcd_key_file=str(key)))
    with pytest.raises(ConfigError, match=r"ha\.etcd_key_file .* chmod 600"), replicated(config, 2):
        pass
