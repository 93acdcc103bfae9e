"""The access log of the public API: one line per request, like uvicorn's and vLLM's.

``POST /v1/chat/completions 200 1.204s ttft 0.412s prompt 812 tok: prefix 34 local 600 remote 0
computed 150 recomputed 28; completion 6 tok; node queued 0.012s, first token 0.350s on gen0`` --
status and duration for every request; for a chat request that reached a generation node
also the server-side TTFT, where its prompt tokens' states came from, and on the node (named
last) how long it queued before its first engine step and took to its first token (the rest of the
TTFT is the retrieval side: parsing, tokenizing, retrieval, routing, the snapshot). The
level is ``retrieval.access_log`` (``off`` for none); the health checks are logged at
DEBUG (the launcher and load balancers poll them).

The chat path reports its outcome through :func:`note_outcome`; a context variable carries
the request's record there, so this module needs no reference to the request. It knows
nothing about how a request is served.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from tessera.messages.generation import RequestStats

log = logging.getLogger("tessera.access")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


@dataclass
class AccessRecord:
    started: float = field(default_factory=time.perf_counter)
    stats: RequestStats | None = None
    first_token_at: float | None = None  # perf_counter, like ``started``
    node: str = ""  # the generation node that served it


# the record of the request being handled; a task the handler spawns shares the same object
_CURRENT: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar("tessera_access", default=None)


def note_outcome(stats: RequestStats, first_token_at: float | None, node: str = "") -> None:
    """The chat path's figures for the access line of the request in progress (if any)."""
    record = _CURRENT.get()
    if record is not None:
        record.stats, record.first_token_at, record.node = stats, first_token_at, node


def access_line(method: str, path: str, status: int, record: AccessRecord, now: float) -> str:
    line = f"{method} {path} {status} {now - record.started:.3f}s"
    if record.first_token_at is not None:
        line += f" ttft {record.first_token_at - record.started:.3f}s"
    s = record.stats
    if s is not None:
        tiers = " ".join(f"{source} {n}" for source, n in s.tokens_by_source())
        line += f" prompt {s.prompt_tokens} tok: {tiers}; completion {s.completion_tokens} tok"
        peer = sum(source == "peer" for source in s.unit_sources.values())
        if peer:
            line += f"; {peer} units prefilled by an idle peer"
        if s.node_first_token_s:
            line += f"; node queued {s.node_queued_s:.3f}s, first token {s.node_first_token_s:.3f}s"
            if record.node:
                line += f" on {record.node}"
    return line


def access_middleware(level: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Log one line per request at ``level`` (``retrieval.access_log``; ``off``: nothing)."""
    value = LEVELS.get(level)

    @web.middleware
    async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
        if value is None:
            return await handler(request)
        record = AccessRecord()
        token = _CURRENT.set(record)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except Exception as exc:
            status = int(getattr(exc, "status", 500))  # a BadRequest becomes its 4xx further out
            raise
        finally:
            _CURRENT.reset(token)
            at = logging.DEBUG if request.path.startswith("/health") else value
            if log.isEnabledFor(at):
                log.log(at, "%s", access_line(request.method, request.path, status, record, time.perf_counter()))

    return access
