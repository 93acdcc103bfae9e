"""OpenAI-compatible chat request/response shapes, plus Tessera's extension fields.

Extensions (sent by the official client through ``extra_body``):

* ``retrieval: {query, top_k, scope}`` — the Retrieval Pool retrieves the units;
* ``context_units: [{text, scope?} | "text", ...]`` — the caller brings recalled records;
* ``unit_placement: "system" | "user"`` — after the system prompt, or inside the newest user
  message as a ``<relevant-memories>`` block;
* ``scope`` — default sharing scope of ``context_units``.

Parsing is strict where a mistake would silently change the answer (unknown roles, wrong
types, both retrieval and context units) and lenient where OpenAI clients send fields we
do not use (``user``, ``logprobs: false`` ...).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from tessera.errors import BadRequest

ROLES = ("system", "user", "assistant")
SCOPE_RE = re.compile(r"^[A-Za-z0-9_.:\-/]{1,128}$")
MAX_UNITS = 64


@dataclass(frozen=True)
class UnitInput:
    text: str
    scope: str


@dataclass(frozen=True)
class RetrievalSpec:
    query: str
    top_k: int
    scope: str
    embedding: tuple[float, ...] | None = None  # precomputed query embedding (then query is informative)


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    placement: str
    retrieval: RetrievalSpec | None = None
    units: tuple[UnitInput, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = -1  # -1: none (OpenAI logprobs=false)


def _get(body: dict[str, Any], key: str, types: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"{key}: expected {getattr(types, '__name__', types)}, got {value!r}")
    if not isinstance(value, types):
        raise BadRequest(f"{key}: expected {getattr(types, '__name__', types)}, got {type(value).__name__}")
    return value


def _scope(value: Any, where: str) -> str:
    if not isinstance(value, str) or not SCOPE_RE.match(value):
        raise BadRequest(f"{where}: scope must be 1-128 characters of letters, digits and _.:-/, got {value!r}")
    return value


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    # the OpenAI content-parts form: [{"type": "text", "text": "..."}]
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise BadRequest(f"{where}.content: expected a string or a list of text parts")


def parse_chat_request(body: Any, *, default_top_k: int, default_placement: str, served_model: str) -> ChatRequest:
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    messages_raw = body.get("messages")
    if not isinstance(messages_raw, list) or not messages_raw:
        raise BadRequest("messages: expected a non-empty array of {role, content}")
    messages: list[dict[str, str]] = []
    for i, m in enumerate(messages_raw):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}]: expected an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role: expected one of {', '.join(ROLES)}, got {role!r}")
        messages.append({"role": role, "content": _content(m.get("content"), f"messages[{i}]")})
    max_tokens = _get(body, "max_completion_tokens", int, None) or _get(body, "max_tokens", int, 16)
    if max_tokens < 1:
        raise BadRequest(f"max_tokens: expected an integer >= 1, got {max_tokens}")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest(f"temperature: expected 0..2, got {temperature}")
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p: expected a number in (0, 1], got {top_p}")
    if _get(body, "n", int, 1) != 1:
        raise BadRequest("n: only n = 1 is supported")
    stop_raw = body.get("stop")
    stop: tuple[str, ...] = ()
    if isinstance(stop_raw, str):
        stop = (stop_raw,)
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(stop_raw)
    elif stop_raw is not None:
        raise BadRequest("stop: expected a string or an array of strings")
    stream = bool(_get(body, "stream", bool, False))
    stream_options = _get(body, "stream_options", dict, {})
    placement = _get(body, "unit_placement", str, default_placement)
    if placement not in ("system", "user"):
        raise BadRequest(f'unit_placement: expected "system" or "user", got {placement!r}')
    default_scope = _scope(_get(body, "scope", str, "default"), "scope")

    retrieval = None
    if body.get("retrieval") is not None:
        r = body["retrieval"]
        if not isinstance(r, dict):
            raise BadRequest("retrieval: expected an object {query, top_k, scope}")
        query = r.get("query")
        if not isinstance(query, str) or not query.strip():
            raise BadRequest("retrieval.query: expected a non-empty string")
        top_k = r.get("top_k", default_top_k)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= MAX_UNITS:
            raise BadRequest(f"retrieval.top_k: expected an integer 1..{MAX_UNITS}, got {top_k!r}")
        embedding = r.get("embedding")
        if embedding is not None and (not isinstance(embedding, list) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in embedding)):
            raise BadRequest("retrieval.embedding: expected an array of numbers")
        retrieval = RetrievalSpec(query, top_k, _scope(r.get("scope", default_scope), "retrieval.scope"),
                                  None if embedding is None else tuple(float(x) for x in embedding))

    units: list[UnitInput] = []
    raw_units = body.get("context_units")
    if raw_units is not None:
        if retrieval is not None:
            raise BadRequest("send either retrieval or context_units, not both")
        if not isinstance(raw_units, list):
            raise BadRequest("context_units: expected an array of strings or {text, scope} objects")
        if len(raw_units) > MAX_UNITS:
            raise BadRequest(f"context_units: at most {MAX_UNITS} units per request, got {len(raw_units)}")
        for i, u in enumerate(raw_units):
            text: Any
            if isinstance(u, str):
                text, scope = u, default_scope
            elif isinstance(u, dict):
                text = u.get("text")
                scope = _scope(u.get("scope", default_scope), f"context_units[{i}].scope")
            else:
                raise BadRequest(f"context_units[{i}]: expected a string or an object {{text, scope}}")
            if not isinstance(text, str) or not text.strip():
                raise BadRequest(f"context_units[{i}].text: expected a non-empty string")
            units.append(UnitInput(text, scope))
    top_logprobs = -1
    if _get(body, "logprobs", bool, False):
        top_logprobs = _get(body, "top_logprobs", int, 0)
        if not 0 <= top_logprobs <= 20:
            raise BadRequest(f"top_logprobs: expected an integer 0..20, got {top_logprobs}")
    elif body.get("top_logprobs") is not None:
        raise BadRequest("top_logprobs needs logprobs: true")
    return ChatRequest(
        model=str(body.get("model") or served_model),
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=_get(body, "seed", int, None),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage", False)),
        stop=stop,
        placement=placement,
        retrieval=retrieval,
        units=tuple(units),
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),
        top_logprobs=top_logprobs,
    )


def completion_body(request_id: str, model: str, text: str, finish_reason: str, usage: dict[str, Any],
                    logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                              "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def chunk_body(
    request_id: str, model: str, delta: dict[str, Any], finish_reason: str | None, usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "code": status}}
