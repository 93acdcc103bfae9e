"""Calling a running cluster over HTTP: JSON calls, chat requests, metrics, waiting for a condition."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from helpers.cluster import signed_get
from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig
from tessera.listener import LINGER_S


def call(url: str, path: str, body: Any = None, raw: bytes | None = None,
         signed: ClusterConfig | None = None) -> tuple[int, Any]:
    """POST JSON (or GET when there is no body); returns (status, parsed body or text).

    ``signed``: call as a process of that cluster (the internal plane needs its secret).
    """
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    if signed is not None:
        headers |= ClusterAuth.from_config(signed).headers("GET" if data is None else "POST", url + path, data or b"")
    req = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            payload = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        payload, status = exc.read(), exc.code
    try:
        return status, json.loads(payload)
    except json.JSONDecodeError:
        return status, payload.decode(errors="replace")


def chat(url: str, units: list[str], question: str = "What do the records say?", **extra: Any) -> dict[str, Any]:
    body = {"model": "tessera", "messages": [{"role": "system", "content": "Answer briefly."},
                                             {"role": "user", "content": question}],
            "context_units": units, "max_tokens": 6, "temperature": 0, "return_layout": True,
            "logprobs": True, "top_logprobs": 5, **extra}
    status, payload = call(url, "/v1/chat/completions", body)
    assert status == 200, payload
    return payload  # type: ignore[no-any-return]


def metrics_text(url: str, config: ClusterConfig | None = None) -> str:
    """A role's Prometheus text; pass the cluster's config (with its secret) for a generation node's."""
    if config is not None:
        return signed_get(config, url + "/metrics").decode()
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return bytes(resp.read()).decode()


def node_metric(url: str, name: str, config: ClusterConfig | None = None) -> float:
    """A metric of a node; pass the cluster's config (with its secret) for a generation node's."""
    for line in metrics_text(url, config).splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition",
             proc: subprocess.Popen[Any] | None = None) -> None:
    """Until ``predicate()`` holds; stops at once, naming ``what``, if ``proc`` (the process it waits on) exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the process behind {what} exited with code {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """Serve ``app`` in this event loop on a free loopback port (yielded) until the block ends."""
    runner = web.AppRunner(app, lingering_time=LINGER_S)  # as the roles' listeners (tessera.listener)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def ledger_question(session: aiohttp.ClientSession, url: str, i: int, stream: bool) -> tuple[int, bool]:
    """(HTTP status, whether a streamed reply carried an error event) of one 80-token request,
    the load the node-failure tests keep in flight while they kill or stop a node."""
    body = {"messages": [{"role": "user", "content": f"question {i}: what does the ledger say?"}],
            "max_tokens": 80, "ignore_eos": True, "temperature": 0, "stream": stream}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        text = await resp.read()
        if resp.status != 200:  # pytest shows it with the failing assertion: which refusal it was
            print(f"question {i}: HTTP {resp.status}: {text[:400].decode(errors='replace')}")
        return resp.status, stream and b'"error"' in text


def node_inflight(cfg: ClusterConfig, i: int) -> int:
    """Requests generation node ``i`` is running now (its /health)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cfg.generation[i].port}/health", timeout=5) as resp:
        return int(json.loads(resp.read())["inflight"])


async def kill_mid_load(url: str, cfg: ClusterConfig, pid: int, n: int = 40) -> list[tuple[int, bool]]:
    """``n`` ledger questions through ``url`` (every fourth streamed); once gen0 runs 8 of them
    and has decoded for a second, kill -9 ``pid``; each request's (status, error event)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = [asyncio.create_task(ledger_question(session, url, i, stream=i % 4 == 0)) for i in range(n)]
        await asyncio.to_thread(wait_for, lambda: node_inflight(cfg, 0) >= 8, 60.0, "requests in flight on gen0")
        await asyncio.sleep(1.0)  # well into decoding: gen0 has sent tokens of most of them
        os.kill(pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)
