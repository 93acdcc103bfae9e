"""Stand-in sink processes for ``bench/transport.py``'s start-up checks (importable by a spawned child)."""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import Connection


def killed_before_listening(ready: Connection, block: int) -> None:
    """A sink that is killed (SIGKILL) before it opens a listening socket."""
    os.kill(os.getpid(), signal.SIGKILL)


def never_listening(ready: Connection, block: int) -> None:
    """A sink that stays alive and never listens."""
    signal.pause()
