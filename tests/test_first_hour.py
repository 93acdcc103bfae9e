"""What cost a newcomer their first hour: busy ports, crashing commands, missing flags.

Each test pins one such bug; the commands of the README and docs/ themselves are checked by
``test_readme_commands.py``.
"""

from __future__ import annotations

import dataclasses
import http.server
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from helpers.cluster import REPO, cluster_config
from typer.testing import CliRunner

from tessera.benchmark import targets
from tessera.cli import app
from tessera.config import ClusterConfig
from tessera.config_file import dump_toml, load_config
from tessera.launcher import ClusterError, LocalCluster, spawn_role, wait_healthy
from tessera.messages.generation import RequestStats
from tessera.ports import on_free_ports
from tessera_lab.chaos.harness import ChaosOptions, ChaosRun

PYTHON = sys.executable


@pytest.fixture
def held_port() -> Iterator[tuple[socket.socket, int]]:
    """A port this test process listens on, as another cluster would."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock, int(sock.getsockname()[1])
    finally:
        sock.close()


def _tessera(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([PYTHON, "-m", "tessera", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


# --- busy ports -------------------------------------------------------------------------------


def test_tessera_up_on_a_busy_port_fails_at_once_naming_the_port_and_its_holder(
        held_port: tuple[socket.socket, int], tmp_path: Path) -> None:
    """Regression: with another cluster on the ports every role looked "ready" and start-up failed after 180 s."""
    _, port = held_port
    cfg = cluster_config()
    cfg = dataclasses.replace(cfg, retrieval=dataclasses.replace(cfg.retrieval, port=port))
    cluster = LocalCluster(cfg, log_dir=tmp_path, quiet=True)
    with pytest.raises(ClusterError, match=rf"port {port} on 127.0.0.1 \(retrieval\) is in use by pid {os.getpid()}"):
        cluster.start(timeout=30)
    assert not cluster.children  # nothing was started


def test_a_role_whose_port_is_held_exits_before_loading_its_model(held_port: tuple[socket.socket, int],
                                                                   tmp_path: Path) -> None:
    """Regression: a generation node loaded its model, then failed with only "address already in use"."""
    _, port = held_port
    cfg = cluster_config(nodes=1)
    cfg = dataclasses.replace(cfg, generation=(dataclasses.replace(cfg.generation[0], port=port),))
    path = tmp_path / "tessera.toml"
    path.write_text(dump_toml(cfg))
    child = spawn_role("generation", "gen0", path, tmp_path / "gen0.log", f"http://127.0.0.1:{port}")
    try:
        assert child.proc.wait(60) == 3
    finally:
        child.log_file.close()
    log = child.tail()
    assert f"port {port} on 127.0.0.1 (generation gen0) is in use by pid {os.getpid()}" in log, log
    assert "loading" not in log.lower(), log  # it failed before the engine started loading


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status": "ready"}')

    def log_message(self, *args: object) -> None:
        pass


def test_a_health_answer_from_another_process_is_not_our_role_being_ready(tmp_path: Path) -> None:
    """Regression: the launcher trusted a /health 200 that another cluster answered on the role's port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    child = spawn_role("kvpool", None, tmp_path / "missing.toml", tmp_path / "kv.log",
                       f"http://127.0.0.1:{server.server_address[1]}")
    child.proc.kill()  # a stand-in child that never binds: only the other server answers
    child.proc.wait()
    child.proc = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(ClusterError, match="not healthy"):
            wait_healthy([child], timeout=2.0)
    finally:
        child.proc.kill()
        child.proc.wait()
        child.log_file.close()
        server.shutdown()
        server.server_close()


def _ports(cfg: ClusterConfig) -> list[int]:
    r = cfg.retrieval
    return [r.port, r.internal_port, *(p for kv in cfg.kvpools for p in (kv.port, kv.data_port)),
            *(g.port for g in cfg.generation)]


def test_bench_and_demo_clusters_take_ports_of_their_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Regression: every bench and the demo started on the configured ports, so none ran beside a cluster."""
    seen: list[ClusterConfig] = []

    class Stop(Exception):
        pass

    class Recording:
        def __init__(self, config: ClusterConfig, **_: object) -> None:
            seen.append(config)
            raise Stop

    monkeypatch.setattr(targets, "LocalCluster", Recording)
    base = load_config()
    import asyncio

    async def open_fresh_cluster() -> None:
        target = targets.FreshCluster(base, None, {})  # type: ignore[arg-type]  # never ingests: start stops
        async with target.open(tmp_path, False):
            pass

    with pytest.raises(Stop):
        asyncio.run(open_fresh_cluster())
    chaos = ChaosRun(base, ChaosOptions(), tmp_path)
    for cfg in (seen[0], chaos.config):
        assert not set(_ports(cfg)) & set(_ports(base))
        assert len(set(_ports(cfg))) == len(_ports(cfg))  # every listener its own port


# --- one-line errors --------------------------------------------------------------------------


def test_a_bad_model_source_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Regression: `tessera up` with a bad model.source printed a traceback."""
    # every port a free one: the default ones may be held by a cluster serving on this machine
    config = tmp_path / "tessera.toml"
    config.write_text(dump_toml(on_free_ports(load_config())))
    done = _tessera("up", "--config", str(config), "--model", str(tmp_path / "missing"), "--log-dir", str(tmp_path),
                    "--data-dir", str(tmp_path / "data"))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "model.source" in done.stderr, done.stderr


