"""Client of the control plane's KV-pool endpoints (JSON over aiohttp, typed messages).

    POST /control/publish        PublishRequest  -> Ack   (409 + reason: PublishRejected)
    POST /control/cancel         CancelRequest   -> Ack
    POST /control/release        ReleaseRequest  -> Ack
    POST /control/kvpool/hello   MemoryNodeHello -> Ack   (registration and heartbeat)
    GET  /control/kvpool                         -> [MemoryNodeHello]

Control messages are small and rare (one per unit, not per block), so aiohttp is fine here;
block payloads never go through this client.
"""

from __future__ import annotations

from typing import Any, TypeVar

import aiohttp
import orjson

from tessera.errors import ControlPlaneError, PublishRejected
from tessera.messages import Ack, CancelRequest, MemoryNodeHello, PublishRequest, ReleaseRequest
from tessera.wire import WIRE_VERSION, encode, from_wire

T = TypeVar("T")


class ControlClient:
    """Verbs: ``publish / cancel / release / hello / memory_nodes``; ``close`` when done."""

    def __init__(self, base_url: str, timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        url = self.base_url + path
        data = None if body is None else encode(body)
        try:
            async with self._http().request(
                method, url, data=data, headers={"Content-Type": "application/json"}
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ControlPlaneError(f"{method} {url} failed: {exc!r}") from None
        try:
            return status, orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            return status, raw.decode(errors="replace")

    @staticmethod
    def _reason(payload: Any) -> str:
        if isinstance(payload, dict):
            return str(payload.get("reason") or payload.get("error") or payload)
        return str(payload)

    async def _ack(self, path: str, body: Any) -> Ack:
        status, payload = await self._call("POST", path, body)
        if status != 200:
            raise ControlPlaneError(f"POST {path}: HTTP {status}: {self._reason(payload)}")
        return from_wire(Ack, payload)

    async def publish(self, msg: PublishRequest) -> None:
        """PENDING -> READY; raises PublishRejected (HTTP 409) with the control plane's reason."""
        status, payload = await self._call("POST", "/control/publish", msg)
        if status == 409:
            raise PublishRejected(self._reason(payload))
        if status != 200:
            raise ControlPlaneError(f"POST /control/publish: HTTP {status}: {self._reason(payload)}")
        ack = from_wire(Ack, payload)
        if not ack.ok:
            raise PublishRejected(ack.reason)

    async def cancel(self, msg: CancelRequest) -> bool:
        """Give up a reservation; False if there was nothing to cancel (expired, published)."""
        return (await self._ack("/control/cancel", msg)).ok

    async def release(self, lease_ids: tuple[str, ...]) -> None:
        await self._ack("/control/release", ReleaseRequest(WIRE_VERSION, lease_ids))

    async def hello(self, msg: MemoryNodeHello) -> Ack:
        return await self._ack("/control/kvpool/hello", msg)

    async def memory_nodes(self) -> list[MemoryNodeHello]:
        status, payload = await self._call("GET", "/control/kvpool")
        if status != 200:
            raise ControlPlaneError(f"GET /control/kvpool: HTTP {status}: {self._reason(payload)}")
        items = payload.get("nodes", payload) if isinstance(payload, dict) else payload
        if not isinstance(items, list):
            raise ControlPlaneError(f"GET /control/kvpool: expected a list of hellos, got {payload!r:.200}")
        return [from_wire(MemoryNodeHello, item) for item in items]
