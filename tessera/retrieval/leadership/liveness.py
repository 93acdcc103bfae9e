"""The leader's heartbeats, as a retrieval replica that does not lead sees them (``[ha]``).

Only the leader hears the generation nodes' heartbeats, so only it can tell a slow node from
a gone one (:mod:`tessera.control.pace`). A follower's waits ask it over
``/control/liveness``: one question for every node and every wait of this process at a time,
at most every ``REFRESH_S`` however many requests wait, and none while nothing waits.

A heartbeat's time comes as seconds before the leader's answer; it is placed on this
process's clock at the answer's arrival, the latest it can have been, so a node is taken for
heard (slow) rather than gone when the round trip blurs the two. An answer older than
``stale_s`` (the leader unreachable, a failover under way) is no authority: then every node
counts as alive and heard, and a late one fails as slow (503) rather than being retried
elsewhere on a guess.

This module knows nothing of requests; :class:`~tessera.control.pace.RemoteWatch` reads it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from tessera.control.client import RequestControl
from tessera.errors import TesseraError
from tessera.runtime import BackgroundTasks

log = logging.getLogger(__name__)
REFRESH_S = 0.25  # a younger answer is reused (waits look at their node every 0.5 s)


class LeaderLiveness:
    """Implements :class:`~tessera.control.pace.Heard`: ``refresh``, then ``alive`` / ``heard_since`` /
    ``progressed_since``."""

    def __init__(self, control: RequestControl, nodes: Sequence[str], stale_s: float, tasks: BackgroundTasks,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.control = control
        self.nodes = tuple(nodes)
        self.stale_s = stale_s
        self.tasks = tasks  # the question in flight is the office's: cancelled when it stops
        self.now = clock
        # name -> (alive, last heartbeat, last heartbeat that showed prompt work run), on our clock
        self._view: dict[str, tuple[bool, float | None, float | None]] = {}
        self._answered_at: float | None = None
        self._asked_at = float("-inf")
        self._asking: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        if self._asking is None or self._asking.done():
            if self.now() - self._asked_at < REFRESH_S:
                return
            self._asked_at = self.now()
            self._asking = self.tasks.spawn(self._ask(), name="leader-liveness")
        # shielded: a wait given up (its client went away) does not cancel the others' question
        await asyncio.shield(self._asking)

    async def _ask(self) -> None:
        try:
            report = await self.control.liveness(self.nodes)
        except TesseraError as exc:
            log.debug("the leader's liveness view is out of reach: %s", exc)
            return
        got = self.now()
        self._view = {n.name: (n.alive, _at(got, n.heard_s_ago), _at(got, n.progressed_s_ago)) for n in report.nodes}
        self._answered_at = got

    def _current(self, name: str) -> tuple[bool, float | None, float | None] | None:
        """The leader's word on ``name``, or None when there is no recent one."""
        if self._answered_at is None or self.now() - self._answered_at > self.stale_s:
            return None
        return self._view.get(name)

    def alive(self, name: str) -> bool:
        view = self._current(name)
        return view is None or view[0]

    def heard_since(self, name: str, since: float) -> bool:
        view = self._current(name)
        if view is None:
            return True
        heard_at = view[1]
        return heard_at is not None and heard_at >= since

    def progressed_since(self, name: str, since: float) -> bool:
        view = self._current(name)
        if view is None:
            return False  # no authority: a late node is slow, never waited on for longer
        moved_at = view[2]
        return moved_at is not None and moved_at >= since


def _at(got: float, s_ago: float) -> float | None:
    """A time the leader gave as seconds before its answer, on our clock (None: never)."""
    return None if s_ago < 0 else got - s_ago
