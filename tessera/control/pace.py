"""How long a request may take to its first token on a node, and whether a late node is slow or gone.

A node that still reports in is alive however long its work takes, so the deadline follows
the work: the prompt and the tokens queued ahead of it at the node's reported prefill rate,
plus its expected queueing, plus ``control.first_token_timeout_s`` as slack. A node that has
not reported a rate yet is priced at :data:`UNMEASURED_PREFILL_TOKENS_PER_S`, so its first
long prompt is not mistaken for a dead node.

A late node heard since the wait began is slow (its request fails, the node stays in
routing); one not heard since is gone (the request is retried elsewhere); one declared dead
meanwhile ends the wait at once. A late node whose heartbeats show it ran prompt work since
the wait began is neither: it is draining a queue the estimate priced too low (a burst of
retries after another node died lands on a node busy decoding its own requests, and every
prompt then costs a forward that carries all of them), so the wait goes on for another
``control.first_token_timeout_s`` as long as each such span shows the queue moving. A
replica that does not lead (:class:`RemoteWatch`) applies the same rules to the leader's
heartbeats; when the leader cannot be asked, late counts as slow.

This module knows nothing of HTTP; the retrieval role's node client applies the watch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from tessera.control.membership import GenerationMember

# tokens/s assumed before a node reports its prefill rate: slower than any configuration we
# serve, so an unmeasured node gets the benefit of the doubt (its heartbeats still catch a death)
UNMEASURED_PREFILL_TOKENS_PER_S = 50.0


def first_token_deadline_s(node: GenerationMember, prompt_tokens: int, slack_s: float) -> float:
    """Seconds a request of ``prompt_tokens`` may take to its first token on ``node``."""
    rate = node.prefill_tokens_per_s if node.prefill_tokens_per_s > 0 else UNMEASURED_PREFILL_TOKENS_PER_S
    work_s = (prompt_tokens + node.queued_tokens) / rate
    return slack_s + work_s + node.expected_wait_s()


class Watch(Protocol):
    """What a wait on a node looks at (see :class:`NodeWatch`)."""

    @property
    def name(self) -> str: ...

    @property
    def first_token_s(self) -> float: ...

    async def look(self) -> None:
        """Bring what ``alive`` and ``heard_since_mark`` answer up to date (a wait calls it at every look)."""
        ...

    def alive(self) -> bool: ...

    def mark(self) -> None: ...

    def heard_since_mark(self) -> bool: ...

    def progressed_since_mark(self) -> bool:
        """The node's heartbeats showed prompt work run after the current wait began."""
        ...


class Heard(Protocol):
    """The leader's heartbeats as a replica that does not lead sees them (on its own clock, ``now``)."""

    def now(self) -> float: ...

    async def refresh(self) -> None:
        """Ask the leader again, unless an answer is fresh enough or a question is already out."""
        ...

    def alive(self, name: str) -> bool:
        """False once the leader declared the node dead; True while nobody can tell."""
        ...

    def heard_since(self, name: str, since: float) -> bool:
        """The leader heard the node after ``since`` (``now()``'s clock); True while nobody can tell."""
        ...

    def progressed_since(self, name: str, since: float) -> bool:
        """The leader heard the node report prompt work run after ``since``; False while nobody can tell."""
        ...


class NodeWatch:
    """One attempt's view of its node: alive, heard since a wait began, and its first-token deadline.

    ``clock`` is the plane's (heartbeat times are on it); ``mark`` starts a wait.
    """

    def __init__(self, node: GenerationMember, clock: Callable[[], float], first_token_s: float) -> None:
        self._node = node
        self._clock = clock
        self.first_token_s = first_token_s
        self._since = clock()

    @property
    def name(self) -> str:
        return self._node.name

    async def look(self) -> None:
        pass  # the plane is in this process: its view is always current

    def alive(self) -> bool:
        """False once the plane declared the node dead (missed heartbeats, or suspected)."""
        return self._node.alive

    def mark(self) -> None:
        """A wait on the node begins now."""
        self._since = self._clock()

    def heard_since_mark(self) -> bool:
        """The node reported in (a heartbeat) after the current wait began: it is alive, only slow."""
        seen = self._node.last_seen
        return seen is not None and seen >= self._since

    def progressed_since_mark(self) -> bool:
        moved = self._node.progressed_at
        return moved is not None and moved >= self._since


class RemoteWatch:
    """A node routed by the leader's plane in another process: its deadline and heartbeats from there."""

    def __init__(self, name: str, first_token_s: float, heard: Heard) -> None:
        self.name = name
        self.first_token_s = first_token_s
        self._heard = heard
        self._since = heard.now()

    async def look(self) -> None:
        await self._heard.refresh()

    def alive(self) -> bool:
        return self._heard.alive(self.name)

    def mark(self) -> None:
        self._since = self._heard.now()

    def heard_since_mark(self) -> bool:
        return self._heard.heard_since(self.name, self._since)

    def progressed_since_mark(self) -> bool:
        return self._heard.progressed_since(self.name, self._since)


class PrefillRates:
    """The fleet's prefill rate, from the nodes' reports: what one block of prefill costs.

    The mean of the rates reported (nodes that measured none yet are left out), kept as a
    running sum so a heartbeat costs the same at any fleet size. ``block_s`` is None until
    some node measured its rate: the router then does not weigh waits against reuse.
    """

    __slots__ = ("_n", "_sum", "block_tokens")

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._sum = 0.0
        self._n = 0

    def report(self, was: float, now: float) -> None:
        """A node's reported rate went from ``was`` to ``now`` (tokens/s; 0: not measured)."""
        if _measured(was):
            self._sum -= was
            self._n -= 1
        if _measured(now):
            self._sum += now
            self._n += 1
        if not self._n:
            self._sum = 0.0  # no drift from the subtractions

    @property
    def block_s(self) -> float | None:
        return self.block_tokens * self._n / self._sum if self._n else None


def _measured(rate: float) -> bool:
    return math.isfinite(rate) and rate > 0
