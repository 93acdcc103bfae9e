"""Replaying captured internal requests, against real generation and memory-node processes.

The attacker sees signed requests on the wire (no TLS) but does not hold the cluster secret.
It sends a request captured on its way to one listener, byte for byte, to another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from helpers.cluster import free_port, write_config
from helpers.kvpool import PoolConfig
from helpers.processes import MemoryNodeProcess, RoleProcess

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig, GenerationNodeConfig
from tessera.wire import WIRE_VERSION


@dataclasses.dataclass
class Listeners:
    config: ClusterConfig
    gen0: str
    gen1: str
    kv0: str


@pytest.fixture(scope="module")
def listeners(tmp_path_factory: pytest.TempPathFactory, pool_config: PoolConfig,
              tiny_model: Path) -> Iterator[Listeners]:
    """Generation nodes gen0 and gen1 (tiny model) and memory node kv0, one cluster secret; no retrieval role."""
    directory = tmp_path_factory.mktemp("replay")
    config = pool_config(directory, model_source=str(tiny_model))
    config = dataclasses.replace(config, generation=(GenerationNodeConfig("gen0", port=free_port()),
                                                     GenerationNodeConfig("gen1", port=free_port())))
    path = write_config(directory, config)
    gens = [RoleProcess("generation", path, n.name) for n in config.generation]
    try:
        with MemoryNodeProcess.started(config, directory) as kv0:
            urls = [f"http://{n.host}:{n.port}" for n in config.generation]
            for proc, url in zip(gens, urls, strict=True):
                proc.wait_healthy(url, timeout=120)
            yield Listeners(config, urls[0], urls[1], kv0.url)
    finally:
        for proc in gens:
            proc.stop()


async def send(url: str, headers: dict[str, str], body: bytes) -> tuple[int, Any]:
    """Send exactly these headers and body (a captured request, replayed)."""
    async with aiohttp.ClientSession() as s, s.post(url, data=body, headers=headers) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if raw.startswith(b"{") else raw.decode(errors="replace")


def captured(listeners: Listeners, url: str, body: bytes) -> dict[str, str]:
    """The headers a cluster process sends with ``body`` to ``url``: what the attacker captures."""
    return {"Content-Type": "application/json", **ClusterAuth.from_config(listeners.config).headers("POST", url, body)}


@pytest.mark.parametrize("path", ["/v1/snapshot", "/v1/abort"])
async def test_a_request_captured_for_one_node_is_refused_by_every_other_listener(listeners: Listeners,
                                                                                  path: str) -> None:
    """Regression: /v1/snapshot captured for gen0 was a 200 on gen1, and /v1/abort a 200 on both."""
    body = orjson.dumps({"version": WIRE_VERSION, "request_id": f"r-{path[4:]}", "unit_ids": []})
    headers = captured(listeners, listeners.gen0 + path, body)
    status, out = await send(listeners.gen0 + path, headers, body)
    assert status == 200, out  # the genuine request, at the node it was signed for
    for other in (listeners.gen1, listeners.kv0):  # another generation node; another role
        status, out = await send(other + path, headers, body)
        assert status == 401 and "another listener" in out["error"], (other, status, out)
    status, out = await send(listeners.gen0 + path, headers, body)  # at its own node: a replay
    assert status == 401 and "replayed" in out["error"]


async def test_a_request_replayed_elsewhere_before_its_target_sees_it_is_refused(listeners: Listeners) -> None:
    """An attacker that is faster than the genuine request still gets a 401 from gen1 (no nonce is spent there)."""
    body = orjson.dumps({"version": WIRE_VERSION, "request_id": "r-early"})
    headers = captured(listeners, listeners.gen0 + "/v1/abort", body)
    status, out = await send(listeners.gen1 + "/v1/abort", headers, body)
    assert status == 401 and "another listener" in out["error"]
    assert (await send(listeners.gen0 + "/v1/abort", headers, body))[0] == 200  # the genuine one still works


def test_a_request_captured_before_a_node_restarted_is_refused_by_the_new_process(
        tmp_path: Path, pool_config: PoolConfig) -> None:
    """Regression: the nonce cache is per process, so a signed request captured (and accepted) before a
    memory node restarted was accepted again by the restarted node within the 30 s skew window."""
    import time
    import urllib.error
    import urllib.request

    config = pool_config(tmp_path)
    node = config.kvpools[0]
    url = f"http://{node.host}:{node.port}/info"
    headers = ClusterAuth.from_config(config).headers("GET", url)

    def replay() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.read().decode()

    signed_at = time.time()
    with MemoryNodeProcess.started(config, tmp_path):
        assert replay()[0] == 200  # the genuine request
        status, out = replay()
        assert status == 401 and "replayed" in out, out
    time.sleep(max(0.0, signed_at + 3.0 - time.time()))  # the restart comes later than the grace
    with MemoryNodeProcess.started(config, tmp_path):
        status, out = replay()
        assert status == 401 and "before this listener started" in out, out
