"""The transport contract: move slot bytes between this process and memory nodes' arenas.

A transport is chosen by name (``[transport] name`` in tessera.toml): ``shm`` (same host,
one-sided copies from a mapped arena), ``tcp`` (our binary protocol) or ``mooncake``
(Mooncake Transfer Engine: TCP here, RDMA on real NICs). A test may register its own.

Contract of every transport:

* ``read(node, ios)`` fills each ``io.buf`` with the first ``len(io.buf)`` bytes of slot
  ``io.slot``; ``write(node, ios)`` stores each ``io.buf`` at the start of its slot. A batch
  may hold many slots; the transport splits it into requests and pipelines them.
* Transfers are bounded: at most ``max_inflight_bytes`` and ``max_outstanding`` requests
  per transport object (:class:`TransferLimiter`).
* A batch finishes within ``timeout_s`` or raises :class:`TransferTimeout`; every other
  failure (dead peer, restarted node, refused request) raises :class:`TransferError`. No
  batch hangs, and once ``read``/``write`` has returned or raised, the transport never
  touches the caller's buffers again.
* Transports move bytes only; they do not interpret headers (see :mod:`.blocks`).

Who may move which slots: a transport that reaches the memory node's process (``tcp``)
authenticates each connection and the node checks each request's capability against it
(:mod:`.handshake`). ``shm`` is one-sided on one host: the client maps the arena (a 0600
segment of the same user), no request reaches the node, so there is nothing to present a
capability to and no wire to encrypt; the operating system's file permissions are the
boundary. ``mooncake`` moves bytes with the engine's own one-sided protocol and checks no
capability either: use it only on a trusted network (an RDMA fabric or a private VLAN).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config import TransportConfig
from tessera.errors import TesseraError, TransferError, TransferTimeout
from tessera.registry import Registry
from tessera.transport.arena import Arena
from tessera.transport.frames import Capability
from tessera.transport.handshake import DataPlaneCredentials
from tessera.transport.limits import TransferLimiter

# one request carries at most this many bytes (one slot at least): enough to amortize
# per-request costs, small enough that a batch pipelines over several requests
REQUEST_BYTES = 4 << 20
REQUEST_BLOCKS = 1024


@dataclass(frozen=True, slots=True)
class NodeEndpoint:
    """Everything a transport needs to reach one memory node's arena (``GET /info``)."""

    version: int
    name: str
    boot_id: str  # new on every start: a restarted node is empty
    capacity_blocks: int
    slot_bytes: int
    shm_name: str  # POSIX shm segment of the arena (same-host readers map it)
    data_host: str
    data_port: int  # tcp transport
    engine_session: str = ""  # mooncake: "host:rpc_port" of the node's transfer engine
    engine_base: int = 0  # mooncake: address of the arena in the node's engine


@dataclass(frozen=True, slots=True)
class SlotIO:
    """One slot transfer: ``buf`` <-> the first ``len(buf)`` bytes of ``slot``.

    ``cap`` is the grant's or lease's capability for this node; transports that reach the
    node over the network (``tcp``) send it, and the node refuses slots it does not cover.
    """

    slot: int
    buf: memoryview
    cap: Capability | None = None


class ArenaExport(ABC):
    """Memory-node side of a transport that needs the arena registered somewhere."""

    @abstractmethod
    def endpoint_fields(self) -> dict[str, Any]:
        """Extra :class:`NodeEndpoint` fields that clients need (e.g. engine session)."""

    @abstractmethod
    def close(self) -> None: ...


