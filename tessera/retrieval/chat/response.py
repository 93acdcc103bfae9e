"""The OpenAI-compatible response bodies as pydantic models, and the chat endpoint's OpenAPI operation.

A completion, a streamed chunk and an error each have one model; handlers build them with
the functions below and send ``to_json(body)``. Fields that are absent (no logprobs asked,
no usage chunk, no layout asked) are left out of the JSON rather than sent as ``null``,
except the ones OpenAI always sends (a chunk's ``finish_reason``).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer

from tessera.retrieval import openapi
from tessera.retrieval.chat.request import ChatCompletionRequest
from tessera.retrieval.openapi import EventStream, Operation


class _Body(BaseModel):
    # fields sent as null when unset; every other None-valued field is omitted
    _nullable: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None or k in self._nullable}


class TokenLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int] | None = None
    token_id: int | None = None  # Tessera's addition: the token id itself


class ContentLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob] = []


class ChoiceLogprobs(_Body):
    content: list[ContentLogprob]


class AssistantMessage(_Body):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(_Body):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(_Body):
    cached_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    tessera: dict[str, Any] = {}  # where each prompt token's state came from, and the serving node


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    tessera_layout: dict[str, Any] | None = None  # with return_layout: the prompt's tokens and unit spans


class Delta(_Body):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(_Body):
    _nullable = frozenset({"finish_reason"})
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Body):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # only in the last chunk, with stream_options.include_usage
    tessera_layout: dict[str, Any] | None = None


class ErrorDetail(_Body):
    message: str
    type: str
    code: int


class ErrorResponse(_Body):
    error: ErrorDetail


def to_json(body: BaseModel) -> bytes:
    return body.model_dump_json().encode()


def _logprobs(entries: list[dict[str, Any]] | None) -> ChoiceLogprobs | None:
    return None if entries is None else ChoiceLogprobs.model_validate({"content": entries})


def completion_body(request_id: str, model: str, text: str, finish_reason: str, usage: Usage,
                    logprobs: list[dict[str, Any]] | None = None,
                    layout: dict[str, Any] | None = None) -> ChatCompletion:
    choice = Choice(message=AssistantMessage(content=text), finish_reason=finish_reason, logprobs=_logprobs(logprobs))
    return ChatCompletion(id=request_id, created=int(time.time()), model=model, choices=[choice], usage=usage,
                          tessera_layout=layout)


def chunk_body(request_id: str, model: str, delta: Delta | None, finish_reason: str | None,
               usage: Usage | None = None, logprobs: list[dict[str, Any]] | None = None,
               layout: dict[str, Any] | None = None) -> ChatCompletionChunk:
    """One streamed chunk; ``delta=None`` is the usage chunk, which has no choices."""
    choices = [] if delta is None else [ChunkChoice(delta=delta, finish_reason=finish_reason,
                                                    logprobs=_logprobs(logprobs))]
    return ChatCompletionChunk(id=request_id, created=int(time.time()), model=model, choices=choices, usage=usage,
                               tessera_layout=layout)


def error_body(message: str, status: int) -> ErrorResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return ErrorResponse(error=ErrorDetail(message=message, type=kind, code=status))


CHAT_OPERATION = Operation(
    "post", "/v1/chat/completions",
    "OpenAI-compatible chat completion, with Tessera's retrieval / context_units extensions",
    # with stream: true, chunks, then [DONE]; an error after the first chunk is an error event
    {"application/json": ChatCompletion, "text/event-stream": EventStream((ChatCompletionChunk, ErrorResponse))},
    {400: "a body that does not fit (the message names every field to fix)", 401: "missing or unknown API key",
     403: "the API key's tenant does not own the scope", 404: "retrieval from a scope nothing was ingested into",
     413: "a body, prompt or unit too large", 429: "a generation node refuses more work; retry later",
     503: "the cluster is starting, at capacity, or no generation node is alive"},
    body=ChatCompletionRequest, error_body=ErrorResponse)


def openapi_document(title: str) -> dict[str, Any]:
    """OpenAPI 3.1 description of the public API, the chat endpoint included (see tessera.retrieval.openapi)."""
    return openapi.document(title, [CHAT_OPERATION])
