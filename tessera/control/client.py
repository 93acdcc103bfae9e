"""Clients of the control plane: the KV-pool verbs, a generation node's own reports, and the
request path (route, plan, complete) for a process that does not host the plane.

Other roles call the control plane only through these classes (the routes:
:mod:`tessera.control.routes`). Control messages are small and rare (one per unit, not per
block), so aiohttp is fine here; block payloads never go through this client.

:class:`RequestControl` raises what the in-process :class:`~tessera.control.plane.ControlPlane`
raises for the same call (``Overloaded``, ``Unavailable``, ``BadRequest``), so a caller treats
a remote and a local plane alike; anything else is a ``ControlPlaneError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import aiohttp
import orjson

from tessera.auth import ClusterAuth
from tessera.errors import (
    BadRequest,
    ControlPlaneError,
    DecodeError,
    NotLeader,
    Overloaded,
    PublishRejected,
    Unavailable,
)
from tessera.http import LazySession
from tessera.messages.common import Ack
from tessera.messages.control import (
    CancelRequest,
    CompleteRequest,
    InvalidateRequest,
    LateLeaseRequest,
    LateLeaseResponse,
    LivenessReport,
    LivenessRequest,
    LoadReport,
    PlanRequest,
    PublishRequest,
    ReleaseRequest,
    RenewRequest,
    RenewResponse,
    ResidencyReport,
    RouteRequest,
    RouteResponse,
    RouteUnit,
    SuspectRequest,
    UnitsChanged,
)
from tessera.messages.kvpool import InventoryResult, MemoryNodeHello, MemoryNodeHelloAck, MemoryNodeInventory
from tessera.messages.plan import ReadLease, RequestPlan, WriteGrant
from tessera.wire import WIRE_VERSION, encode, from_wire

if TYPE_CHECKING:
    from tessera.ha.election import Leader

log = logging.getLogger(__name__)
T = TypeVar("T")


class ControlClient:
    """Verbs: ``publish / cancel / release / hello / memory_nodes``; ``close`` when done."""

    def __init__(self, base_url: str, timeout_s: float = 5.0, auth: ClusterAuth | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = LazySession(aiohttp.ClientTimeout(total=timeout_s))
        self.auth = auth or ClusterAuth()  # signs every request with the cluster secret

    async def close(self) -> None:
        await self._session.close()

    def point_at(self, leader: Leader | None) -> None:
        """Call the elected leader's internal plane from now on (``[ha]``); None keeps the last one."""
        if leader is not None:
            self.base_url = leader.value.decode().rstrip("/")

    async def _call(self, method: str, path: str, body: Any = None,
                    timeout_s: float | None = None) -> tuple[int, Any]:
        url = self.base_url + path
        data = None if body is None else encode(body)
        headers = {"Content-Type": "application/json", **self.auth.headers(method, url, data or b"")}
        try:
            timeout = None if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
            async with self._session.get().request(method, url, data=data, headers=headers, timeout=timeout,
                                                   ssl=self.auth.client_ssl()) as resp:
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

    async def _ack(self, path: str, body: Any, timeout_s: float | None = None) -> Ack:
        status, payload = await self._call("POST", path, body, timeout_s)
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

    async def renew(self, msg: RenewRequest) -> RenewResponse:
        """The grant to write under now (extended, or reserved anew), or None and why."""
        status, payload = await self._call("POST", "/control/renew", msg)
        if status != 200:
            raise ControlPlaneError(f"POST /control/renew: HTTP {status}: {self._reason(payload)}")
        return from_wire(RenewResponse, payload)

    async def late_lease(self, unit_id: str, holder: str) -> ReadLease | None:
        """A lease on ``unit_id`` if it is READY in the shared tier now, else None."""
        status, payload = await self._call("POST", "/control/lease", LateLeaseRequest(WIRE_VERSION, unit_id, holder))
        if status != 200:
            raise ControlPlaneError(f"POST /control/lease: HTTP {status}: {self._reason(payload)}")
        return from_wire(LateLeaseResponse, payload).lease

    async def release(self, lease_ids: tuple[str, ...]) -> None:
        await self._ack("/control/release", ReleaseRequest(WIRE_VERSION, lease_ids))

    async def invalidate(self, unit_id: str, epoch: int, reader: str, reason: str) -> None:
        """Report a shared entry that failed its checksum; best effort (it is recomputed anyway)."""
        try:
            await self._ack("/control/invalidate", InvalidateRequest(WIRE_VERSION, unit_id, epoch, reader, reason))
        except ControlPlaneError as exc:
            log.warning("could not report corrupt unit %s epoch %d: %s", unit_id, epoch, exc)

    async def hello(self, msg: MemoryNodeHello) -> MemoryNodeHelloAck:
        status, payload = await self._call("POST", "/control/kvpool/hello", msg)
        if status != 200:
            raise ControlPlaneError(f"POST /control/kvpool/hello: HTTP {status}: {self._reason(payload)}")
        return from_wire(MemoryNodeHelloAck, payload)

    async def inventory(self, msg: MemoryNodeInventory) -> InventoryResult:
        """A memory node's verified blocks after the control plane restarted (recovery)."""
        status, payload = await self._call("POST", "/control/kvpool/inventory", msg)
        if status != 200:
            raise ControlPlaneError(f"POST /control/kvpool/inventory: HTTP {status}: {self._reason(payload)}")
        return from_wire(InventoryResult, payload)

    async def memory_nodes(self) -> list[MemoryNodeHello]:
        status, payload = await self._call("GET", "/control/kvpool")
        if status != 200:
            raise ControlPlaneError(f"GET /control/kvpool: HTTP {status}: {self._reason(payload)}")
        items = payload.get("nodes", payload) if isinstance(payload, dict) else payload
        if not isinstance(items, list):
            raise ControlPlaneError(f"GET /control/kvpool: expected a list of hellos, got {payload!r:.200}")
        return [from_wire(MemoryNodeHello, item) for item in items]