class Transport(ABC):
    """Client side of a transport (see the module docstring for the contract)."""

    name: ClassVar[str]
    # largest request a batch is split into (bounded by max_inflight_bytes as well)
    request_bytes: ClassVar[int] = REQUEST_BYTES
    request_blocks: ClassVar[int] = REQUEST_BLOCKS

    def __init__(self, config: TransportConfig, credentials: DataPlaneCredentials | None = None) -> None:
        self.config = config
        # who this client is toward memory nodes; only transports that reach a node's process use it (tcp)
        self.credentials = credentials or DataPlaneCredentials()
        self.limiter = TransferLimiter(config.max_inflight_bytes, config.max_outstanding)

    # --- public verbs --------------------------------------------------------------------

    async def read(self, node: NodeEndpoint, ios: Sequence[SlotIO]) -> None:
        await self._batch("read", node, ios, self._read)

    async def write(self, node: NodeEndpoint, ios: Sequence[SlotIO]) -> None:
        await self._batch("write", node, ios, self._write)

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to drop by default
        """Drop connections and mappings; later calls may reopen them."""

    def forget(self, node: str) -> None:  # noqa: B027 - optional hook
        """Drop cached state for a node (it failed or restarted); the next call reconnects."""

    @classmethod
    def export(cls, arena: Arena, host: str, config: TransportConfig) -> ArenaExport | None:
        """Memory-node hook: register the arena with this transport's engine, if it needs one."""
        return None

    # --- for implementations -------------------------------------------------------------

    @abstractmethod
    async def _read(self, node: NodeEndpoint, ios: Sequence[SlotIO]) -> None:
        """One request (already bounded); on cancellation must leave ``ios`` untouched after return."""

    @abstractmethod
    async def _write(self, node: NodeEndpoint, ios: Sequence[SlotIO]) -> None: ...

    async def _batch(
        self,
        op: str,
        node: NodeEndpoint,
        ios: Sequence[SlotIO],
        run: Callable[[NodeEndpoint, Sequence[SlotIO]], Awaitable[None]],
    ) -> None:
        if not ios:
            return
        requests = split_requests(ios, min(self.request_bytes, self.config.max_inflight_bytes), self.request_blocks)
        sizes = [[len(io.buf) for io in r] for r in requests]
        slots = [io.slot for io in ios]
        if min(slots) < 0 or max(slots) >= node.capacity_blocks or max(map(max, sizes)) > node.slot_bytes:
            bad = next(io for io in ios if not 0 <= io.slot < node.capacity_blocks or len(io.buf) > node.slot_bytes)
            raise TransferError(
                f"{op} of slot {bad.slot} ({len(bad.buf)} B) does not fit memory node {node.name} "
                f"({node.capacity_blocks} slots of {node.slot_bytes} B)"
            )
        try:
            async with asyncio.timeout(self.config.timeout_s):
                await all_or_nothing([self._bounded(run, node, r, sum(n))
                                      for r, n in zip(requests, sizes, strict=True)])
        except TimeoutError:
            self.forget(node.name)
            raise TransferTimeout(
                f"{op} of {len(ios)} blocks on memory node {node.name} did not finish within "
                f"{self.config.timeout_s}s ({self.name} transport)"
            ) from None
        except TransferError:
            self.forget(node.name)
            raise
        except (OSError, EOFError) as exc:
            self.forget(node.name)
            raise TransferError(f"{op} on memory node {node.name} failed: {exc!r}") from exc

    async def _bounded(
        self, run: Callable[[NodeEndpoint, Sequence[SlotIO]], Awaitable[None]], node: NodeEndpoint,
        ios: Sequence[SlotIO], nbytes: int,
    ) -> None:
        charge = await self.limiter.acquire(nbytes)
        try:
            await run(node, ios)
        finally:
            self.limiter.release(charge)


def split_requests(ios: Sequence[SlotIO], max_bytes: int, max_blocks: int = REQUEST_BLOCKS) -> list[Sequence[SlotIO]]:
    """Consecutive runs of at most ``max_bytes`` (at least one slot) and ``max_blocks`` slots."""
    out: list[Sequence[SlotIO]] = []
    start, size = 0, 0
    for i, n in enumerate(map(len, (io.buf for io in ios))):
        if i > start and (size + n > max_bytes or i - start >= max_blocks):
            out.append(ios[start:i])
            start, size = i, 0
        size += n
    out.append(ios[start:])
    return out


async def all_or_nothing(coros: Sequence[Awaitable[None]]) -> None:
    """Run all; on the first failure (or our cancellation) cancel and await the rest, then raise.

    Awaiting the cancelled siblings matters: they may be copying into caller buffers, and
    the contract says nothing touches those buffers once the batch has raised.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    errors = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
    if errors:
        first = errors[0]
        assert first is not None
        if isinstance(first, TesseraError | OSError | EOFError):
            raise first
        raise TransferError(f"transfer failed: {first!r}") from first


# --- registry by name ----------------------------------------------------------------------

# built-ins are imported on first use, so a missing optional engine only matters when chosen
TRANSPORTS: Registry[type[Transport]] = Registry("transport.name", {
    "shm": "tessera.transport.shm", "tcp": "tessera.transport.tcp", "mooncake": "tessera.transport.mooncake"})
register_transport = TRANSPORTS.register
transport_class = TRANSPORTS.get


def create_transport(config: TransportConfig, credentials: DataPlaneCredentials | None = None) -> Transport:
    return transport_class(config.name)(config, credentials)
