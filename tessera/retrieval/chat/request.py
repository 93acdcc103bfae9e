"""The OpenAI-compatible chat request: one pydantic schema, one validator, one error shape.

:class:`ChatCompletionRequest` is the body of ``POST /v1/chat/completions`` as a pydantic
model (as in vLLM and SGLang), so the API can serve its schema (``GET /openapi.json``) and
every validation error becomes one OpenAI-shaped 400 naming each field to fix.
:func:`parse_chat_request` validates a body and resolves the config's defaults into a
:class:`ChatRequest`, which carries the :class:`~tessera.messages.generation.SamplingParams` sent to
the generation node; no other code checks sampling bounds.

Extensions (sent by the official client through ``extra_body``):

* ``retrieval: {query, top_k, scope}`` — the Retrieval Pool retrieves the units;
* ``context_units: [{text, scope?} | "text", ...]`` — the caller brings recalled records;
* ``unit_placement: "system" | "user"`` — after the system prompt, or inside the newest user
  message as a ``<relevant-memories>`` block;
* ``scope`` — default sharing scope of ``context_units``;
* ``return_layout`` — the response carries the prompt layout (``tessera_layout``).

Validation is strict where a mistake would silently change the answer (unknown roles, wrong
types, ``true`` for a number, both retrieval and context units) and ignores fields OpenAI
clients send that we do not use (``user``, ``frequency_penalty`` ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tessera.errors import BadRequest
from tessera.messages.generation import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, MIN_TOP_P, SamplingParams

Role = Literal["system", "user", "assistant"]
Placement = Literal["system", "user"]
SCOPE_RE = re.compile(r"^[A-Za-z0-9_.:\-/]{1,128}$")
MAX_UNITS = 64
DEFAULT_MAX_TOKENS = 16


def _scope(value: str | None) -> str | None:
    if value is not None and not SCOPE_RE.match(value):
        raise ValueError(f"scope must be 1-128 characters of letters, digits and _.:-/, got {value!r}")
    return value


class _Strict(BaseModel):
    # strict: `true` is not a number, "3" is not an integer; unknown fields are ignored
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str = ""


class ChatMessage(_Strict):
    role: Role
    # the OpenAI content-parts form [{"type": "text", "text": ...}] is joined into one string
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class RetrievalOptions(_Strict):
    query: str = Field(min_length=1)
    top_k: int | None = Field(None, ge=1, le=MAX_UNITS)
    scope: str | None = None
    embedding: list[float] | None = None  # a precomputed query embedding (then query is informative)

    _check_scope = field_validator("scope")(_scope)

    @field_validator("query")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("expected a non-empty string")
        return value


class ContextUnitInput(_Strict):
    text: str
    scope: str | None = None

    _check_scope = field_validator("scope")(_scope)

    @field_validator("text")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("expected a non-empty string")
        return value


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    """The body of ``POST /v1/chat/completions``: OpenAI's fields that we serve, plus Tessera's."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    n: int = 1
    stop: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    ignore_eos: bool = False
    # Tessera's extensions
    retrieval: RetrievalOptions | None = None
    context_units: list[ContextUnitInput] | None = Field(None, max_length=MAX_UNITS)
    unit_placement: Placement | None = None
    scope: str | None = None
    return_layout: bool = False

    _check_scope = field_validator("scope")(_scope)

    @field_validator("top_p")
    @classmethod
    def _top_p_representable(cls, value: float) -> float:
        # temperature needs no such bound: below GREEDY_BELOW (1e-5) sampling is greedy, nothing is divided by it
        if value < MIN_TOP_P:
            raise ValueError(f"top_p = {value:g} is below {MIN_TOP_P:.3g}, which 32-bit sampling cannot tell from 0; "
                             f"send a top_p of at least {MIN_TOP_P:.3g} (any top_p below the most likely token's "
                             "probability keeps only that token)")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("context_units", mode="before")
    @classmethod
    def _bare_texts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        for i, u in enumerate(value):
            if not isinstance(u, (str, dict)):
                raise ValueError(f"context_units[{i}]: expected a string or an object {{text, scope}}")
        return [{"text": u} if isinstance(u, str) else u for u in value]

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.n != 1:
            raise ValueError("n: only n = 1 is supported")
        if self.retrieval is not None and self.context_units is not None:
            raise ValueError("send either retrieval or context_units, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def sampling(self) -> SamplingParams:
        """The generation node's sampling parameters (bounds already checked by this model)."""
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            top_logprobs=(self.top_logprobs or 0) if self.logprobs else -1,
        )


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
    """A validated chat request with the cluster's defaults resolved."""

    model: str
    messages: list[dict[str, str]]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    placement: str
    retrieval: RetrievalSpec | None = None
    units: tuple[UnitInput, ...] = ()
    return_layout: bool = False

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def top_logprobs(self) -> int:
        """-1: no logprobs (OpenAI ``logprobs: false``)."""
        return self.sampling.top_logprobs


def _where(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_message(exc: ValidationError) -> str:
    """Every error of one validation, each naming its field, in one message."""
    parts = []
    for err in exc.errors(include_url=False):
        msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
        where = _where(err["loc"])
        parts.append(f"{where}: {msg}" if where and not msg.startswith(where) else msg)
    return "; ".join(parts)


def parse_chat_request(body: Any, *, default_top_k: int, default_placement: str, served_model: str) -> ChatRequest:
    """Validate a decoded JSON body (BadRequest naming every field to fix) and resolve the defaults."""
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(validation_message(exc)) from None
    if req.model and req.model != served_model:  # OpenAI's and vLLM's answer to a model not served
        raise BadRequest(f"model {req.model!r} does not exist: this server serves {served_model!r} "
                         "(GET /v1/models; model.served_name)", 404)
    scope = req.scope or "default"
    retrieval = None
    if req.retrieval is not None:
        r = req.retrieval
        retrieval = RetrievalSpec(r.query, r.top_k or default_top_k, r.scope or scope,
                                  None if r.embedding is None else tuple(r.embedding))
    return ChatRequest(
        model=req.model or served_model,
        messages=[{"role": m.role, "content": m.text} for m in req.messages],
        sampling=req.sampling(),
        stream=req.stream,
        include_usage=req.stream_options is not None and req.stream_options.include_usage,
        stop=tuple(req.stop or ()),
        placement=req.unit_placement or default_placement,
        retrieval=retrieval,
        units=tuple(UnitInput(u.text, u.scope or scope) for u in req.context_units or ()),
        return_layout=req.return_layout,
    )
