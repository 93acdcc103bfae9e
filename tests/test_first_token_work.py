"""The node's measured work to a first token (tessera/generation/work.py): pure logic."""

from __future__ import annotations

import pytest

from tessera.generation.work import WINDOW, FirstTokenWork


def test_nothing_measured_leaves_the_whole_budget() -> None:
    assert FirstTokenWork().excess_s() == 0.0


def test_the_excess_is_the_recent_slow_tail_over_the_work_alone() -> None:
    """Regression: under 3x load a request's own work to its first token took 4.2 s
    (p50) to 6.0 s (p99) against 1.7 s alone, so first tokens missed the promise although no
    request queued past the bound. The deadline leaves room for the slow tail's excess."""
    work = FirstTokenWork()
    work.observe(1.7, alone=True)
    for i in range(WINDOW):
        work.observe(4.0 + 2.0 * i / WINDOW, alone=False)
    assert work.excess_s() == pytest.approx(4.0 + 2.0 * int(0.9 * WINDOW) / WINDOW - 1.7)


def test_a_node_that_never_ran_alone_measures_against_its_fastest_request() -> None:
    work = FirstTokenWork()
    for s in (3.0, 2.0, 5.0):
        work.observe(s, alone=False)
    assert work.excess_s() == pytest.approx(5.0 - 2.0)


def test_work_as_fast_as_alone_takes_nothing_off_the_budget() -> None:
    work = FirstTokenWork()
    work.observe(2.0, alone=True)
    work.observe(1.5, alone=False)
    assert work.excess_s() == 0.0
