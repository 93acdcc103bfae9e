"""``bench/transport.py`` waits for its helper processes by their own word and fails in one line.

The full run is the smoke test in ``test_readme_smoke.py``; here are its start-up failures.
"""

from __future__ import annotations

import importlib
import socket
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
from helpers.cluster import REPO
from helpers.sinks import killed_before_listening, never_listening


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    """The script as module ``transport``: a spawned sink unpickles its target by that name."""
    sys.path.insert(0, str(REPO / "bench"))  # the child inherits the parent's sys.path
    try:
        yield importlib.import_module("transport")
    finally:
        sys.path.remove(str(REPO / "bench"))
        sys.modules.pop("transport", None)


def test_the_sink_says_its_port_only_once_it_listens(bench: ModuleType) -> None:
    """start_sink returns a port that accepts a connection at once, with no retry loop."""
    sink, port = bench.start_sink(4096)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"x" * 4096)
    finally:
        sink.join(30)
    assert sink.exitcode == 0


def test_a_sink_killed_before_it_listens_is_one_line_naming_it(bench: ModuleType) -> None:
    """Regression: a sink that never listened left ``sock`` unbound (UnboundLocalError)."""
    with pytest.raises(bench.NotStarted) as caught:
        bench.start_sink(4096, target=killed_before_listening)
    message = str(caught.value)
    assert message == "socket sink process exited with code -9 before it listened", message
    assert "\n" not in message


def test_a_sink_that_never_listens_stops_at_the_deadline(bench: ModuleType) -> None:
    """A live sink that never listens is killed at the deadline and named, not waited on forever."""
    with pytest.raises(bench.NotStarted, match=r"^socket sink process did not listen within 1 s$"):
        bench.start_sink(4096, deadline_s=1.0, target=never_listening)
