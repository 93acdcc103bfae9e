"""The one fake clock of the tests."""

from __future__ import annotations


class Clock:
    """The one fake clock of the tests: time moves only when a test advances it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
