"""The streaming reply of a chat call: OpenAI-style server-sent events.

Headers go out with the first token, so an error before it is still a clean 4xx/5xx with a
JSON body; an error after it ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel

from tessera.errors import BadRequest, Overloaded, TesseraError
from tessera.messages import PromptLayout
from tessera.retrieval.chat_call import ChatCall, ClientGone, Outcome, events, usage
from tessera.retrieval.chat_response import Delta, chunk_body, error_body, to_json

if TYPE_CHECKING:
    from tessera.retrieval.chat import Serving


async def stream_reply(request: web.Request, serving: Serving, call: ChatCall, layout: PromptLayout,
                  trace: dict[str, Any] | None) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    model = call.chat.model

    async def send(body: BaseModel) -> None:
        await resp.write(b"data: " + to_json(body) + b"\n\n")

    outcome = Outcome()
    status = "200"
    try:
        first = True
        async for delta, latest in events(serving, call, layout):
            outcome = latest
            if first:
                # headers go out with the first token, so errors before it are still a clean 4xx/5xx
                await resp.prepare(request)
                await send(chunk_body(call.request_id, model, Delta(role="assistant", content=""), None))
                first = False
            logprobs = outcome.logprobs[-1:] if call.chat.top_logprobs >= 0 and outcome.logprobs else None
            await send(chunk_body(call.request_id, model, Delta(content=delta), None, logprobs=logprobs))
        if first:
            await resp.prepare(request)
        await send(chunk_body(call.request_id, model, Delta(), outcome.finish_reason, layout=trace))
        if call.chat.include_usage:
            await send(chunk_body(call.request_id, model, None, None, usage(layout, outcome.stats, call.target)))
        await resp.write(b"data: [DONE]\n\n")
    except (ConnectionError, asyncio.CancelledError) as exc:
        status = ""  # the client went away mid-stream: counted as cancelled by the caller, not as 200
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise ClientGone from None
    except (BadRequest, Overloaded, TesseraError) as exc:
        if not resp.prepared:
            raise
        status = "stream-error"
        with contextlib.suppress(ConnectionError, RuntimeError):
            await send(error_body(str(exc), 503))
    finally:
        if status:
            serving.m_requests.labels(status=status).inc()
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write_eof()
    return resp


