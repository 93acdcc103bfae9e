"""Which write grant last wrote each slot of one arena: a memory node's tcp server makes grants single-use.

A write capability (see :func:`tessera.auth.capability`) stays valid until it expires, so
without memory a copy of one (taken off the wire) could overwrite a published entry's blocks
for its whole life: the block MAC keeps the forged data from being served, but every read
fails its check and the unit is recomputed. The ledger remembers, per slot, the epoch and
capability that last wrote it, for as long as that capability is valid, and refuses a write

* under the same capability: a grant writes each of its slots once (its writer writes every
  block before it publishes, so after publish nothing more can be written under it);
* under an older epoch: epochs grow with every grant, so a newer grant owns the slot now and
  the older one was cancelled or expired. Its capability expires no later than the newer
  one's (write capabilities all live ``write_timeout_s`` + grace), so the record outlives it.

A slot that a cancelled grant never wrote may still be written under it until it expires;
that is harmless: the slot is free, and the next grant's write (a newer epoch) replaces it.
Records older than their capability are ignored, so a control plane that restarted without
its data directory (epochs start again from the same base) is refused at most until the
previous incarnation's capabilities have expired.

The ledger knows nothing about units, entries or the control plane.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


class WriteLedger:
    """``refusal(slots, epoch, expires, mac) -> reason | None`` then ``record(...)``; bounded by the arena."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._last: dict[int, tuple[int, int, bytes]] = {}  # slot -> (epoch, expires, mac) of its last write

    def refusal(self, slots: Iterable[int], epoch: int, mac: bytes) -> str | None:
        """Why a write of ``slots`` under this capability must be refused, or None."""
        now = self.clock()
        for slot in slots:
            last = self._last.get(slot)
            if last is None or last[1] < now:
                continue
            if epoch < last[0]:
                return (f"slot {slot} was written under epoch {last[0]} since: a write under the older "
                        f"epoch {epoch} is stale")
            if epoch == last[0] and last[2] == mac:
                return (f"slot {slot} was already written under this write grant (epoch {epoch}): "
                        "a grant is single-use")
        return None

    def record(self, slots: Iterable[int], epoch: int, expires: int, mac: bytes) -> None:
        for slot in slots:
            self._last[slot] = (epoch, expires, mac)
