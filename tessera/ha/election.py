"""Leader election on etcd: a lease, campaign, observe, resign (etcd's ``concurrency.Election``).

The recipe is the one etcd's Go client implements (``clientv3/concurrency/election.go``),
over the plain KV, lease and watch APIs that every etcd v3 serves (the ``aetcd`` client has
no binding of the ``v3election`` service):

1. grant a lease of ``ttl_s`` and create ``<name>/<lease id>`` under it (a transaction: only
   if that key does not exist yet);
2. the candidate whose key has the lowest creation revision under ``<name>/`` is the leader;
   the others wait for the deletion of the key just before theirs (it expires with its
   lease, or its owner resigns);
3. the leader keeps the lease alive. Its **term** is its key's creation revision: etcd's
   revisions only grow, so every later leader has a larger term.

A leader that cannot renew stops before its lease could have run out: :attr:`Leadership.valid`
is true only until ``sent + ttl - margin``, where ``sent`` is when the last successful renewal
was *sent* (etcd extends the lease when it receives the request, which is later). Once that
moment passes without a renewal the leadership is :attr:`~Leadership.lost` for good, even if a
late renewal would still succeed: the process must stop issuing anything under its term.

This module knows nothing about the control plane, nor about credentials (the caller hands it a
client: :func:`tessera.ha.etcd_client.connect`); the caller decides what "stop" means.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aetcd
import aetcd.exceptions
import aetcd.rtypes

from tessera.errors import TesseraError

log = logging.getLogger(__name__)


class LeadershipLost(TesseraError):
    """The lease ran out (or could not be renewed in time) before this candidate led."""


@dataclass(frozen=True, slots=True)
class Leader:
    """Who leads: the value its candidate put (its address) and its term."""

    value: bytes
    term: int


def _prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


class Leadership:
    """This process leads under ``term`` while :attr:`valid`; :meth:`resign` ends it early."""

    def __init__(self, election: Election, key: bytes, lease: aetcd.Lease, term: int, valid_until: float) -> None:
        self.election = election
        self.key = key
        self.lease = lease
        self.term = term
        self._valid_until = valid_until  # time.monotonic() before which the lease cannot have run out
        self.lost = asyncio.Event()  # set once; never cleared
        self._keeper = asyncio.create_task(self._keep_alive(), name=f"lease-{lease.id:x}")

    @property
    def valid(self) -> bool:
        """True while the lease is certainly alive: everything issued now carries a live term."""
        if self.lost.is_set():
            return False
        if time.monotonic() >= self._valid_until:
            self._lose("the lease was not renewed in time")
            return False
        return True

    def remaining_s(self) -> float:
        return max(0.0, self._valid_until - time.monotonic()) if not self.lost.is_set() else 0.0

    def _lose(self, why: str) -> None:
        if not self.lost.is_set():
            log.warning("leadership of %s term %d lost: %s", self.election.name, self.term, why)
            self.lost.set()

    async def _keep_alive(self) -> None:
        ttl, margin = self.election.ttl_s, self.election.margin_s
        while self.valid:
            # renew three times per TTL; wake at the deadline at the latest to declare the loss
            await asyncio.sleep(min(ttl / 3, max(0.0, self._valid_until - time.monotonic())))
            if not self.valid:
                return
            sent = time.monotonic()
            try:
                reply = await asyncio.wait_for(self.election.client.refresh_lease(self.lease.id),
                                               timeout=max(0.05, self._valid_until - sent))
            except (TimeoutError, aetcd.exceptions.ClientError) as exc:
                log.info("lease %x renewal failed (%s); %.2fs of leadership left", self.lease.id, exc,
                         self.remaining_s())
                continue
            if reply is None or reply.TTL <= 0:
                self._lose("etcd says the lease expired")
                return
            if self.valid:  # a renewal that arrives after the deadline does not revive the term
                self._valid_until = sent + reply.TTL - margin

    async def resign(self) -> None:
        """Step down now: stop issuing, then revoke the lease so a successor need not wait for it."""
        self._lose("resigned")
        self._keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._keeper
        with contextlib.suppress(aetcd.exceptions.ClientError):
            await self.election.client.revoke_lease(self.lease.id)

    async def close(self) -> None:
        """Stop renewing without revoking (the lease runs out by itself); for tests of a dying leader."""
        self._lose("closed")
        self._keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._keeper


class Election:
    """Campaign for, observe and resign the leadership named ``name`` (an etcd key prefix)."""

    def __init__(self, client: aetcd.Client, name: str, *, ttl_s: int = 5, margin_s: float = 1.0) -> None:
        assert ttl_s >= 1 and 0 <= margin_s < ttl_s, (ttl_s, margin_s)
        self.client = client
        self.name = name
        self.prefix = name.rstrip("/").encode() + b"/"
        self.ttl_s = ttl_s
        self.margin_s = margin_s

    async def campaign(self, value: bytes) -> Leadership:
        """Wait until this candidate leads; returns its leadership (its term inside).

        The lease is kept alive from the start (a waiting candidate's key must not expire);
        a candidate whose lease is lost while it waits raises :class:`LeadershipLost`.
        """
        sent = time.monotonic()
        lease = await self.client.lease(self.ttl_s)
        key = self.prefix + f"{lease.id:x}".encode()
        tx = self.client.transactions
        await self.client.transaction(compare=[tx.create(key) == 0], success=[tx.put(key, value, lease)],
                                      failure=[])
        got = await self.client.get(key)
        assert got is not None, f"{key!r} vanished right after it was created"
        leadership = Leadership(self, key, lease, got.create_revision, sent + lease.ttl - self.margin_s)
        waiting = asyncio.create_task(self._wait_for_predecessors(leadership.term))
        lost = asyncio.create_task(leadership.lost.wait())
        try:
            await asyncio.wait((waiting, lost), return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not waiting.done():
                waiting.cancel()
        if not waiting.done() or waiting.cancelled() or not leadership.valid:
            await leadership.resign()
            raise LeadershipLost(f"lease {lease.id:x} of {self.name} expired while campaigning")
        waiting.result()  # re-raise a failed wait
        log.info("leader of %s with term %d", self.name, leadership.term)
        return leadership

    async def _wait_for_predecessors(self, term: int) -> None:
        """Return once no candidate key created before ``term`` is left."""
        while True:
            rows = await self.client.get_prefix(self.prefix)
            older = sorted((kv.create_revision, kv.key) for kv in rows if kv.create_revision < term)
            if not older:
                return
            _, key = older[-1]
            await self._wait_deleted(key)

    async def _wait_deleted(self, key: bytes) -> None:
        watch = await self.client.watch(key)
        try:
            if await self.client.get(key) is None:  # deleted before the watch started
                return
            async for event in watch:
                if event.kind == aetcd.rtypes.EventKind.DELETE:
                    return
        finally:
            await watch.cancel()

    async def leader(self) -> Leader | None:
        """The current leader, or None while there is none."""
        rows = list(await self.client.get_prefix(self.prefix))
        if not rows:
            return None
        first = min(rows, key=lambda kv: kv.create_revision)
        return Leader(first.value, first.create_revision)

    async def observe(self) -> AsyncIterator[Leader | None]:
        """The leader now, then again every time it changes (None: no leader for a while)."""
        watch = await self.client.watch(self.prefix, range_end=_prefix_end(self.prefix))
        try:
            last = await self.leader()
            yield last
            async for _ in watch:
                now = await self.leader()
                if now != last:
                    last = now
                    yield now
        finally:
            await watch.cancel()
