"""How long a request may take to its first token on a node, and whether a late node is slow or gone.

A node that still reports in is alive, however long its work takes: a ~7,000-token prompt
needs over a minute of prefill on one CPU thread, and a fixed first-token deadline treated
that as a dead node (the request was retried elsewhere, missed again, and both nodes left
routing). So the deadline follows the work: the request's prompt tokens and the tokens
queued ahead of it, at the prefill rate the node measured and reports with its heartbeat,
plus the node's expected queueing (:meth:`GenerationMember.expected_wait_s`), plus
``control.first_token_timeout_s`` as slack. Until a node has measured its rate, the slack
alone is the deadline.

Missing the deadline is judged by the heartbeat (:class:`NodeWatch`): a node heard since the
wait began is slow (its request fails, the node keeps serving the others and stays in
routing); a node not heard since is gone (its request is retried elsewhere). A node the
plane declared dead meanwhile (missed heartbeats) ends the wait at once.

A replica that does not lead (``[ha]``) hears no heartbeats: its :class:`RemoteWatch` takes
the deadline the leader computed and counts a node that missed it as slow (the request fails
with a 503, it is not retried; a node that broke the connection still fails at once).

This module knows nothing of HTTP; the retrieval role's node client applies the watch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tessera.control.membership import GenerationMember


def first_token_deadline_s(node: GenerationMember, prompt_tokens: int, slack_s: float) -> float:
    """Seconds a request of ``prompt_tokens`` may take to its first token on ``node``."""
    rate = node.prefill_tokens_per_s
    work_s = (prompt_tokens + node.queued_tokens) / rate if rate > 0 else 0.0
    return slack_s + work_s + node.expected_wait_s()


class Watch(Protocol):
    """What a wait on a node looks at (see :class:`NodeWatch`)."""

    @property
    def name(self) -> str: ...

    @property
    def first_token_s(self) -> float: ...

    def alive(self) -> bool: ...

    def mark(self) -> None: ...

    def heard_since_mark(self) -> bool: ...


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


class RemoteWatch:
    """A node routed by another process's plane: its deadline from the leader, no heartbeats here.

    Never declared dead (only the leader could); past a deadline it is slow, not gone.
    """

    def __init__(self, name: str, first_token_s: float) -> None:
        self.name = name
        self.first_token_s = first_token_s

    def alive(self) -> bool:
        return True

    def mark(self) -> None:
        pass

    def heard_since_mark(self) -> bool:
        return True
