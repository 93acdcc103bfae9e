"""A generation node's measured work to a first token: under its current load, and alone.

The overload bound promises a first token within ``control.max_queue_wait_s`` plus one
service time (a request's time on an idle node). Under load a request's own work is slower
than alone: it shares engine steps with other requests and busy engines share the host's
cores. So ``excess_s``, the :data:`QUANTILE` of recent work less the alone mean, moves the
scheduler's start deadline earlier, and the allowed queueing plus the slower work still fit
the promise. A node that never ran a request alone takes its fastest sample as "alone".
"""

from __future__ import annotations

from collections import deque

WINDOW = 32  # recent requests: more than one engine batch starts, so a batch's burst does not dominate
QUANTILE = 0.9  # the slow tail the deadline leaves room for
ALONE_DECAY = 0.8  # weight of the previous alone mean when a new alone sample comes


class FirstTokenWork:
    """Seconds from a request's first engine step to its first token, recent and alone."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.alone_s: float | None = None  # decayed mean over requests that had the node to themselves

    def observe(self, work_s: float, alone: bool) -> None:
        """One request reached its first token ``work_s`` after its first step; ``alone``: nothing
        else was on the node when it arrived."""
        self.recent.append(work_s)
        if alone:
            self.alone_s = work_s if self.alone_s is None else ALONE_DECAY * self.alone_s + (1 - ALONE_DECAY) * work_s

    def excess_s(self) -> float:
        """How much longer than alone the slow tail of recent requests took (0 until measured)."""
        if not self.recent:
            return 0.0
        ordered = sorted(self.recent)
        tail = ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]
        alone = self.alone_s if self.alone_s is not None else ordered[0]
        return max(0.0, tail - alone)
