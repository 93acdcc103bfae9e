"""Start a whole cluster on this machine as real processes (``tessera up``, the bench).

Order matters: the retrieval node (the control plane) first, then the memory nodes, which
register with it, then the generation nodes, which find the memory nodes through it. Each
child gets the same effective config file. Shutdown is the reverse order with SIGTERM (each
role drains), then SIGKILL for anything that does not stop in time.

``supervise`` keeps the cluster up: a role that exits unexpectedly is started again with
exponential backoff while the others keep serving. Children die with the launcher (Linux
``PR_SET_PDEATHSIG``): a killed launcher leaves no orphan roles holding the ports.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tessera.auth import ClusterAuth, create_secret
from tessera.config import ClusterConfig
from tessera.config_file import dump_toml
from tessera.engines.checkpoint import resolve
from tessera.errors import TesseraError
from tessera.ha.replicas import replica_config, replica_index, replica_name, replica_urls
from tessera.ports import check_free, holds_port

PR_SET_PDEATHSIG = 1  # linux/prctl.h
RESTART_BACKOFF_S = (0.5, 30.0)  # first delay, cap; doubles while a role keeps dying young
STABLE_AFTER_S = 30.0  # a role that ran this long before exiting starts again at the first delay


@dataclass
class Child:
    role: str
    node: str
    url: str
    log_path: Path
    proc: subprocess.Popen[bytes]
    log_file: IO[bytes] = field(repr=False)
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0

    @property
    def port(self) -> int:
        return int(urllib.parse.urlsplit(self.url).port or 0)

    @property
    def health_path(self) -> str:
        """What says the role is up: the retrieval role's ``/health`` is ready only once a
        generation node reported in, which starts after it, so the launcher asks if it is live."""
        return "/health/live" if self.role == "retrieval" else "/health"

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ClusterError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when the launcher exits, however it exits.

    NOTE: Linux ties this to the *thread* that forked the child, so roles are spawned from
    the launcher's main thread (never from a worker thread that may exit first).
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the launcher died before prctl took effect
            os._exit(1)


def role_env(**extra: str) -> dict[str, str]:
    """Environment of a role process: unbuffered output, never reach for a model hub."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def spawn_role(role: str, node: str | None, config_path: Path, log_path: Path, url: str,
               env: dict[str, str] | None = None, *, append: bool = False,
               die_with_parent: bool = False, log_level: str = "info", prefix: Sequence[str] = ()) -> Child:
    """Start ``tessera run --role ROLE [--node NODE]`` with its output in ``log_path``.

    ``die_with_parent``: the child gets SIGTERM when this process exits (call from the main
    thread: see :func:`_die_with_parent`). ``prefix`` runs the command through another one
    that execs it (``ip netns exec NS``: tessera_lab/hosts).
    """
    cmd = [*prefix, sys.executable, "-m", "tessera", "run", "--role", role, "--config", str(config_path),
           "--log-level", log_level]
    if node is not None:
        cmd += ["--node", node]
    log_file = open(log_path, "ab" if append else "wb")  # noqa: SIM115 - lives as long as the child
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env or role_env(),
                            start_new_session=True, preexec_fn=_die_with_parent if die_with_parent else None)
    return Child(role, node or "main", url, log_path, proc, log_file)


def wait_healthy(children: list[Child], timeout: float, on_ready: Callable[[Child], None] | None = None,
                 context: ssl.SSLContext | None = None, path: str | None = None) -> None:
    """Poll each child's health check (``path``, else :attr:`Child.health_path`) until it answers
    200; ClusterError if one exits or time runs out."""
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.proc.poll() is not None:
                raise ClusterError(f"{child.role} {child.node} exited with code {child.proc.returncode}; "
                                   f"log {child.log_path}:\n{child.tail()}")
            url = child.url + (path or child.health_path)
            with contextlib.suppress(OSError, urllib.error.URLError), \
                    urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                # a 200 counts only from our own child: another cluster may answer on this port
                if resp.status == 200 and holds_port(child.proc.pid, child.port) is not False:
                    pending.remove(child)
                    if on_ready is not None:
                        on_ready(child)
        if pending and time.monotonic() > deadline:
            names = ", ".join(f"{c.role} {c.node}" for c in pending)
            raise ClusterError(f"not healthy after {timeout:.0f}s: {names}:\n"
                               + "\n".join(c.tail() for c in pending))
        if pending:
            time.sleep(0.1)


def with_secret(config: ClusterConfig, directory: Path) -> ClusterConfig:
    """``config`` with a cluster secret: the configured file (created 0600 if missing) or a new
    one in ``directory``. Every role of the cluster reads it; nothing else should."""
    path = Path(config.security.secret_file) if config.security.secret_file else directory / "cluster.secret"
    if not path.exists():
        create_secret(path)
    return dataclasses.replace(config, security=dataclasses.replace(config.security, secret_file=str(path.resolve())))


