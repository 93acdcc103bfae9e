"""Giving the memory of finished requests back to the operating system once a node is idle.

A request's KV tensors are freed when it ends, but glibc keeps freed heap memory in its
arenas for reuse, so after a burst of load RSS would stay at the burst's peak.
``malloc_trim(0)`` returns the free pages of every arena; it is cheap but not free, so the
node calls it once per idle spell.

What stays is what the node keeps on purpose, bounded by its config: the local unit cache
(``local_capacity_blocks``) and the exact-prefix cache (``prefix_cache_tokens``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


class IdleTrim:
    """Trims the C heap once after each spell of work; a no-op where libc has no ``malloc_trim``."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        self._trim = getattr(libc, "malloc_trim", None)
        self._trimmed_at = -1  # the work counter at the last trim

    def idle(self, work_done: int) -> bool:
        """The node is idle after ``work_done`` engine steps in all; trim if it worked since the last trim."""
        if self._trim is None or work_done == self._trimmed_at:
            return False
        self._trimmed_at = work_done
        self._trim(0)
        return True
