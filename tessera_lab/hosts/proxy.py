"""A slow link: a TCP proxy that delays every byte and caps the bandwidth, in one host's namespace.

``tc netem`` is not available everywhere (not on our CI machine), so a slow link is an
application-level proxy instead: it listens on ``127.0.0.1`` inside the sending host's
namespace, where :meth:`~tessera_lab.hosts.netns.Network.redirect` sends that host's new
connections to one ``address:port``, and forwards each one to the real destination from a
socket marked :data:`~tessera_lab.hosts.netns.PROXY_MARK` (so its own connection is not
redirected again). Every chunk is held ``delay_s`` in each direction, in order; with
``rate_bytes_s`` a direction sends no faster than that.

The proxy runs an event loop of its own in a thread joined to the namespace; it knows
nothing about what flows through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

from tessera_lab.hosts.netns import PROXY_MARK, call_in, enter

CHUNK = 64 * 1024


def _marked_socket() -> socket.socket:
    out = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    out.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, PROXY_MARK)
    out.setblocking(False)
    return out


class SlowLink:
    """Start with :meth:`start` (returns the local port); :meth:`stop` closes every connection."""

    def __init__(self, namespace: str | None, target: tuple[str, int], delay_s: float = 0.0,
                 rate_bytes_s: float = 0.0, connect_namespace: str | None = None, listen_port: int = 0) -> None:
        # listen inside ``namespace`` (None: where the caller is); connect from inside
        # ``connect_namespace`` (None: the listening one)
        self.namespace = namespace
        self.connect_namespace = connect_namespace
        self.target = target
        self.delay_s = delay_s
        self.rate_bytes_s = rate_bytes_s
        self.listen_port = listen_port
        self.port = 0
        self.connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"slow-link-{namespace or 'here'}", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> int:
        self._thread.start()
        self._ready.wait(10.0)
        if self._error is not None:
            raise self._error
        assert self.port, "the slow link did not start"
        return self.port

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10.0)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(10.0)

    async def _shutdown(self) -> None:
        """Stop accepting, then cancel every connection and wait until each has closed its sockets."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _main(self) -> None:
        try:
            if self.namespace is not None:
                enter(self.namespace)
            self._loop = asyncio.new_event_loop()
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._accept, "127.0.0.1", self.listen_port))
            self.port = int(self._server.sockets[0].getsockname()[1])
        except BaseException as exc:  # the caller of start() raises it
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            out = _marked_socket() if self.connect_namespace is None else \
                await asyncio.to_thread(call_in, self.connect_namespace, _marked_socket)
            try:
                await asyncio.get_running_loop().sock_connect(out, self.target)
            except OSError:
                out.close()
                writer.close()
                return
            up_reader, up_writer = await asyncio.open_connection(sock=out)
            try:
                await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                                     return_exceptions=True)
            finally:
                up_writer.close()
                with contextlib.suppress(OSError, asyncio.CancelledError):
                    await up_writer.wait_closed()
        except asyncio.CancelledError:
            # only _shutdown cancels a connection: end it quietly. Re-raised, the stream
            # protocol's done-callback logs the cancellation as an error with a traceback
            # (seen on every Ctrl-C of `tessera hosts up` with a client's keep-alive open).
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward ``reader`` to ``writer``, each chunk ``delay_s`` late, in order, rate-capped."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def feed() -> None:
            while True:
                data = await reader.read(CHUNK)
                queue.put_nowait((loop.time() + self.delay_s, data))
                if not data:
                    return

        feeder = asyncio.create_task(feed())
        try:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
                if self.rate_bytes_s > 0:
                    await asyncio.sleep(len(data) / self.rate_bytes_s)
        except (ConnectionError, OSError):
            return
        finally:
            feeder.cancel()
