"""Shared test helpers: free ports, temp configs, real role processes on loopback."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tessera.auth import ClusterAuth, create_secret
from tessera.config import ClusterConfig
from tessera.config_file import dump_toml

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@functools.cache
def shared_secret_file() -> Path:
    """One cluster secret (0600) for every test cluster of this pytest process."""
    path = Path(tempfile.mkdtemp(prefix="tessera-test-")) / "cluster.secret"
    create_secret(path)
    return path


def with_secret(config: ClusterConfig) -> ClusterConfig:
    """``config`` with the tests' cluster secret and a free internal port."""
    return dataclasses.replace(
        config, security=dataclasses.replace(config.security, secret_file=str(shared_secret_file())),
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
    """Environment for child processes: import this checkout, never reach for a hub."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class RoleProcess:
    """One ``tessera run --role ...`` process with its output captured to a log file."""

    def __init__(self, role: str, config_path: Path, node: str | None = None, log_dir: Path | None = None) -> None:
        self.role = role
        self.node = node
        log_dir = log_dir or config_path.parent
        self.log_path = log_dir / f"{role}-{node or 'main'}.log"
        cmd = [sys.executable, "-m", "tessera", "run", "--role", role, "--config", str(config_path)]
        if node:
            cmd += ["--node", node]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=1.0) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"{self.role} not healthy at {url} after {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait for a clean drain; SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@contextlib.contextmanager
def running(role: str, config_path: Path, url: str, node: str | None = None, timeout: float = 60.0) -> Iterator[RoleProcess]:
    proc = RoleProcess(role, config_path, node)
    try:
        proc.wait_healthy(url, timeout)
        yield proc
    finally:
        proc.stop()
