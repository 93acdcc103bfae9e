"""The one fake clock of the tests: the simulated cluster's clock, moved only by the test."""

from __future__ import annotations

from tessera.control.simulated import SimulatedClock as Clock

__all__ = ["Clock"]
