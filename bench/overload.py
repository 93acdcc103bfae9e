"""Overload control on queue time: TTFT of accepted requests at ~3x saturation vs unloaded.

    python bench/overload.py [--config tessera.toml] [--factor 3] [--duration 60]

Starts the cluster (the embedded default config unless ``--config``), measures the unloaded
TTFT (one request at a time) and the service time, takes saturation as nodes / mean service
time, then sends Poisson load at ``factor`` times that. Prints outcome counts, the p50/p99
TTFT of accepted requests against the unloaded p99 and against ``control.max_queue_wait_s``
plus one service time (the bound the overload control promises), and every role's RSS
before the load, right after it and ``--settle`` seconds later.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp
import orjson

from tessera.auth import ClusterAuth
from tessera.config_file import load_config
from tessera.launcher import LocalCluster
from tessera.ports import on_free_ports
from tessera_lab.chaos.harness import rss_mb

QUESTION = "Summarise the notes on the {} in one sentence."
TOPICS = ("harbour", "orchard", "lighthouse", "ferry", "library", "market", "observatory", "mill")


def _body(i: int, max_tokens: int) -> dict[str, object]:
    unit = f"Notes on the {TOPICS[i % len(TOPICS)]}: " + " ".join(f"item {i}-{k} is recorded." for k in range(40))
    return {"model": "tessera", "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION.format(TOPICS[i % len(TOPICS)])}],
            "context_units": [unit]}


Outcome = tuple[str, float | None, float, dict[str, float]]


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> Outcome:
    """(outcome, TTFT or None, latency, the server's timings) of one streamed request; the
    timings are the usage's ``ttft_ms`` and the node's ``node_queued_s`` / ``node_first_token_s``."""
    start = time.perf_counter()
    ttft: float | None = None
    timings: dict[str, float] = {}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return str(resp.status), None, time.perf_counter() - start, timings
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
            usage = (chunk.get("usage") or {}).get("tessera")
            if usage:
                timings = {k: float(usage[k]) for k in ("ttft_ms", "node_queued_s", "node_first_token_s")
                           if k in usage}
    return "200", ttft, time.perf_counter() - start, timings


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs or [float("nan")])[0]


def rss(cluster: LocalCluster) -> dict[str, tuple[float, float, float]]:
    """(RSS, of which shared memory, of which the local unit cache) of every role process, MB.

    A generation node's RSS counts the pages of the memory node's ``/dev/shm`` arena it wrote
    or read (RssShmem): the shared tier, bounded by the arena, not the node's own memory. Its
    local unit cache holds the states it kept (``tessera_node_local_cache_bytes``), bounded by
    ``local_capacity_blocks``: what is left is the node's own working memory, which must go
    back to its unloaded level once the load is over.
    """
    return {f"{c.role}:{c.node}": (rss_mb(c.proc.pid), _status_mb(c.proc.pid, "RssShmem:"),
                                   _cache_mb(cluster, c.node) if c.role == "generation" else 0.0)
            for c in cluster.children}


def _cache_mb(cluster: LocalCluster, node: str) -> float:
    cfg = cluster.config
    port = next(g.port for g in cfg.generation if g.name == node)
    url = f"http://127.0.0.1:{port}/metrics"
    req = urllib.request.Request(url, headers=ClusterAuth.from_config(cfg).headers("GET", url, b""))
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("tessera_node_local_cache_bytes "))
    return float(line.split()[1]) / 2**20


def _status_mb(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next((int(line.split()[1]) / 1024 for line in fh if line.startswith(key)), 0.0)


def print_rss(when: str, figures: dict[str, tuple[float, float, float]]) -> None:
    print(f"RSS {when}: " + ", ".join(f"{k} {v:.0f} MB (shm {s:.0f}, local cache {c:.0f}, own {v - s - c:.0f})"
                                      for k, (v, s, c) in figures.items())
          + f"; total {sum(v for v, _, _ in figures.values()):.0f} MB")


def print_own(before: dict[str, tuple[float, float, float]], after: dict[str, tuple[float, float, float]]) -> None:
    """Each process's own memory (RSS less the shared arena and the bounded local cache), before vs after."""
    def own(f: tuple[float, float, float]) -> float:
        return f[0] - f[1] - f[2]

    print("own memory before the load -> after the settle: " + ", ".join(
        f"{k} {own(b):.0f} -> {own(after[k]):.0f} MB ({own(after[k]) - own(b):+.0f})" for k, b in before.items()))


async def measure(cluster: LocalCluster, factor: float, duration: float, max_tokens: int, settle: float) -> None:
    cfg = cluster.config
    url, nodes, bound = cfg.retrieval_url, len(cfg.generation), cfg.control.max_queue_wait_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for i in range(3):
            await one(session, url, _body(i, max_tokens))
        unloaded = [await one(session, url, _body(100 + i, max_tokens)) for i in range(20)]
        ttft0 = [t for _, t, _, _ in unloaded if t is not None]
        service = statistics.mean(lat for _, _, lat, _ in unloaded)
        saturation = nodes / service
        rate = factor * saturation
        print(f"unloaded: TTFT p50 {pct(ttft0, 50) * 1000:.0f} ms, p99 {pct(ttft0, 99) * 1000:.0f} ms; "
              f"service {service * 1000:.0f} ms; saturation ~{saturation:.2f} req/s; driving {rate:.2f} req/s")
        before = rss(cluster)
        print_rss("before the load", before)
        rng = random.Random(0)
        tasks, at, t0, i = [], 0.0, time.monotonic(), 0
        while at < duration:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
            tasks.append(asyncio.create_task(one(session, url, _body(1000 + i, max_tokens))))
            at += rng.expovariate(rate)
            i += 1
        results = await asyncio.gather(*tasks)
    print_rss("right after the load", rss(cluster))
    outcomes = Counter(o for o, _, _, _ in results)
    ttft = [t for o, t, _, _ in results if o == "200" and t is not None]
    print(f"requests {len(results)}; outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    print(f"accepted TTFT p50 {pct(ttft, 50) * 1000:.0f} ms, p99 {pct(ttft, 99) * 1000:.0f} ms = "
          f"{pct(ttft, 99) / pct(ttft0, 99):.1f}x the unloaded p99")
    if bound > 0:
        print(f"bound: control.max_queue_wait_s {bound:g} s + one service time = {(bound + service) * 1000:.0f} ms; "
              f"accepted p99 is {pct(ttft, 99) / (bound + service):.2f}x that")
    print_breakdown([timings for o, _, _, timings in results if o == "200"])
    await asyncio.sleep(settle)
    settled = rss(cluster)
    print_rss(f"{settle:g} s after the load", settled)
    print_own(before, settled)


def print_breakdown(timings: list[dict[str, float]]) -> None:
    """Where the accepted requests' server-side TTFT went: before the node (parsing, tokenizing,
    routing, the snapshot, the plan's trip), queued on the node, and the node's own work."""
    rows = [t for t in timings if t.get("node_first_token_s")]
    if not rows:
        return
    before = [t["ttft_ms"] / 1000 - t["node_first_token_s"] for t in rows if "ttft_ms" in t]
    queued = [t["node_queued_s"] for t in rows]
    work = [t["node_first_token_s"] - t["node_queued_s"] for t in rows]
    print("accepted, server side, p50 / p99: " + ", ".join(
        f"{name} {pct(xs, 50) * 1000:.0f} / {pct(xs, 99) * 1000:.0f} ms"
        for name, xs in (("before the node", before), ("queued on the node", queued),
                         ("node's work to first token", work)) if xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--settle", type=float, default=60.0, help="seconds to wait after the load before the last RSS")
    args = ap.parse_args()
    cfg = on_free_ports(load_config(args.config))  # beside a cluster on the configured ports
    cluster = LocalCluster(cfg)
    cluster.start()
    try:
        asyncio.run(measure(cluster, args.factor, args.duration, args.max_tokens, args.settle))
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
