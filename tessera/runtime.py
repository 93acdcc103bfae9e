"""Process lifecycle shared by every role: event loop, signals, drain, background tasks.

A role is one asyncio process. It starts an aiohttp application (resources live in the
app's ``cleanup_ctx`` so start and stop are symmetric), serves until SIGINT/SIGTERM, then
stops accepting, drains in-flight handlers for up to ``drain_s`` and runs the cleanups.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from aiohttp import web

from tessera.config import ListenerConfig
from tessera.errors import TesseraError
from tessera.listener import ListenerSite
from tessera.ports import bind_listener

log = logging.getLogger("tessera")


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # aiohttp logs every request at INFO; that is noise under load
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def run(main: Callable[[], Coroutine[Any, Any, int | None]]) -> int:
    """Run ``main()`` on uvloop when it is installed, plain asyncio otherwise."""
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main()) or 0


async def serve(app: web.Application, host: str, port: int, *, name: str, limits: ListenerConfig,
                drain_s: float = 10.0, ssl_context: ssl.SSLContext | None = None,
                also: Sequence[tuple[web.Application, str, int]] = ()) -> int:
    """Serve ``app`` (and the ``also`` apps, e.g. an internal plane) until SIGINT/SIGTERM.

    Every listener obeys ``limits`` (:class:`~tessera.listener.ListenerSite`).
    Then drain and clean up, ``app`` first: its in-flight work may still need the others.
    Returns the exit code: 3 when a start-up (an app's ``cleanup_ctx``, e.g. loading the model)
    or a listener fails.
    """
    sites = [(app, host, port), *also]
    try:
        # bind before the start-ups (loading a model takes minutes): a port another process
        # holds fails the role at once, naming the port and its holder
        sockets = [bind_listener(h, p, name) for _, h, p in sites]
    except (OSError, TesseraError) as exc:
        log.error("%s cannot start: %s", name, exc)
        return 3
    runners = [web.AppRunner(a, handle_signals=False, shutdown_timeout=drain_s, access_log=None) for a, _, _ in sites]
    scheme = "https" if ssl_context is not None else "http"
    started: list[web.AppRunner] = []
    try:
        for runner, sock, (_, h, p) in zip(runners, sockets, sites, strict=True):
            started.append(runner)
            await runner.setup()  # runs the cleanup_ctx start-ups
            await ListenerSite(runner, h, p, limits, sock=sock, ssl_context=ssl_context).start()
    except (OSError, TesseraError) as exc:
        for runner in reversed(started):
            await runner.cleanup()  # stops what did start, in reverse order
        for sock in sockets:
            sock.close()
        log.error("%s cannot start on %s: %s%s", name, ", ".join(f"{h}:{p}" for _, h, p in sites), exc,
                  " (is another process using the port?)" if isinstance(exc, OSError) else "")
        return 3
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"tessera {name} ready on {scheme}://{host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("%s stopping: draining in-flight work (up to %.0fs)", name, drain_s)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for runner in runners:
            await runner.cleanup()
        log.info("%s stopped", name)
    return 0


class BackgroundTasks:
    """Hard references to fire-and-forget tasks, logged failures, bounded shutdown."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Awaitable[Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        if name:
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: background task %s failed", self.name, task.get_name(), exc_info=task.exception())

    async def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` for running tasks, then cancel what is left."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
