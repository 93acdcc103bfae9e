"""`tessera up --replicas 2`: local etcd and PostgreSQL, two retrieval replicas, chat on either, Ctrl-C stops all."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cluster import REPO, cluster_config, write_config
from helpers.http import call
from helpers.processes import process_group
from helpers.replicated import STRIDE, port_pair

from tessera.config import HAConfig
from tessera.ha.replicas import replica_config
from tessera.ha.servers import EtcdServer, PostgresServer


def _wait_for_line(proc: subprocess.Popen[str], out: Path, line: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while line not in out.read_text():
        assert proc.poll() is None, f"exited with {proc.returncode}: {out.read_text()}"
        assert time.monotonic() < deadline, f"no {line!r} after {timeout:.0f}s: {out.read_text()}"
        time.sleep(0.2)


def test_tessera_up_with_two_replicas_serves_chat_on_both_and_stops_on_ctrl_c(tiny_model: Path,
                                                                              tmp_path: Path) -> None:
    """Both replicas answer a chat request (one through the other's plane); Ctrl-C ends roles, etcd and PostgreSQL."""
    for missing in (EtcdServer.missing(), PostgresServer.missing()):
        if missing:
            pytest.skip(missing)
    cfg = cluster_config(str(tiny_model), nodes=1)
    cfg = dataclasses.replace(
        cfg, retrieval=dataclasses.replace(cfg.retrieval, port=port_pair(), internal_port=port_pair()),
        ha=HAConfig(replica_port_stride=STRIDE, lease_ttl_s=2, renew_margin_s=0.5))
    path = write_config(tmp_path, cfg)
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tessera", "up", "--config", str(path), "--replicas", "2",
                                 "--data-dir", str(tmp_path / "data"), "--log-dir", str(tmp_path / "logs")],
                                cwd=REPO, env=env, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
    with process_group(proc, ctrl_c_wait_s=90):
        _wait_for_line(proc, out, "replica r1 serves the same API")
        assert "started a local etcd" in out.read_text() and "started a local PostgreSQL" in out.read_text()
        body = {"model": "tessera", "messages": [{"role": "user", "content": "When does the ferry leave?"}],
                "max_tokens": 3, "temperature": 0,
                "context_units": ["The ferry leaves the harbour at nine every morning."]}
        answers = [call(replica_config(cfg, i).retrieval_url, "/v1/chat/completions", body) for i in (0, 1)]
        assert [s for s, _ in answers] == [200, 200], answers
        assert answers[0][1]["choices"][0]["message"] == answers[1][1]["choices"][0]["message"]
    assert proc.returncode == 0, (out.read_text(), err.read_text())
    assert "Traceback" not in err.read_text(), err.read_text()
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not leftover, f"processes of this run still alive: {leftover}"


@pytest.mark.slow  # ~40 s; the failover itself is tests/test_ha_failover.py, in the default run
def test_bench_failover_kills_the_leader_and_prints_its_figures(tiny_model: Path) -> None:
    """`python bench/failover.py`: one kill -9 round on the tiny model, tcp transport, prints its figures, all clean."""
    for missing in (EtcdServer.missing(), PostgresServer.missing()):
        if missing:
            pytest.skip(missing)
    done = subprocess.run([sys.executable, "bench/failover.py", "--model", str(tiny_model), "--rounds", "1",
                           "--rate", "3", "--settle", "2", "--transport", "tcp"],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    figures = dict(line.strip().removeprefix("total ").removeprefix("median ").split(": ")
                   for line in done.stdout.splitlines() if line.strip().startswith(("total", "median")))
    assert float(figures["fault_to_first_200_s"]) > 0, done.stdout
    for clean in ("connection_errors", "503_without_retry_after", "wrong_replies", "other_status"):
        assert figures[clean] == "0", done.stdout