class LocalCluster:
    """Every role of ``config`` as child processes of this one."""

    def __init__(self, config: ClusterConfig, log_dir: Path | None = None, quiet: bool = False,
                 log_level: str = "info") -> None:
        self.config = config
        self.log_level = log_level
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="tessera-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        config = self.config = with_secret(config, self.log_dir)
        self.config_path = self.log_dir / "tessera.toml"
        self.config_path.write_text(dump_toml(config))
        self.children: list[Child] = []
        self.quiet = quiet
        self._auth = ClusterAuth.from_config(config)
        tls = self._auth.client_ssl()
        self._tls = tls if isinstance(tls, ssl.SSLContext) else None

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    def _spawn(self, role: str, node: str, host: str, port: int, append: bool = False) -> Child:
        # a supervised restart appends to the role's log (a fresh start begins a new one);
        # the child dies with the launcher
        child = spawn_role(role, None if role == "retrieval" and node == "main" else node, self.config_path,
                           self.log_dir / f"{role}-{node}.log", f"{self.config.scheme}://{host}:{port}",
                           append=append, die_with_parent=True, log_level=self.log_level,
                           prefix=self._prefix(role, node))
        self.children.append(child)
        return child

    def _prefix(self, role: str, node: str) -> Sequence[str]:
        """The command a role's process is started through (none here; a host's namespace in tessera_lab/hosts)."""
        return ()

    def _check_ports(self) -> None:
        """PortInUse for a listener's port another process of this machine holds."""
        check_free(self.config)

    def _wait(self, children: list[Child], timeout: float, path: str | None = None) -> None:
        """Until every child's health check (``path``, else its own) answers 200; each is announced
        when it first does."""
        say = None if path else (lambda c: self._say(f"  {c.role:<10} {c.node:<6} ready at {c.url}"))
        try:
            wait_healthy(children, timeout, context=self._tls, on_ready=say, path=path)
        except ClusterError as exc:
            raise ClusterError(f"{exc}; logs in {self.log_dir}") from None

    def leader_url(self) -> str | None:
        """The internal URL of the replica whose control plane answers (the leader's; 503 elsewhere)."""
        for _, internal in replica_urls(self.config):
            url = internal + "/control/stats"
            # the control plane's stats are internal: the launcher signs like any role
            req = urllib.request.Request(url, headers=self._auth.headers("GET", url))
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError), \
                    urllib.request.urlopen(req, timeout=1.0, context=self._tls) as resp:
                if resp.status == 200:
                    return internal
        return None

    def _wait_heard(self, names: list[str], timeout: float) -> None:
        """Until the control plane (the leader's, with replicas) heard every generation node."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.leader_url()
            url = f"{leader}/control/stats"
            req = urllib.request.Request(url, headers=self._auth.headers("GET", url))
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError), \
                    urllib.request.urlopen(req, timeout=1.0, context=self._tls) as resp:
                nodes = json.loads(resp.read()).get("nodes", {})
                if leader is not None and all(nodes.get(name, {}).get("alive") for name in names):
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"the control plane has not heard from {', '.join(names)} after {timeout:.0f}s; "
                                   f"logs in {self.log_dir}")
            time.sleep(0.1)

    def start(self, timeout: float = 180.0) -> None:
        cfg = self.config
        try:
            # a busy port fails here, in a second, rather than as a role that never reports in
            self._check_ports()
            # convert the checkpoint once here, not concurrently in every child
            resolve(cfg.model)
        except TesseraError as exc:
            raise ClusterError(str(exc)) from None
        self._say(f"starting tessera cluster (logs in {self.log_dir}; cluster secret {cfg.security.secret_file})")
        if not cfg.security.keys_file:
            self._say(f"  no API keys (security.keys_file): the API at {cfg.retrieval_url} is open to every "
                      "process on this machine; set keys before exposing it")
        try:
            self._wait([self._spawn("retrieval", name, *self._endpoint("retrieval", name))
                        for name in self.replicas()], timeout)
            self._wait([self._spawn("kvpool", n.name, n.host, n.port) for n in cfg.kvpools], timeout)
            self._wait([self._spawn("generation", n.name, n.host, n.port) for n in cfg.generation], timeout)
            self._wait_heard([n.name for n in cfg.generation], timeout)
            # started means served: every replica's /health says a chat can go through it
            self._wait([c for c in self.children if c.role == "retrieval"], timeout, path="/health/ready")
        except BaseException:
            self.stop()
            raise

    def restart(self, role: str, node: str = "main", *, crash: bool = True, timeout: float = 120.0) -> Child:
        """Stop one child (SIGKILL if ``crash``, else SIGTERM and drain) and start it again."""
        old = next(c for c in self.children if c.role == role and c.node == node)
        if old.proc.poll() is None:
            if crash:
                old.proc.kill()
            else:
                old.proc.send_signal(signal.SIGTERM)
            old.proc.wait(timeout)
        old.log_file.close()
        self.children.remove(old)
        host, port = self._endpoint(role, node)
        old.log_path.rename(old.log_path.with_suffix(f".{len(self.children)}.{time.monotonic_ns()}.log"))
        child = self._spawn(role, node, host, port)
        child.restarts = old.restarts + 1
        self._wait([child], timeout)
        return child

    def alive(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is None]

    def replicas(self) -> list[str]:
        """The retrieval processes' node names: "main" alone, or r0, r1, ... with ``ha.replicas`` > 1."""
        n = self.config.ha.replicas
        return ["main"] if n == 1 else [replica_name(i) for i in range(n)]

    def _endpoint(self, role: str, node: str) -> tuple[str, int]:
        if role == "retrieval":
            r = replica_config(self.config, replica_index(self.config, node)).retrieval
            return r.host, r.port
        n = self.config.kvpool_node(node) if role == "kvpool" else self.config.generation_node(node)
        return n.host, n.port

    def restart_child(self, child: Child, wait_timeout: float | None = None) -> Child:
        """Start ``child``'s role again in place of the old process (killed first if still running).

        Unlike :meth:`restart` the role's log continues in the same file (supervision, chaos).
        """
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()
        child.log_file.close()
        self.children.remove(child)
        new = self._spawn(child.role, child.node, *self._endpoint(child.role, child.node), append=True)
        new.restarts = child.restarts + 1
        if wait_timeout is not None:
            self._wait([new], wait_timeout)
        return new

    def supervise(self, stopping: Callable[[], bool], poll_s: float = 0.2) -> None:
        """Until ``stopping()``: start again every role that exited, with exponential backoff."""
        due: dict[int, float] = {}  # id(child) -> when to start it again
        delay: dict[tuple[str, str], float] = {}
        while not stopping():
            now = time.monotonic()
            for child in list(self.children):
                if child.proc.poll() is None:
                    continue
                key = (child.role, child.node)
                if id(child) not in due:
                    first, cap = RESTART_BACKOFF_S
                    lived = now - child.started_at
                    wait = first if lived >= STABLE_AFTER_S else min(cap, delay.get(key, first / 2) * 2)
                    delay[key] = wait
                    due[id(child)] = now + wait
                    self._say(f"  {child.role} {child.node} exited with code {child.proc.returncode} after "
                              f"{lived:.0f}s; starting it again in {wait:.1f}s (log {child.log_path})")
                elif now >= due[id(child)]:
                    del due[id(child)]
                    self.restart_child(child)
            time.sleep(poll_s)

    def stop(self, timeout: float = 20.0) -> None:
        for child in reversed(self.children):
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._say(f"  {child.role} {child.node} did not stop in {timeout:.0f}s; killing it")
                    child.proc.kill()
                    child.proc.wait()
            child.log_file.close()
        self.children.clear()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def with_persistent_data(config: ClusterConfig, data_dir: Path | None) -> ClusterConfig:
    """``data_dir``, else ``retrieval.data_dir``, else ``$XDG_DATA_HOME/tessera/default`` as the store's folder.

    A store you ingest into survives ``tessera up`` twice in a row.
    """
    if data_dir is None and config.retrieval.data_dir:
        return config
    home = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    chosen = data_dir or home / "tessera" / "default"
    return dataclasses.replace(config, retrieval=dataclasses.replace(config.retrieval, data_dir=str(chosen)))


