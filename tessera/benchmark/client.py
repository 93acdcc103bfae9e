"""Open-loop load generation against a running cluster's chat API.

Requests are sent at Poisson arrival times regardless of completions (open loop), each one
streaming, and TTFT is measured at the client from sending the HTTP request (retrieval
included) to the first streamed content chunk. Usage (tokens per cache tier) comes from the
final stream chunk.

Redirects are never followed: the host a request goes to is the one ``--url`` named and the
endpoint check allowed (:mod:`tessera.benchmark.endpoints`), never one a server names in a
``Location``. A 3xx answer is a failed request that says where it pointed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from tessera.benchmark.extras import progress_bar
from tessera.benchmark.workloads import BenchRequest, CorpusUnit

# how long the load generator waits for one reply: the bench measures queueing, however long
BENCH_CLIENT_TIMEOUT_S = 3600.0


def redirected(url: str, resp: aiohttp.ClientResponse) -> str:
    """Why a 3xx answer to ``url`` is an error, naming where it pointed."""
    where = resp.headers.get("Location", "(no Location header)")
    return (f"{url} answered HTTP {resp.status}, a redirect to {where}: tessera bench does not follow "
            "redirects; pass the final URL with --url")


@dataclass
class Result:
    index: int
    sent_at: float  # seconds since the run started
    ttft: float | None = None
    latency: float | None = None
    text: str = ""
    status: int = 0
    error: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.ttft is not None


async def ingest(url: str, corpus: Sequence[CorpusUnit], batch: int = 64, progress: bool = True,
                 embeddings: Mapping[str, list[float]] | None = None) -> int:
    """Add the corpus to the Retrieval Pool's index; returns the number of units sent.

    With ``embeddings`` (text -> vector) the units carry precomputed vectors, so the
    retrieval node only tokenizes and indexes them.
    """
    if not corpus:
        return 0
    bar = progress_bar(len(corpus), "ingest", "unit") if progress else None
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for i in range(0, len(corpus), batch):
            chunk = corpus[i:i + batch]
            units: list[dict[str, Any]] = []
            for u in chunk:
                unit: dict[str, Any] = {"scope": u.scope, "text": u.text}
                if embeddings is not None and u.text in embeddings:
                    unit["embedding"] = embeddings[u.text]
                units.append(unit)
            body = {"version": 1, "units": units}
            async with http.post(f"{url}/v1/units", data=orjson.dumps(body), allow_redirects=False,
                                 headers={"Content-Type": "application/json"}) as resp:
                if 300 <= resp.status < 400:
                    raise RuntimeError(f"ingest failed: {redirected(f'{url}/v1/units', resp)}")
                if resp.status != 200:
                    raise RuntimeError(f"ingest failed with HTTP {resp.status}: {await resp.text()}")
            if bar is not None:
                bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return len(corpus)


async def _one(http: aiohttp.ClientSession, url: str, body: dict[str, Any], result: Result, start: float,
               headers: Mapping[str, str] | None = None, slots: asyncio.Semaphore | None = None) -> None:
    # TTFT counts from the request's arrival, including any wait for a free concurrency slot
    t0 = time.perf_counter()
    try:
        async with contextlib.AsyncExitStack() as stack:
            if slots is not None:
                await stack.enter_async_context(slots)
            await _post(http, url, body, result, t0, headers)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = repr(exc)[:300]
    finally:
        result.latency = time.perf_counter() - t0


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], result: Result, t0: float,
                headers: Mapping[str, str] | None) -> None:
    """One streamed chat request: status, TTFT (from ``t0``), text, usage and layout into ``result``."""
    chat = f"{url}/v1/chat/completions"
    async with http.post(chat, data=orjson.dumps(body), allow_redirects=False,
                         headers={"Content-Type": "application/json", **(headers or {})}) as resp:
        result.status = resp.status
        if 300 <= resp.status < 400:
            result.error = redirected(chat, resp)
            return
        if resp.status != 200:
            result.error = (await resp.text())[:300]
            return
        parts: list[str] = []
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = orjson.loads(payload)
            if "error" in chunk:
                result.error = str(chunk["error"])[:300]
                return
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                content = delta.get("content")
                # the first token's chunk; an empty role-only chunk (which some servers send before
                # their prefill is done) is not a token
                if content is not None and result.ttft is None and (content or "role" not in delta):
                    result.ttft = time.perf_counter() - t0
                if content:
                    parts.append(content)
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            if chunk.get("tessera_layout"):
                result.layout = chunk["tessera_layout"]
        result.text = "".join(parts)


BodyOf = Callable[[BenchRequest, int], dict[str, Any]]


async def run_load(url: str, requests: Sequence[BenchRequest], rate: float, *, max_tokens: int = 1,
                   seed: int = 0, return_layout: bool = False, progress: bool = True,
                   desc: str = "", embeddings: Mapping[str, list[float]] | None = None,
                   arrivals: Sequence[float] | None = None, body_of: BodyOf | None = None,
                   max_concurrency: int = 0, timeout_s: float = BENCH_CLIENT_TIMEOUT_S,
                   headers: Mapping[str, str] | None = None) -> list[Result]:
    """Send ``requests`` at Poisson arrivals of ``rate`` req/s (rate <= 0: one at a time), or at
    the given ``arrivals`` (seconds from the start, one per request).

    With ``embeddings`` (query text -> vector) retrieval requests carry precomputed query
    embeddings, so TTFT excludes query embedding, as in the paper's methodology. ``body_of``
    builds each body (default: Tessera's, :meth:`BenchRequest.body`); at most
    ``max_concurrency`` requests are in flight (0: no bound), each ends after ``timeout_s``.
    """
    assert arrivals is None or len(arrivals) == len(requests), (len(arrivals or ()), len(requests))
    rng = random.Random(seed)
    results = [Result(i, 0.0) for i in range(len(requests))]
    bar = progress_bar(len(requests), desc or f"{rate:g} req/s", "req") if progress else None
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        start = time.perf_counter()
        tasks = []
        next_at = 0.0
        for i, req in enumerate(requests):
            body = req.body(max_tokens) if body_of is None else body_of(req, max_tokens)
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            if return_layout and body_of is None:  # a Tessera extension: never sent to other servers
                body["return_layout"] = True
            if embeddings is not None and "retrieval" in body and body["retrieval"]["query"] in embeddings:
                body["retrieval"]["embedding"] = embeddings[body["retrieval"]["query"]]
            if arrivals is not None or rate > 0:
                at = arrivals[i] if arrivals is not None else next_at
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                next_at += rng.expovariate(rate) if rate > 0 else 0.0
            results[i].sent_at = time.perf_counter() - start
            task = asyncio.create_task(_one(http, url, body, results[i], start, headers, slots))
            if bar is not None:
                task.add_done_callback(lambda _t: bar.update(1))
            if arrivals is None and rate <= 0:
                await task  # closed loop: the unloaded reference
            tasks.append(task)
        await asyncio.gather(*tasks)
    if bar is not None:
        bar.close()
    return results
