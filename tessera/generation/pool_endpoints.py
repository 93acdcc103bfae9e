"""Where each memory node's arena is: its :class:`NodeEndpoint`, from the node's ``GET /info``.

Endpoints are cached per node and dropped after any failed transfer, so the next transfer
asks again and finds a restarted node's new segment, port or engine session. When the
answer shows a new ``boot_id``, the time is recorded: a write grant received before that
moment refers to the previous incarnation's slots and must not be written to the new one.
"""

from __future__ import annotations

import time

import aiohttp

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig
from tessera.errors import BadRequest, TransferError
from tessera.transport.base import NodeEndpoint
from tessera.wire import from_wire


class EndpointBook:
    """``get(node) -> NodeEndpoint`` (cached), ``forget(node)``, ``restarted_since(node, t)``."""

    def __init__(self, urls: dict[str, str], timeout_s: float = 5.0, auth: ClusterAuth | None = None) -> None:
        self.urls = urls  # node name -> control base URL
        self.auth = auth or ClusterAuth()  # /info is internal: signed
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._cache: dict[str, NodeEndpoint] = {}
        self._boots: dict[str, str] = {}
        self._restarted_at: dict[str, float] = {}
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_config(cls, config: ClusterConfig) -> EndpointBook:
        urls = {n.name: f"{config.scheme}://{n.host}:{n.port}" for n in config.kvpools}
        return cls(urls, timeout_s=config.transport.timeout_s, auth=ClusterAuth.from_config(config))

    async def get(self, node: str) -> NodeEndpoint:
        cached = self._cache.get(node)
        if cached is not None:
            return cached
        url = self.urls.get(node)
        if url is None:
            raise TransferError(f"memory node {node!r} is not in the config (known: {', '.join(self.urls) or 'none'})")
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self._session.get(f"{url}/info", headers=self.auth.headers("GET", f"{url}/info"),
                                         ssl=self.auth.client_ssl()) as resp:
                if resp.status != 200:
                    raise TransferError(f"memory node {node} answered GET /info with HTTP {resp.status}")
                endpoint = from_wire(NodeEndpoint, await resp.json())
        except (aiohttp.ClientError, TimeoutError, BadRequest) as exc:
            raise TransferError(f"memory node {node} at {url} is unreachable: {exc!r}") from None
        if endpoint.name != node:
            raise TransferError(f"{url} is memory node {endpoint.name!r}, not {node!r}: check [[kvpools]] ports")
        previous = self._boots.get(node)
        if previous is not None and previous != endpoint.boot_id:
            self._restarted_at[node] = time.monotonic()
        self._boots[node] = endpoint.boot_id
        self._cache[node] = endpoint
        return endpoint

    def forget(self, node: str) -> None:
        self._cache.pop(node, None)

    def restarted_since(self, node: str, since: float) -> bool:
        """Whether ``node`` was seen with a new boot id after monotonic time ``since``."""
        return self._restarted_at.get(node, float("-inf")) > since

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
