"""The streaming reply of a chat call: OpenAI-style server-sent events.

Headers go out with the first token, so an error before it is still a clean 4xx/5xx with a
JSON body; an error after it ends the stream with an error event.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from tessera.errors import BadRequest, Overloaded, TesseraError
from tessera.messages import PromptLayout
from tessera.retrieval.chat_call import ChatCall, Outcome, events, usage
from tessera.retrieval.chat_request import chunk_body, error_body

if TYPE_CHECKING:
    from tessera.retrieval.chat import Serving


async def stream_reply(request: web.Request, serving: Serving, call: ChatCall, layout: PromptLayout,
                  trace: dict[str, Any] | None) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    model = call.chat.model

    async def send(obj: dict[str, Any]) -> None:
        await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")

    outcome = Outcome()
    status = "200"
    try:
        first = True
        async for delta, latest in events(serving, call, layout):
            outcome = latest
            if first:
                # headers go out with the first token, so errors before it are still a clean 4xx/5xx
                await resp.prepare(request)
                await send(chunk_body(call.request_id, model, {"role": "assistant", "content": ""}, None))
                first = False
            chunk = chunk_body(call.request_id, model, {"content": delta}, None)
            if call.chat.top_logprobs >= 0 and outcome.logprobs:
                chunk["choices"][0]["logprobs"] = {"content": [outcome.logprobs[-1]]}
            await send(chunk)
        if first:
            await resp.prepare(request)
        final = chunk_body(call.request_id, model, {}, outcome.finish_reason)
        if trace is not None:
            final["tessera_layout"] = trace
        await send(final)
        if call.chat.include_usage:
            usage_chunk = chunk_body(call.request_id, model, {}, None, usage(layout, outcome.stats, call.target))
            usage_chunk["choices"] = []
            await send(usage_chunk)
        await resp.write(b"data: [DONE]\n\n")
    except (BadRequest, Overloaded, TesseraError) as exc:
        if not resp.prepared:
            raise
        status = "stream-error"
        with contextlib.suppress(ConnectionError, RuntimeError):
            await send(error_body(str(exc), 503))
    finally:
        serving.m_requests.labels(status=status).inc()
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write_eof()
    return resp


