"""``mooncake`` transport: Mooncake Transfer Engine (one-sided reads/writes of the arena).

The memory node registers its whole arena with an engine (:class:`MooncakeExport`) and
publishes the engine's session ("host:rpc_port") and the arena's address in ``/info``.
Clients move slots with batched engine transfers through *registered staging buffers*
(bounded by the transfer limiter, reused), because registering arbitrary caller buffers
per transfer is expensive under RDMA. Protocol ``tcp`` with ``P2PHANDSHAKE`` (no metadata
server) runs anywhere, including loopback in CI; protocol ``rdma`` is the same code on
real NICs (``[transport] mooncake_protocol``).

Engine calls block (the engine polls for completion) and run on worker threads. A caller
that gives up is released at once: the staging buffer stays out of the pool until the
engine returns, and nothing is copied into the caller's buffers after that point.

Needs the optional extra ``tessera[rdma]`` (PyPI ``mooncake-transfer-engine-non-cuda``)
and Debian's ``libibverbs1`` even for TCP (the engine links it unconditionally).
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tessera.config import TransportConfig
from tessera.errors import ConfigError, TransferError
from tessera.transport.arena import ARENA_HEADER_BYTES, Arena
from tessera.transport.base import ArenaExport, NodeEndpoint, SlotIO, Transport, register_transport
from tessera.transport.handshake import DataPlaneCredentials
from tessera.transport.shm import copy_pairs_now

INSTALL_HINT = ("the mooncake transport needs `pip install 'tessera[rdma]'` (mooncake-transfer-engine-non-cuda) "
                "and the Debian package libibverbs1 (`apt-get install -y libibverbs1`), even for protocol tcp")
_STAGE_MIN = 64 << 10
# engine calls of one client run one at a time: each busy-polls a core, and the 0.3.x engine
# fails concurrent batch calls to one target (rc -1)
MC_THREADS = 1


def load_engine_class() -> Any:
    """The TransferEngine class, or ConfigError saying exactly what is missing."""
    # the engine reads its transfer timeout once, at creation; default 30 s is set below per transport
    os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ConfigError(f"{INSTALL_HINT}; import failed: {exc}") from None
    return TransferEngine


def new_engine(host: str, protocol: str, device: str, timeout_s: float) -> Any:
    engine_cls = load_engine_class()
    os.environ["MC_TRANSFER_TIMEOUT"] = str(max(1, math.ceil(timeout_s)))
    engine = engine_cls()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise TransferError(f"mooncake engine failed to start on {host} with protocol {protocol} (rc {rc})")
    return engine


def local_ip_towards(host: str) -> str:
    """The address this host uses to reach ``host`` (what a peer engine can connect back to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class MooncakeExport(ArenaExport):
    """Memory-node side: the arena registered with a local engine for one-sided access."""

    def __init__(self, arena: Arena, host: str, config: TransportConfig) -> None:
        self.arena = arena
        self.engine = new_engine(host, config.mooncake_protocol, config.mooncake_device, config.timeout_s)
        self.base = arena.address
        rc = self.engine.register_memory(self.base, arena.nbytes)
        if rc != 0:
            raise TransferError(f"mooncake could not register the {arena.nbytes}-byte arena (rc {rc})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def endpoint_fields(self) -> dict[str, Any]:
        return {"engine_session": self.session, "engine_base": self.base}

    def close(self) -> None:
        self.engine.unregister_memory(self.base)
        self.engine = None


class _StagingPool:
    """Registered buffers by power-of-two size; total in use is bounded by the limiter."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._free: dict[int, list[np.ndarray]] = {}
        self._all: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        size = max(_STAGE_MIN, 1 << (nbytes - 1).bit_length())
        free = self._free.setdefault(size, [])
        if free:
            return free.pop()
        buf = np.empty(size, dtype=np.uint8)
        if self.engine.register_memory(buf.ctypes.data, size) != 0:
            raise TransferError(f"mooncake could not register a {size}-byte staging buffer")
        self._all.append(buf)
        return buf

    def give(self, buf: np.ndarray) -> None:
        self._free.setdefault(buf.nbytes, []).append(buf)

    def close(self) -> None:
        for buf in self._all:
            self.engine.unregister_memory(buf.ctypes.data)
        self._all.clear()
        self._free.clear()


@register_transport("mooncake")
class MooncakeTransport(Transport):
    # one engine call per batch: the engine splits and parallelizes it itself, and each call
    # busy-polls a thread, so fewer and larger calls are what it is fastest with
    request_bytes = 64 << 20
    request_blocks = 2048  # the 0.3.x engine fails (rc -1) batches of more entries

    def __init__(self, config: TransportConfig, credentials: DataPlaneCredentials | None = None) -> None:
        super().__init__(config, credentials)
        load_engine_class()  # fail at construction, with the install hint, not at first transfer
        self._engine: Any = None
        self._staging: _StagingPool | None = None
        self._pool = ThreadPoolExecutor(max_workers=min(MC_THREADS, config.max_outstanding),
                                        thread_name_prefix="tessera-mc")

    @classmethod
    def export(cls, arena: Arena, host: str, config: TransportConfig) -> ArenaExport | None:
        return MooncakeExport(arena, host, config)

    def _ready(self, node: NodeEndpoint) -> _StagingPool:
        if not node.engine_session:
            raise TransferError(f"memory node {node.name} does not export its arena to mooncake "
                                "(it runs with another [transport] name)")
        if self._staging is None:
            host = local_ip_towards(node.data_host)
            self._engine = new_engine(host, self.config.mooncake_protocol, self.config.mooncake_device,
                                      self.config.timeout_s)
            self._staging = _StagingPool(self._engine)
        return self._staging

    async def _transfer(self, node: NodeEndpoint, ios: Sequence[SlotIO], write: bool) -> None:
        staging = self._ready(node)
        lengths = [len(io.buf) for io in ios]
        stage = staging.take(sum(lengths))
        offsets = np.cumsum([0, *lengths[:-1]]).tolist()
        views = [stage.data[off : off + n] for off, n in zip(offsets, lengths, strict=True)]
        if write:
            copy_pairs_now([(view, io.buf) for view, io in zip(views, ios, strict=True)])
        local = [stage.ctypes.data + off for off in offsets]
        remote = [node.engine_base + ARENA_HEADER_BYTES + io.slot * node.slot_bytes for io in ios]
        call = self._engine.batch_transfer_sync_write if write else self._engine.batch_transfer_sync_read
        fut = asyncio.get_running_loop().run_in_executor(self._pool, call, node.engine_session, local, remote, lengths)
        try:
            rc = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # the engine still owns the staging buffer; it returns to the pool when the call ends
            fut.add_done_callback(lambda _: staging.give(stage))
            raise
        except BaseException:
            staging.give(stage)
            raise
        try:
            if rc != 0:
                raise TransferError(f"mooncake {'write' if write else 'read'} of {len(ios)} blocks on memory node "
                                    f"{node.name} ({node.engine_session}) failed (rc {rc})")
            if not write:
                copy_pairs_now([(io.buf, view) for view, io in zip(views, ios, strict=True)])
        finally:
            staging.give(stage)

    async def _read(self, node: NodeEndpoint, ios: Sequence[SlotIO]) -> None:
        await self._transfer(node, ios, write=False)

    async def _write(self, node: NodeEndpoint, ios: Sequence[SlotIO]) -> None:
        await self._transfer(node, ios, write=True)

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._staging is not None:
            self._staging.close()
        self._staging = None
        self._engine = None
        self._pool = ThreadPoolExecutor(max_workers=min(MC_THREADS, self.config.max_outstanding),
                                        thread_name_prefix="tessera-mc")
