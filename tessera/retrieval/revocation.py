"""Telling the generation nodes that units were deleted (``POST /v1/revoke`` on each node).

The retrieval role calls :meth:`Revoker.broadcast` after the control plane revoked the units
and before it acknowledges the delete, so a node's copy is gone (or doomed to go when its
last pin is released) by the time the caller hears "deleted". The broadcast is best effort:
a node that is down or slow keeps its copy, and that is safe because the control plane
never plans a revoked unit as LOCAL, whatever the node's snapshot says (and a restarted
node starts with an empty cache).

This module knows nothing about the unit store or the plane's bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig
from tessera.messages.generation import RevokeRequest
from tessera.wire import WIRE_VERSION, encode

log = logging.getLogger(__name__)


class Revoker:
    """Verbs: ``broadcast``, ``close``."""

    def __init__(self, config: ClusterConfig, timeout_s: float = 2.0) -> None:
        self.urls = {n.name: f"{config.scheme}://{n.host}:{n.port}/v1/revoke" for n in config.generation}
        self.auth = ClusterAuth.from_config(config)  # the generation nodes' API is internal: signed
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.missed = 0  # broadcasts a node did not acknowledge

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def broadcast(self, unit_ids: Sequence[str]) -> dict[str, bool]:
        """Ask every generation node to drop these units; node -> acknowledged."""
        if not unit_ids or not self.urls:
            return {}
        body = encode(RevokeRequest(WIRE_VERSION, tuple(unit_ids)))
        names = list(self.urls)
        done = await asyncio.gather(*(self._one(self.urls[n], body) for n in names))
        acked = dict(zip(names, done, strict=True))
        missed = [n for n, ok in acked.items() if not ok]
        if missed:
            self.missed += len(missed)
            log.warning("revocation of %d units not acknowledged by %s; plans ignore their copies",
                        len(unit_ids), ", ".join(missed))
        return acked

    async def _one(self, url: str, body: bytes) -> bool:
        try:
            headers = {"Content-Type": "application/json", **self.auth.headers("POST", url, body)}
            async with self._http().post(url, data=body, headers=headers, ssl=self.auth.client_ssl()) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False
