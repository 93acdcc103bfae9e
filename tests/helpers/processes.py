"""The role processes tests start: ``tessera run --role ...`` children with their output in a log file.

Tests get them from fixtures (``start_role``, ``memory_node``), which stop them at teardown; a
module-scoped fixture that needs one uses the class as a context manager.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

from helpers.cluster import child_env, signed_get, write_config
from tessera.config import ClusterConfig
from tessera.launcher import spawn_role, wait_healthy
from tessera.transport.arena import SHM_DIR
from tessera.transport.base import NodeEndpoint
from tessera.wire import from_wire


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` is in the stopped state (``T`` in /proc; a vanished one counts)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            # the state follows the parenthesised command name, which may itself hold spaces
            if (task / "stat").read_text().rpartition(")")[2].split()[0] not in ("T", "t"):
                return False
    return True


class RoleProcess:
    """One ``tessera run --role ...`` process (the launcher's own runner) with its output in a log file."""

    def __init__(self, role: str, config_path: Path, node: str | None = None, log_dir: Path | None = None) -> None:
        self.role = role
        self.node = node
        self.log_path = (log_dir or config_path.parent) / f"{role}-{node or 'main'}.log"
        self.child = spawn_role(role, node, config_path, self.log_path, url="", env=child_env())
        self.proc = self.child.proc

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, url: str, timeout: float = 60.0) -> None:
        self.child.url = url
        wait_healthy([self.child], timeout)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait for a clean drain; SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.child.log_file.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.child.log_file.close()


class MemoryNodeProcess:
    """A real ``tessera run --role kvpool`` process on loopback.

    As a context manager it is closed (stopped, its segment removed) when the block ends.
    """

    def __init__(self, config: ClusterConfig, config_path: Path, name: str) -> None:
        self.config = config
        self.node = config.kvpool_node(name)
        self.url = f"http://{self.node.host}:{self.node.port}"
        self.proc = RoleProcess("kvpool", config_path, name)
        self.shm_name = ""

    @classmethod
    def started(cls, config: ClusterConfig, directory: Path, name: str = "kv0") -> MemoryNodeProcess:
        """Node ``name`` of ``config`` started from ``directory/tessera.toml`` (written if absent), healthy."""
        path = directory / "tessera.toml"
        if not path.exists():
            write_config(directory, config)
        node = cls(config, path, name)
        try:
            node.wait_healthy()
        except BaseException:
            node.close()
            raise
        return node

    def wait_healthy(self, timeout: float = 60.0) -> NodeEndpoint:
        self.proc.wait_healthy(self.url, timeout)
        endpoint = self.endpoint()
        self.shm_name = endpoint.shm_name
        return endpoint

    def endpoint(self) -> NodeEndpoint:
        return from_wire(NodeEndpoint, json.loads(signed_get(self.config, f"{self.url}/info")))

    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP, and wait until every thread of the node is stopped: the signal is delivered
        asynchronously, and on a busy machine a thread may serve a request after kill() returns."""
        pid = self.proc.proc.pid
        self.proc.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not _all_threads_stopped(pid):
            assert time.monotonic() < deadline, f"{self.role} (pid {pid}) did not stop within {timeout_s}s"
            time.sleep(0.001)

    def resume(self) -> None:
        self.proc.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (no cleanup in the node; works on a paused node too, which must not run again)."""
        self.proc.kill()
        if self.shm_name:
            (SHM_DIR / self.shm_name).unlink(missing_ok=True)

    def stop(self) -> int:
        self.resume()
        return self.proc.stop()

    def close(self) -> None:
        """Stop the node if it still runs and remove its segment (a killed node leaves it behind)."""
        if self.proc.proc.poll() is None:
            self.stop()
        if self.shm_name:
            (SHM_DIR / self.shm_name).unlink(missing_ok=True)

    def __enter__(self) -> MemoryNodeProcess:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


# the fixtures' factories: ``start_role(role, config_path, node=None)``, ``memory_node(config, directory, name)``
StartRole = Callable[..., RoleProcess]
StartMemoryNode = Callable[..., MemoryNodeProcess]


@contextlib.contextmanager
def process_group(proc: subprocess.Popen[str], ctrl_c_wait_s: float,
                  on_kill: Callable[[], object] | None = None) -> Iterator[None]:
    """Run the body, then Ctrl-C ``proc``'s whole process group (it was started with
    ``start_new_session``) and wait for it; if the body failed or it did not exit, SIGKILL the
    group (then ``on_kill``, e.g. a cleanup command)."""
    try:
        yield
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(ctrl_c_wait_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if on_kill is not None:
                on_kill()
