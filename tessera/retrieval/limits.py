"""Bounds on what one request may make the retrieval role do, checked before the work starts.

A chat body is bounded in bytes before it is parsed; its rendered prompt is bounded in
characters before it is tokenized (a token covers at most ``MAX_CHARS_PER_TOKEN``
characters of text, so a prompt longer than that many characters per context token cannot
fit and is refused without tokenizing it). An ingested unit's text is bounded the same way
by ``retrieval.max_unit_tokens``, so an oversized unit never occupies the tokenizer worker
every chat needs. A ``/v1/retrieve`` body is bounded in bytes, and a query or unit embedding
in dimensions before it is decoded, so a huge vector cannot hold the event loop. Unit
metadata is bounded in nesting depth and encoded size at ingest: orjson refuses to encode
deeper than 254 levels, so deeper metadata would break every later retrieve that hit it.

This module knows nothing about HTTP or the event loop; it raises :class:`BadRequest`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from tessera.errors import BadRequest

MAX_CHAT_BODY_BYTES = 16 << 20  # one chat request; more is refused with 413 before it is read
MAX_RETRIEVE_BODY_BYTES = 1 << 20  # one /v1/retrieve request: a query or one vector (384 floats: ~8 KB)
MAX_CHARS_PER_TOKEN = 32  # no token of a real vocabulary covers more characters than this
MAX_METADATA_DEPTH = 16  # nesting levels of one unit's metadata
MAX_METADATA_BYTES = 64 << 10  # one unit's metadata, encoded as JSON
INGEST_CHUNK_UNITS = 64  # units per worker job of one ingest call: chat requests interleave


def check_body_size(content_length: int | None, limit: int = MAX_CHAT_BODY_BYTES,
                    fix: str = "send fewer or shorter messages and units") -> None:
    if content_length is not None and content_length > limit:
        raise BadRequest(f"the request body has {content_length} bytes; at most {limit} are accepted ({fix})", 413)


def check_prompt_chars(texts: Iterable[str], max_tokens: int) -> None:
    """Refuse a prompt that cannot fit ``max_tokens`` context tokens, without tokenizing it."""
    chars = sum(len(t) for t in texts)
    limit = max_tokens * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise BadRequest(f"the prompt has {chars} characters (units included), more than the model's context of "
                         f"{max_tokens} tokens can hold ({limit} characters at most); send fewer or shorter "
                         "messages or units")


def check_unit_chars(field: str, text: str, max_tokens: int) -> None:
    """Refuse a unit text that cannot fit ``max_tokens`` tokens (413), without tokenizing it."""
    limit = max_tokens * MAX_CHARS_PER_TOKEN
    if len(text) > limit:
        raise BadRequest(f"{field}.text has {len(text)} characters, more than retrieval.max_unit_tokens = "
                         f"{max_tokens} tokens can hold ({limit} characters at most); split it into smaller units",
                         413)


def check_vector(field: str, value: Any, dim: int) -> None:
    """Refuse a (still undecoded) embedding whose length is not the embedder's dimension."""
    if isinstance(value, list) and len(value) != dim:
        raise BadRequest(f"{field} has {len(value)} dimensions; the embedder's have {dim}: send a {dim}-dimensional "
                         "vector from the same embedding model, or send text and let the service embed it")


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, stopping early past ``limit`` (no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, Mapping):
            children: Iterable[Any] = v.values()
        elif isinstance(v, list | tuple):
            children = v
        else:
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((c, d + 1) for c in children)
    return deepest


def check_metadata(field: str, metadata: Mapping[str, Any]) -> None:
    depth = _depth(metadata, MAX_METADATA_DEPTH)
    if depth > MAX_METADATA_DEPTH:
        raise BadRequest(f"{field}: metadata is nested more than {MAX_METADATA_DEPTH} levels deep; flatten it")
    try:
        size = len(orjson.dumps(metadata))
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise BadRequest(f"{field}: metadata cannot be stored as JSON: {exc}") from None
    if size > MAX_METADATA_BYTES:
        raise BadRequest(f"{field}: metadata takes {size} bytes as JSON; at most {MAX_METADATA_BYTES} are accepted")