class NodeControl(ControlClient):
    """A generation node's client of the control plane: the KV-pool verbs plus its own reports.

    ``release_later`` batches lease releases so a request with many remote hits costs one RPC.
    """

    def __init__(self, base_url: str, node: str, timeout_s: float = 5.0, auth: ClusterAuth | None = None) -> None:
        super().__init__(base_url, timeout_s=timeout_s, auth=auth)
        self.node = node
        self._to_release: list[str] = []
        self._flush: asyncio.Task[None] | None = None

    async def residency(self, inserted: Sequence[str], evicted: Sequence[str], kept: Sequence[str] = ()) -> None:
        if not inserted and not evicted and not kept:
            return
        msg = ResidencyReport(WIRE_VERSION, self.node, tuple(inserted), tuple(evicted), tuple(kept))
        try:
            await self._ack("/control/residency", msg)
        except ControlPlaneError as exc:
            log.warning("residency report lost (the next snapshot corrects the view): %s", exc)

    async def load(self, inflight: int, queued_tokens: int, prefill_tokens_per_s: float = 0.0,
                   prompt_batches: int = 0, timeout_s: float | None = None) -> Ack:
        """The heartbeat; an ack with reason "resync" asks for :meth:`resync`.

        ``timeout_s`` bounds this one call: a heartbeat stuck on a stopped leader would delay the
        first one to its successor by the whole client timeout.
        """
        return await self._ack(
            "/control/load",
            LoadReport(WIRE_VERSION, self.node, inflight, queued_tokens, prefill_tokens_per_s, prompt_batches),
            timeout_s)

    async def resync(self, units: Sequence[tuple[str, int]]) -> None:
        """Report the whole local cache, (unit, blocks) each, to a control plane that restarted."""
        if units:
            await self._ack("/control/residency", ResidencyReport(
                WIRE_VERSION, self.node, tuple(u for u, _ in units), (), blocks=tuple(b for _, b in units)))

    async def give_up(self, grant: WriteGrant) -> None:
        try:
            await self.cancel(CancelRequest(WIRE_VERSION, grant.unit_id, grant.epoch, grant.writer, 0.0))
        except ControlPlaneError as exc:
            log.warning("could not cancel reservation of %s (it expires on its own): %s", grant.unit_id, exc)

    def release_later(self, lease_id: str) -> None:
        """Queue a lease release; one RPC carries every release queued in the same loop turn."""
        self._to_release.append(lease_id)
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._release_queued())

    async def _release_queued(self) -> None:
        await asyncio.sleep(0)
        batch, self._to_release = self._to_release, []
        if batch:
            try:
                await self.release(tuple(batch))
            except ControlPlaneError as exc:
                log.warning("releasing %d leases failed (they expire on their own): %s", len(batch), exc)

    async def close(self) -> None:
        if self._flush is not None and not self._flush.done():
            await self._flush
        await super().close()