def test_verify_with_a_missing_prompts_file_is_one_line() -> None:
    """Regression: `tessera verify --prompts missing.jsonl` loaded the model, then printed a traceback."""
    done = _tessera("verify", "--prompts", "missing.jsonl")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "--prompts missing.jsonl: cannot be read" in done.stderr, done.stderr


def test_evals_missing_data_error_does_not_offer_a_workload_eval_refuses(tmp_path: Path) -> None:
    """Regression: eval's error suggested --workload synthetic, which eval then refused."""
    result = CliRunner().invoke(app, ["eval", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "--data-dir" in result.output and "synthetic" not in result.output, result.output
    result = CliRunner().invoke(app, ["bench", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--workload synthetic" in result.output, result.output


# --- keys_file beside its config --------------------------------------------------------------


def test_a_relative_keys_file_is_read_beside_its_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a relative keys_file resolved against the working directory, unlike `base =`."""
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    (deploy / "tessera.toml").write_text('base = "default"\n[security]\nkeys_file = "keys.toml"\n')
    monkeypatch.chdir(tmp_path)
    assert load_config("deploy/tessera.toml").security.keys_file == str(deploy / "keys.toml")


# --- access log -------------------------------------------------------------------------------


async def test_the_access_log_has_one_line_per_request_with_status_ttft_and_tiers(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every public request logs its status and duration; a chat request also its TTFT and tokens per tier."""
    import time

    from tessera.retrieval.access_log import access_middleware, note_outcome

    async def chat(request: web.Request) -> web.Response:
        note_outcome(RequestStats(prompt_tokens=40, local_tokens=24, computed_unit_tokens=8, node_queued_s=0.5,
                                  node_first_token_s=0.75), time.perf_counter(), "gen1")
        return web.json_response({})

    async def missing(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    app = web.Application(middlewares=[access_middleware("info")])
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/units/x", missing)
    caplog.set_level(logging.INFO, "tessera.access")
    async with TestClient(TestServer(app)) as client:
        assert (await client.post("/v1/chat/completions")).status == 200
        assert (await client.get("/v1/units/x")).status == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "tessera.access"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("POST /v1/chat/completions 200 ") and " ttft " in lines[0]
    assert "prompt 40 tok: prefix 0 local 24 remote 0 computed 8" in lines[0], lines[0]
    assert lines[0].endswith("; node queued 0.500s, first token 0.750s on gen1"), lines[0]  # which node served it
    assert lines[1].startswith("GET /v1/units/x 404 "), lines[1]


def test_the_access_log_level_is_configurable() -> None:
    """`retrieval.access_log` takes debug, info, warning or off; anything else names the choices."""
    from tessera.config import RetrievalConfig
    from tessera.errors import ConfigError

    assert RetrievalConfig(access_log="off").access_log == "off"
    with pytest.raises(ConfigError, match=r"retrieval\.access_log"):
        RetrievalConfig(access_log="loud")


# --- flags of vLLM / SGLang users -------------------------------------------------------------


def test_version_flag_prints_the_version() -> None:
    from tessera import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"tessera {__version__}"


def test_up_takes_host_port_model_served_name_and_log_level() -> None:
    """`tessera up --help` lists the flags a vLLM user reaches for; each overrides one config field."""
    from tessera.launcher import with_overrides

    result = CliRunner().invoke(app, ["up", "--help"])
    for flag in ("--host", "--port", "--model", "--served-model-name", "--log-level"):
        assert flag in result.output, flag
    cfg = with_overrides(load_config(), host="127.0.0.2", port=9000, model="random:tiny", served_name="smol")
    assert (cfg.retrieval.host, cfg.retrieval.port, cfg.model.source, cfg.model.served_name) == \
        ("127.0.0.2", 9000, "random:tiny", "smol")


# --- documented commands that crashed ---------------------------------------------------------


def test_bench_fidelity_runs_with_float16_states() -> None:
    """Regression: `python bench/fidelity.py` raised PlacementError (float16 states, float32 engine)."""
    done = subprocess.run([PYTHON, "bench/fidelity.py", "--questions", "1", "--passages", "1", "--passage-tokens",
                           "16", "--ks", "4", "--continue-tokens", "2", "--layouts", "plain"],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| plain | epic k=4 | float16 |" in done.stdout


def test_gpu_sh_smoke_runs_on_a_fresh_clone(tmp_path: Path) -> None:
    """Regression: `bench/gpu.sh smoke` exited 1 silently under set -e when .gpu/data was missing."""
    if (REPO / ".gpu" / "data").exists():
        pytest.skip("this checkout has .gpu/data (bench/gpu.sh prepare ran): not a fresh clone")
    env = dict(os.environ, PYTHON=PYTHON, OUT=str(tmp_path), GPU_BENCH_ARGS="--sections prefill --lengths 32")
    done = subprocess.run(["bash", "bench/gpu.sh", "smoke"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert (tmp_path / "summary.json").is_file()
