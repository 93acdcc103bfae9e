"""The retrieval role's client of the generation nodes (snapshot, execute, abort)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import orjson

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig
from tessera.errors import BadRequest, Overloaded, TesseraError
from tessera.http import LazySession
from tessera.messages import EXECUTE_EVENTS, ExecuteEvent, ExecuteRequest, SnapshotRequest, SnapshotResponse
from tessera.wire import WIRE_VERSION, decode_tagged, encode, from_wire


class NodeUnavailable(TesseraError):
    """A generation node could not be reached or failed mid-request (HTTP 503 to the client)."""


class NodeClients:
    def __init__(self, config: ClusterConfig, connect_timeout_s: float = 5.0) -> None:
        self.urls = {n.name: f"{config.scheme}://{n.host}:{n.port}" for n in config.generation}
        self.auth = ClusterAuth.from_config(config)  # the generation nodes' API is internal: signed
        # no total timeout: a long generation is fine; connecting and the first byte are bounded
        self._session = LazySession(
            aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s),
            connection_limit=0)

    async def close(self) -> None:
        await self._session.close()

    def _post(self, node: str, path: str, data: bytes) -> Any:
        url = self.urls[node] + path
        headers = {"Content-Type": "application/json", **self.auth.headers("POST", url, data)}
        return self._session.get().post(url, data=data, headers=headers, ssl=self.auth.client_ssl())

    async def _error(self, node: str, resp: aiohttp.ClientResponse) -> TesseraError:
        text = (await resp.text())[:500]
        if resp.status == 429:
            return Overloaded(f"generation node {node} is overloaded: {text}")
        if 400 <= resp.status < 500:
            return BadRequest(f"generation node {node} refused the request: {text}", resp.status)
        return NodeUnavailable(f"generation node {node} answered HTTP {resp.status}: {text}")

    async def snapshot(self, node: str, request_id: str, unit_ids: Sequence[str]) -> SnapshotResponse:
        msg = SnapshotRequest(WIRE_VERSION, request_id, tuple(unit_ids))
        try:
            async with self._post(node, "/v1/snapshot", encode(msg)) as resp:
                if resp.status != 200:
                    raise await self._error(node, resp)
                return from_wire(SnapshotResponse, orjson.loads(await resp.read()))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise NodeUnavailable(f"generation node {node} is unreachable: {exc!r}") from None

    async def execute(self, node: str, msg: ExecuteRequest) -> AsyncIterator[ExecuteEvent]:
        """Yield the node's events; the last one is a ``DoneEvent`` (or an ``ErrorEvent``)."""
        try:
            async with self._post(node, "/v1/execute", encode(msg)) as resp:
                if resp.status != 200:
                    raise await self._error(node, resp)
                async for line in resp.content:
                    if line.strip():
                        yield decode_tagged(EXECUTE_EVENTS, line)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise NodeUnavailable(f"generation node {node} failed mid-request: {exc!r}") from None

    async def abort(self, node: str, request_id: str) -> None:
        try:
            async with self._post(node, "/v1/abort", orjson.dumps({"request_id": request_id})) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            pass  # the node is gone; nothing left to abort