class RequestControl(ControlClient):
    """The request path of a remote control plane: ``route / finalize / complete``, ``suspect / liveness``.

    The same verbs, arguments and errors as :class:`~tessera.control.plane.ControlPlane`'s.
    """

    async def route(self, request_id: str, units: Sequence[tuple[str, int]]) -> str:
        """Step 2: the generation node chosen for a request's (unit_id, n_tokens) list."""
        return (await self.route_request(request_id, units)).node

    async def route_request(self, request_id: str, units: Sequence[tuple[str, int]], exclude: Collection[str] = (),
                            prompt_tokens: int = 0, waited_s: float = 0.0) -> RouteResponse:
        """Step 2 in full: never one of ``exclude``; with ``prompt_tokens``, the first-token deadline too;
        ``waited_s``: the time the request spent before routing (it counts against the queueing bound)."""
        msg = RouteRequest(WIRE_VERSION, request_id, tuple(RouteUnit(u, n) for u, n in units), tuple(exclude),
                           prompt_tokens, waited_s)
        return await self._request("/control/route", msg, RouteResponse)

    async def units_changed(self, revoked: Sequence[str], reinstated: Sequence[str]) -> None:
        """This replica revoked or re-ingested units: the leader's plane follows (``/control/units``)."""
        await self._request("/control/units", UnitsChanged(WIRE_VERSION, tuple(revoked), tuple(reinstated)), Ack)

    async def finalize(self, request_id: str, node: str, held: Collection[str]) -> RequestPlan:
        """Step 4: the per-unit plan against ``node``'s snapshot ``held``."""
        return await self._request("/control/plan", PlanRequest(WIRE_VERSION, request_id, node, tuple(held)),
                                   RequestPlan)

    async def complete(self, request_id: str) -> bool:
        """The request finished (or was abandoned); False if it was not outstanding."""
        return (await self._request("/control/complete", CompleteRequest(WIRE_VERSION, request_id), Ack)).ok

    async def suspect(self, node: str) -> None:
        """This replica could not reach ``node``: the leader's plane takes it out of routing."""
        await self._request("/control/suspect", SuspectRequest(WIRE_VERSION, node), Ack)

    async def liveness(self, nodes: Sequence[str]) -> LivenessReport:
        """The leader's view of ``nodes``: alive, and seconds since each one's last heartbeat."""
        return await self._request("/control/liveness", LivenessRequest(WIRE_VERSION, tuple(nodes)), LivenessReport)

    async def _request(self, path: str, msg: Any, reply: type[T]) -> T:
        status, payload = await self._call("POST", path, msg)
        if status != 200:
            self._refused(path, status, payload)
        try:
            out = from_wire(reply, payload)
        except DecodeError as exc:
            raise ControlPlaneError(f"POST {path}: the reply does not decode: {exc}") from None
        version = getattr(out, "version", WIRE_VERSION)
        if version != WIRE_VERSION:
            raise ControlPlaneError(f"POST {path}: reply of protocol version {version}; this process speaks "
                                    f"version {WIRE_VERSION}")
        return out

    @classmethod
    def _refused(cls, path: str, status: int, payload: Any) -> NoReturn:
        """Raise what the in-process plane raises for this refusal."""
        reason = cls._reason(payload)
        if status == Overloaded.status:
            raise Overloaded(reason)
        if status == Unavailable.status:
            if isinstance(payload, dict) and payload.get("not_leader") is True:
                raise NotLeader(reason)  # that replica does not lead (any more, or not yet)
            raise Unavailable(reason)
        if status in (400, 404, 409):
            raise BadRequest(reason, status)
        raise ControlPlaneError(f"POST {path}: HTTP {status}: {reason}")
