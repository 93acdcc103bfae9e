"""``tessera up`` as a supervisor: restart with backoff, children die with it, stale arenas swept."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers.http import wait_for
from helpers.plane import plane_config

from tessera.launcher import Child, LocalCluster
from tessera.transport.arena import SHM_DIR, Arena, segment_name


class _SleepyCluster(LocalCluster):
    """A launcher whose roles are ``sleep`` processes: the supervision logic, without models."""

    def _spawn(self, role: str, node: str, host: str, port: int, append: bool = False) -> Child:
        log_path = self.log_dir / f"{role}-{node}.log"
        log_file = open(log_path, "ab" if append else "wb")  # noqa: SIM115 - closed by restart/stop
        proc = subprocess.Popen(["sleep", "60"], stdout=log_file, stderr=subprocess.STDOUT)
        child = Child(role, node, f"http://{host}:{port}", log_path, proc, log_file)
        self.children.append(child)
        return child


def test_a_role_that_exits_is_started_again_while_the_others_keep_running(tmp_path: Path) -> None:
    """Regression: one role's exit stopped the whole cluster; now only that role restarts (with backoff)."""
    cfg = plane_config(nodes=2)
    c = _SleepyCluster(cfg, log_dir=tmp_path, quiet=True)
    for n in cfg.generation:
        c._spawn("generation", n.name, n.host, n.port)
    gen0, gen1 = c.children
    os.kill(gen0.proc.pid, signal.SIGKILL)
    gen0.proc.wait()
    deadline = time.monotonic() + 20
    c.supervise(lambda: time.monotonic() > deadline or any(ch.restarts for ch in c.children), poll_s=0.05)
    restarted = next(ch for ch in c.children if ch.node == "gen0")
    assert restarted.restarts == 1 and restarted.proc.poll() is None and restarted.proc.pid != gen0.proc.pid
    assert gen1 in c.children and gen1.proc.poll() is None  # untouched
    c.stop(timeout=5)


_PARENT = """
import subprocess, sys, time
from tessera.launcher import _die_with_parent
child = subprocess.Popen(["sleep", "60"], preexec_fn=_die_with_parent)
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_children_die_with_a_killed_launcher() -> None:
    """Regression: after kill -9 of the launcher, its role processes kept running as orphans."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert parent.stdout is not None
    with parent.stdout:
        child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()

    def gone() -> bool:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{child_pid}/stat") as fh:  # a zombie waiting for init counts as gone
            return fh.read().split(")")[-1].split()[0] == "Z"

    wait_for(gone, timeout=10, what="the orphaned child to exit")


def test_a_dead_memory_nodes_segment_is_swept_when_any_memory_node_starts() -> None:
    """Regression: a killed node's segment stayed in /dev/shm until a node of the same name started."""
    ghost_boot = uuid.uuid4().hex
    ghost = Arena.create(segment_name("ghost" + ghost_boot[:6], ghost_boot), 64, 2, ghost_boot)
    path = SHM_DIR / ghost.name
    dead = subprocess.Popen(["true"])
    dead.wait()
    with open(path, "r+b") as fh:  # the owner process is gone, as after kill -9
        fh.seek(12)
        fh.write(struct.pack("<I", dead.pid))
    ghost._owner = False  # killed: nobody unlinks the segment
    ghost.close()
    assert path.exists()
    boot = uuid.uuid4().hex
    other = Arena.create(segment_name("kv7", boot), 64, 2, boot)
    try:
        assert not path.exists()
    finally:
        other.close()