def with_overrides(config: ClusterConfig, *, host: str | None = None, port: int | None = None,
                   model: str | None = None, served_name: str | None = None) -> ClusterConfig:
    """``config`` with ``tessera up``'s flags applied (each one overrides one config field)."""
    r, m = config.retrieval, config.model
    retrieval = dataclasses.replace(r, host=r.host if host is None else host, port=r.port if port is None else port)
    model_cfg = dataclasses.replace(m, source=m.source if model is None else model,
                                    served_name=m.served_name if served_name is None else served_name)
    return dataclasses.replace(config, retrieval=retrieval, model=model_cfg)


def serve(config: ClusterConfig, log_dir: Path | None, log_level: str = "info") -> int:
    """``tessera up``: start every role, keep them up until SIGINT/SIGTERM, then stop; the exit code."""
    print(f"tessera up: units persist in {config.retrieval.data_dir}", flush=True)
    cluster = LocalCluster(config, log_dir=log_dir, log_level=log_level)
    try:
        cluster.start()
    except ClusterError as exc:
        print(f"tessera up: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"tessera is up: OpenAI-compatible API at {config.retrieval_url}/v1 (model {config.model.served_name!r}; "
          f"metrics at {config.retrieval_url}/metrics). Ctrl-C stops every role.", flush=True)
    for i, (public, _) in enumerate(replica_urls(config)[1:], start=1):
        print(f"  replica r{i} serves the same API at {public}/v1 (one replica leads the control plane; "
              "any of them answers)", flush=True)
    supervise_until_signalled(cluster, "stopping tessera (draining in-flight requests)...")
    return 0


def supervise_until_signalled(cluster: LocalCluster, farewell: str) -> None:
    """Keep ``cluster`` up until SIGINT/SIGTERM, then say ``farewell`` and stop it.

    A role that exits meanwhile is started again (with backoff); only a signal stops the cluster.
    """
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.supervise(lambda: stop)
    finally:
        print(farewell, file=sys.stderr, flush=True)
        cluster.stop()
