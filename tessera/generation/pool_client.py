"""The generation node's client of the shared KV Pool: ``fetch`` under a lease, ``store`` under a grant.

Safe publication (paper §5.4), from the writer's side:

1. ``store`` renews a grant with less than a write's time left (on a busy node the unit may
   be computed long after the plan), and refuses to write when a memory node it would write
   to restarted after the grant was received (the slots are not ours anymore);
2. it encodes every block with its header (unit, epoch, index, token counts, CRC-32) and
   writes all of them, on every node concurrently;
3. only after *every* write has completed does it ask the control plane to publish;
4. if any write fails or times out it cancels the reservation with a settle time that
   covers writes still in flight (so the blocks are quarantined, not reused at once).

A reader's ``fetch`` reads the leased blocks from their memory nodes, verifies every header
and checksum against the lease and assembles the ``[L, T, H_kv, D]`` tensors; any mismatch is
a failed fetch (:class:`ChecksumMismatch`), and the caller falls back to computing the unit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import TypeVar

from tessera.auth import ClusterAuth, block_mac_key
from tessera.config import ClusterConfig
from tessera.control.client import ControlClient
from tessera.engines.base import UnitState
from tessera.errors import ChecksumMismatch, ControlPlaneError, TransferError
from tessera.generation.pool_endpoints import EndpointBook
from tessera.messages.common import BlockRef
from tessera.messages.control import CancelRequest, PublishRequest, RenewRequest
from tessera.messages.plan import NodeToken, ReadLease, WriteGrant
from tessera.transport.base import SlotIO, Transport, all_or_nothing, create_transport
from tessera.transport.blocks import BlockLayout
from tessera.transport.frames import Capability
from tessera.transport.handshake import DataPlaneCredentials
from tessera.transport.unit_blocks import decode_unit, encode_unit
from tessera.wire import WIRE_VERSION

log = logging.getLogger(__name__)
T = TypeVar("T")
# encode/decode larger than this run on a thread (crc32 and tensor copies release the GIL)
OFFLOAD_BYTES = 1 << 20


class KVPoolClient:
    """``fetch(lease, n_tokens) -> UnitState`` and ``store(grant, state)``; ``close`` when done."""

    def __init__(
        self,
        config: ClusterConfig,
        layout: BlockLayout,
        *,
        transport: Transport | None = None,
        control: ControlClient | None = None,
        endpoints: EndpointBook | None = None,
        reader: str = "",
        pin_memory: bool = False,
    ) -> None:
        auth = ClusterAuth.from_config(config)
        if auth.secret is not None and layout.mac_key is None:  # every block is signed and checked
            layout = dataclasses.replace(layout, mac_key=block_mac_key(auth.secret))
        self.layout = layout
        self.reader = reader
        # fetched states land in pinned buffers when the engine copies them to a CUDA device
        self.pin_memory = pin_memory
        # data connections authenticate as this generation node (``reader``), whose leases and grants they carry
        self.transport = transport or create_transport(config.transport,
                                                       DataPlaneCredentials.of(auth, reader or None))
        self.control = control or ControlClient(config.control_url, timeout_s=config.transport.timeout_s,
                                                auth=auth)
        self.endpoints = endpoints or EndpointBook.from_config(config)
        # writes abandoned by a failed store may still land for up to the transport's own
        # timeout (Mooncake's engine rounds it up to whole seconds); the cancel waits that out
        self.settle_s = math.ceil(config.transport.timeout_s) + 1.0
        self.timeout_s = config.transport.timeout_s
        # a write takes at most a transfer timeout, then its publish one control RPC: a grant
        # with less left than this is renewed before writing, so its publish is not refused
        self.renew_margin_s = 2 * self.timeout_s + 1.0
        self.renewed = 0  # grants renewed (or reissued) before their write

    async def close(self) -> None:
        await self.transport.close()
        await self.endpoints.close()
        await self.control.close()

    # --- reader --------------------------------------------------------------------------

    async def fetch(
        self, lease: ReadLease, n_tokens: int, *, release: bool = True, received_at: float | None = None
    ) -> UnitState:
        """Read and verify a leased unit; releases the lease afterwards unless ``release=False``.

        ``received_at`` (``time.monotonic()`` when the lease arrived) lets the client refuse to
        start a copy that could outlive the lease: the blocks are protected only until it ends.
        """
        try:
            if received_at is not None and time.monotonic() + self.timeout_s > received_at + lease.ttl_s:
                raise TransferError(f"lease {lease.lease_id} on unit {lease.unit_id} has less than a "
                                    f"transfer timeout ({self.timeout_s}s) left; not starting the copy")
            if len(lease.blocks) != self.layout.n_blocks(n_tokens):
                raise ChecksumMismatch(f"unit {lease.unit_id}: lease lists {len(lease.blocks)} blocks, "
                                       f"{n_tokens} tokens need {self.layout.n_blocks(n_tokens)}")
            sizes = [self.layout.used_bytes(b, n_tokens) for b in range(len(lease.blocks))]
            whole = memoryview(bytearray(sum(sizes)))
            views, offset = [], 0
            for size in sizes:
                views.append(whole[offset : offset + size])
                offset += size
            await self._move(lease.blocks, views, write=False, epoch=lease.epoch, tokens=lease.tokens)
            try:
                return await self._maybe_offload(
                    len(whole), lambda: decode_unit(self.layout, views, lease.unit_id, lease.epoch, n_tokens,
                                               pin_memory=self.pin_memory))
            except ChecksumMismatch as exc:
                for node in {ref.node for ref in lease.blocks}:  # a restarted node shows up as this
                    self.endpoints.forget(node)
                # corrupt (or overwritten) in the pool: every later reader would fail the same way
                await self.control.invalidate(lease.unit_id, lease.epoch, self.reader, str(exc)[:200])
                raise
        finally:
            if release:
                await self._release(lease)

    async def late_lease(self, unit_id: str) -> ReadLease | None:
        """A lease on ``unit_id`` for this node if the shared tier holds it READY now."""
        return await self.control.late_lease(unit_id, self.reader)

    async def _release(self, lease: ReadLease) -> None:
        try:
            await self.control.release((lease.lease_id,))
        except ControlPlaneError as exc:
            log.warning("could not release lease %s (it expires on its own): %s", lease.lease_id, exc)

    # --- writer --------------------------------------------------------------------------

    async def store(self, grant: WriteGrant, state: UnitState, *, received_at: float | None = None) -> bool:
        """Write every block, then publish; on failure cancel (with settle time) and raise.

        ``received_at`` is the ``time.monotonic()`` at which the grant arrived (default: now).
        A grant with less than a write's time left (:attr:`renew_margin_s`) is renewed first:
        the control plane extends it, or reserves anew if it lapsed while the unit waited
        to be computed. Returns False, writing nothing, when the plane no longer wants the
        write (another writer's entry, revoked, no room). Raises TransferError/TransferTimeout
        (nothing published), PublishRejected (the control plane refused: stale epoch, expired
        reservation) or ControlPlaneError.
        """
        received = time.monotonic() if received_at is None else received_at
        n = state.n_tokens
        assert n == grant.n_tokens and len(grant.blocks) == self.layout.n_blocks(n), (
            f"unit {grant.unit_id}: state of {n} tokens does not match the grant "
            f"({grant.n_tokens} tokens, {len(grant.blocks)} blocks)"
        )
        assert state.keys.device.type == "cpu", (
            f"unit {grant.unit_id}: state.keys is on {state.keys.device}; the retainer stages it to host first")
        restarted = sorted({b.node for b in grant.blocks if self.endpoints.restarted_since(b.node, received)})
        if restarted:
            await self._cancel(grant, 0.0)
            raise TransferError(f"unit {grant.unit_id}: memory node(s) {', '.join(restarted)} "
                                "restarted after the grant")
        # (at most half the grant: a cluster configured with grants shorter than a write would
        # otherwise renew every one)
        if time.monotonic() + min(self.renew_margin_s, grant.deadline_s / 2) > received + grant.deadline_s:
            renewed = await self.control.renew(RenewRequest(WIRE_VERSION, grant.unit_id, grant.epoch, grant.writer,
                                                            grant.n_tokens, len(grant.blocks)))
            if renewed.grant is None:
                log.info("writeback of unit %s not needed any more: %s", grant.unit_id, renewed.reason)
                return False
            grant, received = renewed.grant, time.monotonic()
            self.renewed += 1
        views = await self._maybe_offload(
            state.nbytes(), lambda: encode_unit(self.layout, state, grant.unit_id, grant.epoch))
        try:
            await self._move(grant.blocks, views, write=True, epoch=grant.epoch, tokens=grant.tokens)
        except TransferError:
            await self._cancel(grant, self.settle_s)
            raise
        await self.control.publish(PublishRequest(WIRE_VERSION, grant.unit_id, grant.epoch, grant.writer, grant.blocks))
        return True

    async def _cancel(self, grant: WriteGrant, settle_s: float) -> None:
        try:
            await self.control.cancel(CancelRequest(WIRE_VERSION, grant.unit_id, grant.epoch, grant.writer, settle_s))
        except ControlPlaneError as exc:
            log.warning("could not cancel reservation of %s epoch %d (it expires at its deadline): %s",
                        grant.unit_id, grant.epoch, exc)

    # --- shared --------------------------------------------------------------------------

    async def _move(self, blocks: tuple[BlockRef, ...], views: list[memoryview], *, write: bool, epoch: int = 0,
                    tokens: tuple[NodeToken, ...] = ()) -> None:
        caps = capabilities(blocks, epoch, tokens)
        by_node: dict[str, list[SlotIO]] = {}
        for ref, view in zip(blocks, views, strict=True):
            by_node.setdefault(ref.node, []).append(SlotIO(ref.index, view, caps.get(ref.node)))
        endpoints = {}
        for node in by_node:
            ep = endpoints[node] = await self.endpoints.get(node)
            if ep.slot_bytes != self.layout.slot_bytes:
                raise TransferError(
                    f"memory node {node} has {ep.slot_bytes}-byte slots but this node's blocks need "
                    f"{self.layout.slot_bytes} B: the two run with another model, kv_dtype or block_tokens")
        op = self.transport.write if write else self.transport.read
        try:
            await all_or_nothing([op(endpoints[node], ios) for node, ios in by_node.items()])
        except TransferError:
            # ask the nodes where they are next time (the transport already dropped the
            # connection that failed; the others may carry other callers' transfers)
            for node in by_node:
                self.endpoints.forget(node)
            raise

    @staticmethod
    async def _maybe_offload(nbytes: int, fn: Callable[[], T]) -> T:
        if nbytes <= OFFLOAD_BYTES:
            return fn()
        return await asyncio.to_thread(fn)


def capabilities(blocks: tuple[BlockRef, ...], epoch: int, tokens: tuple[NodeToken, ...]) -> dict[str, Capability]:
    """The transport-level capability per memory node: the token plus the slots it covers, in order."""
    slots: dict[str, list[int]] = {}
    for ref in blocks:
        slots.setdefault(ref.node, []).append(ref.index)
    return {t.node: Capability(epoch, t.expires, tuple(slots.get(t.node, ())), bytes.fromhex(t.mac), t.holder)
            for t in tokens}
