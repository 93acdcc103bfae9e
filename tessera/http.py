"""HTTP helpers shared by the three roles: JSON replies, typed bodies, one error middleware.

Every role's aiohttp application uses :func:`application`, so errors have one shape on every
port: ``{"error": message}`` with a 4xx that says what to fix (``BadRequest``, a body that
does not decode), 409 for a refused publish, the ``Overloaded`` status for refused work, and
a logged 500 without a traceback in the body for anything else. The OpenAI-compatible chat
API keeps its own error shape (see :mod:`tessera.retrieval.chat.response`).

This module knows nothing about any role's state.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp import web

from tessera.errors import BadRequest, NotLeader, Overloaded, PublishRejected, Unavailable
from tessera.messages.common import Ack, check_version
from tessera.wire import WIRE_VERSION, encode, from_wire, loads

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BODY = 64 << 20  # bytes of one request body on every role
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def reply(obj: Any, status: int = 200) -> web.Response:
    """A typed message (or plain JSON value) as an ``application/json`` response."""
    return web.Response(body=encode(obj), status=status, content_type="application/json")


def error(status: int, message: str, *, not_leader: bool = False) -> web.Response:
    payload: dict[str, Any] = {"error": message}
    if not_leader:
        payload["not_leader"] = True
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Client mistakes become 4xx with a message; nothing escapes as a bare traceback."""
    try:
        return await handler(request)
    except BadRequest as exc:  # wire.DecodeError is a BadRequest too
        return error(exc.status, str(exc))
    except PublishRejected as exc:
        return reply(Ack(WIRE_VERSION, False, str(exc)), status=409)
    except (Overloaded, Unavailable) as exc:
        # a peer replica tells "this one does not lead" from "nothing can serve"
        refused = error(exc.status, str(exc), not_leader=isinstance(exc, NotLeader))
        if exc.retry_after_s is not None:
            refused.headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        return refused
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        refused = error(exc.status, exc.reason or exc.text or "error")
        if "Allow" in exc.headers:  # a 405 names the methods the path serves (RFC 9110)
            refused.headers["Allow"] = exc.headers["Allow"]
        return refused
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error(500, "internal error; the server's log has the details")  # no exception text


async def body(request: web.Request, cls: type[T], check: Callable[[Any], None] | None = None, *,
               closed: bool = False) -> T:
    """Decode a typed, versioned message body (400 naming the field when it does not fit).

    ``check`` sees the raw JSON first (bounds that must hold before the typed decode builds
    anything large, e.g. a query vector's length). ``closed``: unknown fields are refused
    (a client's body), not ignored (a peer role's, which may be newer).
    """
    value = loads(await request.read())
    if check is not None:
        check(value)
    msg = from_wire(cls, value, closed=closed)
    check_version(msg.version)  # type: ignore[attr-defined]
    return msg


def application(middlewares: Iterable[Any] = ()) -> web.Application:
    """An aiohttp application with the shared error middleware and body limit."""
    return web.Application(middlewares=[errors, *middlewares], client_max_size=MAX_BODY)


class LazySession:
    """One aiohttp client session, created on first use inside the running loop.

    ``connection_limit`` bounds open connections per session (0: unbounded; aiohttp's
    default is 100); each new session gets its own connector.
    """

    def __init__(self, timeout: aiohttp.ClientTimeout, *, connection_limit: int = 100) -> None:
        self.timeout = timeout
        self.connection_limit = connection_limit
        self._session: aiohttp.ClientSession | None = None

    def get(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout,
                                                  connector=aiohttp.TCPConnector(limit=self.connection_limit))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
