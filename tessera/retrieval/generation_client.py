"""The retrieval role's client of the generation nodes (snapshot, execute, abort), in typed messages.

Every call toward a node is bounded (``[control]`` deadlines): connecting, the snapshot and
the first token of a reply together (``first_token_timeout_s``), and the gap between two
tokens (``idle_timeout_s``). A node that misses a deadline, refuses the connection or breaks
a stream raises :class:`NodeUnavailable`; the caller decides about retries and tells the
node to abort (:meth:`NodeClients.abort_later`), since a wedged node may still be working.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import aiohttp
import orjson

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig
from tessera.errors import BadRequest, Overloaded, TesseraError
from tessera.http import LazySession
from tessera.messages import (
    EXECUTE_EVENTS,
    AbortRequest,
    AbortResponse,
    ExecuteEvent,
    ExecuteRequest,
    SnapshotRequest,
    SnapshotResponse,
    check_version,
)
from tessera.runtime import BackgroundTasks
from tessera.wire import WIRE_VERSION, decode, decode_tagged, encode, from_wire

log = logging.getLogger(__name__)


class NodeUnavailable(TesseraError):
    """A generation node could not be reached, missed a deadline or failed mid-request (HTTP 503)."""


class NodeClients:
    def __init__(self, config: ClusterConfig) -> None:
        control = config.control
        self.urls = {n.name: f"{config.scheme}://{n.host}:{n.port}" for n in config.generation}
        self.auth = ClusterAuth.from_config(config)  # the generation nodes' API is internal: signed
        self.connect_timeout_s = control.connect_timeout_s
        self.first_token_timeout_s = control.first_token_timeout_s
        self.idle_timeout_s = control.idle_timeout_s
        # no total timeout: a long generation is fine; connecting, the first token and every
        # gap between tokens are bounded per call below
        self._session = LazySession(
            aiohttp.ClientTimeout(total=None, connect=control.connect_timeout_s,
                                  sock_connect=control.connect_timeout_s),
            connection_limit=0)
        self.aborts = BackgroundTasks("aborts")

    async def close(self) -> None:
        await self.aborts.drain(timeout=self.connect_timeout_s)
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
            async with asyncio.timeout(self.first_token_timeout_s), \
                    self._post(node, "/v1/snapshot", encode(msg)) as resp:
                if resp.status != 200:
                    raise await self._error(node, resp)
                return from_wire(SnapshotResponse, orjson.loads(await resp.read()))
        except TimeoutError:
            raise NodeUnavailable(f"generation node {node} did not answer the snapshot within "
                                  f"{self.first_token_timeout_s:g}s (control.first_token_timeout_s)") from None
        except aiohttp.ClientError as exc:
            raise NodeUnavailable(f"generation node {node} is unreachable: {exc!r}") from None

    async def execute(self, node: str, msg: ExecuteRequest) -> AsyncGenerator[ExecuteEvent, None]:
        """Yield the node's events; the last one is a ``DoneEvent`` (or an ``ErrorEvent``)."""
        wait, what = self.first_token_timeout_s, "its first token"
        # NOTE: asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
        # that arrives as its awaitable completes, and a client's disconnect would be lost
        try:
            async with asyncio.timeout(wait):
                resp = await self._post(node, "/v1/execute", encode(msg))
            try:
                if resp.status != 200:
                    raise await self._error(node, resp)
                while True:
                    async with asyncio.timeout(wait):
                        line = await resp.content.readline()
                    if not line:
                        return
                    if line.strip():
                        wait, what = self.idle_timeout_s, "its next token"
                        yield decode_tagged(EXECUTE_EVENTS, line)
            finally:
                resp.close()  # an unfinished stream closes the connection: the node sees it
        except TimeoutError:
            raise NodeUnavailable(f"generation node {node} did not send {what} within {wait:g}s "
                                  "(control.first_token_timeout_s / idle_timeout_s)") from None
        except aiohttp.ClientError as exc:
            raise NodeUnavailable(f"generation node {node} failed mid-request: {exc!r}") from None

    async def abort(self, node: str, request_id: str) -> None:
        msg = AbortRequest(WIRE_VERSION, request_id)
        try:
            async with asyncio.timeout(self.connect_timeout_s), \
                    self._post(node, "/v1/abort", encode(msg)) as resp:
                if resp.status != 200:
                    log.warning("request %s: %s", request_id, await self._error(node, resp))
                    return
                answer = decode(AbortResponse, await resp.read())
        except (aiohttp.ClientError, TimeoutError):
            return  # the node is gone or wedged; its own pin timeout frees what it holds
        check_version(answer.version)
        log.debug("request %s on %s: %s", request_id, node,
                  "run cancelled" if answer.aborted else "not running; its pins are dropped")

    def abort_later(self, node: str, request_id: str) -> None:
        """Tell the node to stop a request, without waiting (the caller may be unwinding)."""
        self.aborts.spawn(self.abort(node, request_id), name=f"abort-{request_id[-8:]}")
