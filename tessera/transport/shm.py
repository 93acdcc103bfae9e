"""``shm`` transport: same host, one-sided. The client maps the arena and copies slots itself.

No request ever reaches the memory node's process: a read is a memcpy out of the mapped
segment, a write a memcpy into it. What the client checks instead of a handshake: the
segment's header names the boot id the client expects (a restarted node has a new segment
and its old one is unlinked) and the owner process is alive (a killed node's segment can
outlive it, but its blocks are no longer the directory's).

Requests of multi-MiB blocks are copied on a small thread pool (numpy releases the GIL) so
the event loop keeps serving; smaller ones are bare memcpys on the loop (see SMALL_BLOCK_BYTES).
A cancelled copy is awaited to the end, never abandoned mid-buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tessera.config import TransportConfig
from tessera.errors import TransferError
from tessera.transport.arena import ARENA_HEADER_BYTES, Arena
from tessera.transport.base import NodeEndpoint, SlotIO, Transport, register_transport
from tessera.transport.handshake import DataPlaneCredentials

# requests up to this size are copied on the event loop (a thread hop costs more) ...
INLINE_COPY_BYTES = 512 << 10
# ... and so are requests of blocks below 1 MiB: a memoryview assignment per block runs near
# memcpy speed, faster than GIL-releasing copies plus the thread hop. A request is at most
# 4 MiB, which bounds the loop's stall; multi-MiB blocks go to the thread.
SMALL_BLOCK_BYTES = 1 << 20


def copy_pairs(pairs: Sequence[tuple[memoryview, memoryview]]) -> None:
    """dst[:] = src for each pair, through numpy so that the GIL is released."""
    for dst, src in pairs:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def copy_pairs_now(pairs: Sequence[tuple[memoryview, memoryview]]) -> None:
    """dst[:] = src for each pair, holding the GIL (cheapest per copy)."""
    for dst, src in pairs:
        dst[:] = src


@register_transport("shm")
class ShmTransport(Transport):
    def __init__(self, config: TransportConfig, credentials: DataPlaneCredentials | None = None) -> None:
        super().__init__(config, credentials)
        self._arenas: dict[str, Arena] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _arena(self, node: NodeEndpoint) -> Arena:
        arena = self._arenas.get(node.name)
        if arena is None or arena.name != node.shm_name:
            self.forget(node.name)
            arena = Arena.attach(node.shm_name)
            expected = (node.boot_id, node.slot_bytes, node.capacity_blocks)
            if (arena.boot_id, arena.slot_bytes, arena.capacity) != expected:
                arena.close()
                raise TransferError(
                    f"segment {node.shm_name} belongs to boot {arena.boot_id} with {arena.slot_bytes}-byte slots; "
                    f"expected memory node {node.name} boot {node.boot_id} with {node.slot_bytes}-byte slots"
                )
            self._arenas[node.name] = arena
        if not arena.owner_alive():
            self.forget(node.name)
            raise TransferError(f"memory node {node.name} (pid {arena.pid}) is not running; its arena is stale")
        return arena

    # bounds were checked against the endpoint, and the endpoint against the arena

    async def _read(self, node: NodeEndpoint, ios: Sequence[SlotIO]) -> None:
        arena = self._arena(node)
        view, size, base = arena.view, arena.slot_bytes, ARENA_HEADER_BYTES
        if self._inline(ios):  # the hot path for small blocks: one bare memcpy each, no lists
            for io in ios:
                start = base + io.slot * size
                io.buf[:] = view[start : start + len(io.buf)]
            return
        await self._offload([(io.buf, view[base + io.slot * size : base + io.slot * size + len(io.buf)])
                             for io in ios])

    async def _write(self, node: NodeEndpoint, ios: Sequence[SlotIO]) -> None:
        arena = self._arena(node)
        view, size, base = arena.view, arena.slot_bytes, ARENA_HEADER_BYTES
        if self._inline(ios):
            for io in ios:
                start = base + io.slot * size
                view[start : start + len(io.buf)] = io.buf
            return
        await self._offload([(view[base + io.slot * size : base + io.slot * size + len(io.buf)], io.buf)
                             for io in ios])

    @staticmethod
    def _inline(ios: Sequence[SlotIO]) -> bool:
        total = sum(map(len, (io.buf for io in ios)))
        return total <= INLINE_COPY_BYTES or total <= SMALL_BLOCK_BYTES * len(ios)

    async def _offload(self, pairs: list[tuple[memoryview, memoryview]]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tessera-shm")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, copy_pairs, pairs)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            # the copy cannot be interrupted; let it finish before the caller reuses its buffers
            with contextlib.suppress(Exception):
                await asyncio.wait([fut])
            raise

    def forget(self, node: str) -> None:
        arena = self._arenas.pop(node, None)
        if arena is not None:
            arena.close()

    async def close(self) -> None:
        for name in list(self._arenas):
            self.forget(name)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
