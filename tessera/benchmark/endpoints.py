"""Already running chat endpoints that ``tessera bench --url`` drives, and the body each one is sent.

An endpoint is a name, a base URL and an API:

* ``tessera``: a Tessera cluster's retrieval role; each request's units go as ``context_units``
  (composed, reused at any position);
* ``openai``: any OpenAI-compatible server (vLLM, SGLang, a llama.cpp server, ...); the units
  are rendered into the messages as text, where Tessera's prompt builder places them
  (:func:`tessera.retrieval.prompt.text_placement`), so both see the same prompt text.

``auto`` asks ``GET /v1/models``: a server whose model is ``owned_by: "tessera"`` is Tessera.
Only loopback hosts (127.0.0.0/8, ::1, localhost) are driven unless a host is explicitly
allowed (``--allow-host``): names are compared as given, never resolved, so a name cannot
stand in for another address. Redirects are never followed, here or under load
(:mod:`tessera.benchmark.client`): a server cannot send the bench to a host the check did not
allow.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from tessera.benchmark.client import redirected
from tessera.benchmark.workloads import BenchRequest
from tessera.errors import ConfigError
from tessera.retrieval.prompt import text_placement

APIS = ("auto", "tessera", "openai")


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str  # base URL, without /v1
    api: str  # tessera | openai (auto resolved by detect())
    model: str = "tessera"  # the model name sent in each body

    def body(self, req: BenchRequest, max_tokens: int) -> dict[str, Any]:
        """The chat body this endpoint is sent for ``req`` (streaming is added by the load client)."""
        if self.api == "tessera":
            return req.body(max_tokens)
        return {"model": self.model, "messages": text_placement(req.messages, req.context_units, req.placement),
                "max_tokens": req.max_tokens or max_tokens, "temperature": 0.0}


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_endpoint(spec: str, allowed: Sequence[str], api: str = "auto") -> Endpoint:
    """``[NAME=]URL`` (http or https) on a loopback or explicitly allowed host."""
    if api not in APIS:
        raise ConfigError(f"--api {api!r}: expected one of {', '.join(APIS)}")
    name, sep, url = spec.partition("=")
    if not sep or "://" in name:
        name, url = "", spec
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--url {spec!r}: expected [NAME=]http(s)://HOST:PORT")
    host = parts.hostname
    if not _loopback(host) and host not in allowed:
        raise ConfigError(f"--url {spec!r}: {host} is not a loopback address; the bench drives loopback hosts only "
                          f"unless you allow this one with --allow-host {host}")
    base = url.rstrip("/").removesuffix("/v1")
    return Endpoint(name or f"{host}:{parts.port or ''}".rstrip(":"), base, api)


async def detect(endpoint: Endpoint, headers: dict[str, str], timeout_s: float = 10.0) -> Endpoint:
    """The endpoint with its API (``auto``: from ``/v1/models``) and served model name."""
    models_url = f"{endpoint.url}/v1/models"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http, \
                http.get(models_url, headers=headers, allow_redirects=False) as resp:
            if 300 <= resp.status < 400:
                raise ConfigError(redirected(models_url, resp))
            if resp.status != 200:
                raise ConfigError(f"{endpoint.url}/v1/models answered HTTP {resp.status}: {(await resp.text())[:200]}")
            models = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ConfigError(f"cannot reach {endpoint.url}/v1/models: {exc!r}") from None
    if not models:
        raise ConfigError(f"{endpoint.url}/v1/models lists no model")
    first = models[0]
    api = endpoint.api
    if api == "auto":
        api = "tessera" if first.get("owned_by") == "tessera" else "openai"
    return Endpoint(endpoint.name, endpoint.url, api, str(first.get("id", "tessera")))
