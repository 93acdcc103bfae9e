"""The memory node role: arena sizing, endpoints, heartbeats, clean and unclean exits."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from helpers.cluster import child_env, write_config
from helpers.kvpool import HANG_GUARD_S, PoolConfig, tiny_layout
from helpers.processes import MemoryNodeProcess, StartMemoryNode

from tessera.auth import ClusterAuth, term_notice
from tessera.config import ControlConfig
from tessera.control.plane import ControlPlane
from tessera.control.routes import add_control_routes
from tessera.http import application
from tessera.messages.kvpool import MemoryNodeHello
from tessera.transport.arena import ARENA_HEADER_BYTES, SHM_DIR
from tessera.wire import from_wire


async def _until(condition: Callable[[], bool], what: str, proc: subprocess.Popen[Any] | None = None) -> None:
    """Until ``condition`` holds; fails at once if ``proc`` exits, and at the hang guard otherwise."""
    deadline = time.monotonic() + HANG_GUARD_S  # a guard against hanging only; never a time being measured
    while not condition():
        assert proc is None or proc.poll() is None, f"the memory node exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)



def run_to_exit(config_path: Path, node: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tessera", "run", "--role", "kvpool", "--config", str(config_path), "--node", node]
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=timeout)


def test_info_describes_the_arena_sized_from_the_model_geometry(tmp_path: Path, pool_config: PoolConfig,
        memory_node: StartMemoryNode) -> None:
    """Slots of B tokens of K and V for all layers (+ header); capacity from the config."""
    config = pool_config(tmp_path, capacity=32)
    with memory_node(config, tmp_path) as node:
        ep = node.endpoint()
        assert (ep.name, ep.capacity_blocks, ep.slot_bytes) == ("kv0", 32, tiny_layout().slot_bytes)
        assert ep.data_port == config.kvpools[0].data_port and ep.engine_session == ""
        segment = SHM_DIR / ep.shm_name
        assert segment.stat().st_size == ARENA_HEADER_BYTES + 32 * ep.slot_bytes
        assert ep.boot_id in (SHM_DIR / ep.shm_name).read_bytes()[:64].decode(errors="replace")
    assert not segment.exists(), "a clean shutdown unlinks the segment"


def test_a_node_that_cannot_allocate_its_arena_refuses_to_start(tmp_path: Path, pool_config: PoolConfig) -> None:
    """Asking for more than /dev/shm holds exits non-zero with a message saying what to change."""
    config = pool_config(tmp_path, capacity=1 << 40)
    result = run_to_exit(write_config(tmp_path, config), "kv0")
    assert result.returncode == 2
    assert "cannot allocate the kvpool arena" in result.stderr and "capacity_blocks" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_node_name_is_refused(tmp_path: Path, pool_config: PoolConfig) -> None:
    result = run_to_exit(write_config(tmp_path, pool_config(tmp_path)), "kv9")
    assert result.returncode == 2 and "no kvpool node named 'kv9'" in result.stderr


def test_a_crashed_nodes_segment_is_swept_when_it_starts_again(tmp_path: Path, pool_config: PoolConfig,
        memory_node: StartMemoryNode) -> None:
    """SIGKILL leaves the segment behind; the next start of that node removes it."""
    config = pool_config(tmp_path)
    path = write_config(tmp_path, config)
    crashed = MemoryNodeProcess(config, path, "kv0")
    leftover = SHM_DIR / crashed.wait_healthy().shm_name
    crashed.proc.kill()
    assert leftover.exists()
    with memory_node(config, tmp_path) as node:
        assert node.endpoint().shm_name != leftover.name
        assert not leftover.exists()


async def test_the_node_says_hello_with_a_new_boot_id_each_start_and_keeps_beating(tmp_path: Path,
        pool_config: PoolConfig, memory_node: StartMemoryNode) -> None:
    """Registration and heartbeat are the same MemoryNodeHello; a restart changes only boot_id."""
    hellos: list[MemoryNodeHello] = []

    async def hello(request: web.Request) -> web.Response:
        hellos.append(from_wire(MemoryNodeHello, orjson.loads(await request.read())))
        return web.json_response({"version": 1, "ok": True, "reason": "heartbeat"})

    config = pool_config(tmp_path)
    config = dataclasses.replace(config, control=ControlConfig(heartbeat_timeout_s=0.3))
    app = web.Application()
    app.router.add_post("/control/kvpool/hello", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, config.retrieval.internal_host, config.retrieval.internal_port).start()
    try:
        boots = []
        for _ in range(2):
            with memory_node(config, tmp_path) as node:
                ep = await asyncio.to_thread(node.endpoint)
                boot = ep.boot_id
                await _until(lambda: sum(h.boot_id == boot for h in hellos) >= 3, "three hellos",  # noqa: B023
                             node.proc.proc)
                mine = [h for h in hellos if h.boot_id == ep.boot_id]
                assert len(mine) >= 3 and len(set(mine)) == 1, "heartbeats repeat the same hello"
                assert (mine[0].name, mine[0].shm_name, mine[0].block_bytes) == ("kv0", ep.shm_name, ep.slot_bytes)
                assert (mine[0].data_host, mine[0].data_port, mine[0].capacity_blocks) == (
                    ep.data_host, ep.data_port, ep.capacity_blocks)
                boots.append(ep.boot_id)
        assert boots[0] != boots[1]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("status", [500, None])
async def test_an_absent_or_failing_control_plane_does_not_stop_the_node(tmp_path: Path, status: int | None,
        pool_config: PoolConfig, memory_node: StartMemoryNode) -> None:
    """The node serves its arena and keeps trying to say hello."""
    config = pool_config(tmp_path)
    runner = None
    if status is not None:
        async def failing(_: web.Request) -> web.Response:
            return web.Response(status=status, text="boom")

        app = web.Application()
        app.router.add_post("/control/kvpool/hello", failing)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, config.retrieval.internal_host, config.retrieval.internal_port).start()
    try:
        with memory_node(config, tmp_path) as node:
            await _until(lambda: "control plane unreachable" in node.proc.log(), "the unreachable warning",
                         node.proc.proc)
            assert "control plane unreachable" in node.proc.log()
            assert node.proc.proc.poll() is None
            assert (await asyncio.to_thread(node.endpoint)).name == "kv0"
    finally:
        if runner is not None:
            await runner.cleanup()


# --- the leader's term, from the hello answer (the restart fence ends by term) ------------------


async def _serve(app: web.Application, config: Any) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, config.retrieval.internal_host, config.retrieval.internal_port).start()
    return runner


async def test_a_memory_node_takes_the_leader_term_only_under_a_valid_mac(tmp_path: Path,
        pool_config: PoolConfig, memory_node: StartMemoryNode) -> None:
    """An answer forging a term (no secret, so no valid MAC) is ignored: the node reports no settled
    term; the plane's signed term (the MAC of its node and boot) is taken and reported back."""
    hellos: list[MemoryNodeHello] = []
    config = pool_config(tmp_path)
    config = dataclasses.replace(config, control=ControlConfig(heartbeat_timeout_s=0.3))
    secret = ClusterAuth.from_config(config).secret
    assert secret is not None
    term = 7
    forged = {"on": True}

    async def hello(request: web.Request) -> web.Response:
        msg = from_wire(MemoryNodeHello, orjson.loads(await request.read()))
        hellos.append(msg)
        mac = "00" * 32 if forged["on"] else term_notice(secret, msg.name, msg.boot_id, term)
        return web.json_response({"version": 1, "ok": True, "reason": "heartbeat", "term": term, "term_mac": mac})

    app = application([ClusterAuth.from_config(config).middleware(
        config.retrieval.internal_host, config.retrieval.internal_port, body_timeout_s=5.0)])
    app.router.add_post("/control/kvpool/hello", hello)
    runner = await _serve(app, config)
    try:
        with memory_node(config, tmp_path) as node:
            await _until(lambda: len(hellos) >= 4, "four hellos")
            assert {h.term_settled for h in hellos} == {0}
            assert "does not verify" in node.proc.log()
            forged["on"] = False
            seen = len(hellos)
            await _until(lambda: any(h.term_settled == term for h in hellos[seen:]), "the term reported settled")
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_restarted_planes_fence_ends_once_the_memory_node_refuses_older_terms(
        tmp_path: Path, transport: str, pool_config: PoolConfig, memory_node: StartMemoryNode) -> None:
    """Regression: after a restart or a failover the plane fenced every memory node for the
    longest lifetime of an earlier grant (~40 s here): no shared-tier write, no re-adoption. On tcp with a
    secret the node refuses every capability of an older term once the new plane's signed term reached
    it and no older write is still arriving: its next hello says so and the fence ends, every slot free.
    On shm the writer touches the arena itself, nothing checks terms there, and the fence stays."""
    config = pool_config(tmp_path, transport=transport)
    config = dataclasses.replace(config, control=ControlConfig(heartbeat_timeout_s=0.3, write_timeout_s=30.0,
                                                               lease_ttl_s=30.0))
    plane = ControlPlane(config)
    plane.begin_incarnation(2)  # the second start of this data directory: a term above the first's
    app = application([ClusterAuth.from_config(config).middleware(
        config.retrieval.internal_host, config.retrieval.internal_port, body_timeout_s=5.0)])
    add_control_routes(app, plane)
    runner = await _serve(app, config)
    try:
        with memory_node(config, tmp_path) as node:
            await _until(lambda: "kv0" in {h.name for h in plane.memory_nodes()}, "kv0 joined")
            if transport == "tcp":
                await _until(lambda: plane.report()["fences_lifted_by_term"] == 1, "the fence lifted by term")
                assert plane.directory.fenced_for("kv0") == 0
                assert plane.allocator.free_blocks == plane.allocator.capacity  # every slot back
                assert "refused hello" not in node.proc.log() and "unreachable" not in node.proc.log()
            else:
                hellos = plane.memory.hellos  # the plane keeps beating with it: still fenced
                await asyncio.sleep(1.0)
                assert hellos() and plane.report()["fences_lifted_by_term"] == 0
                assert plane.directory.fenced_for("kv0") > 20
                assert plane.allocator.free_blocks == 0
    finally:
        await runner.cleanup()
