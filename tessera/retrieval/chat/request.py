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
* ``unit_order: "fixed" | "free"`` — keep the units' order, or let the server deduplicate and
  reorder them so exact prefixes recur (:mod:`tessera.retrieval.order`; default: the scope's,
  ``retrieval.order_free_scopes``);
* ``scope`` — default sharing scope of ``context_units``;
* ``return_layout`` — the response carries the prompt layout (``tessera_layout``).

Validation is strict where a mistake would silently change the answer: unknown roles, wrong
types, ``true`` for a number, both retrieval and context units, and a field the body does not
have (a misspelt ``context_unit`` is refused naming ``context_units``, in the request and in
its ``retrieval``, ``context_units`` and ``stream_options`` objects). OpenAI's bookkeeping
fields that do not change the answer (``user``, ``metadata``, ``store`` ...) are accepted and
not used; OpenAI fields this server does not implement (``frequency_penalty``, ``tools`` ...)
are refused unless null or their neutral value. ``retrieval.allow_unknown_fields`` (for
clients that send vendor fields) turns both refusals off: such fields are then ignored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tessera.errors import BadRequest
from tessera.messages.generation import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, MIN_TOP_P, SamplingParams
from tessera.wire import unknown_keys

Role = Literal["system", "user", "assistant"]
Placement = Literal["system", "user"]
UnitOrder = Literal["fixed", "free"]
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


class _Closed(_Strict):
    """An object the client writes: a key it does not have is refused, naming the nearest known one.

    The validation context's ``closed`` (default true) turns the refusal on; ``_unsupported``
    lists keys that are not fields but known, each accepted only with a value in its tuple or null.
    """

    # unknown keys are ignored by the model, refused by _known_fields: the schema says so
    model_config = ConfigDict(json_schema_extra={"additionalProperties": False})
    _unsupported: ClassVar[Mapping[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, dict) or not (info.context or {}).get("closed", True):
            return value
        problem = unknown_keys(value, cls.model_fields.keys() | cls._unsupported.keys())
        if problem is not None:
            raise ValueError(problem)
        for key, neutral in cls._unsupported.items():
            if value.get(key) is not None and value[key] not in neutral:
                shown = " or ".join(["null", *(repr(v) for v in neutral)])
                raise ValueError(f"{key}: this server does not implement it; leave it out (or send {shown})")
        return value


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


class RetrievalOptions(_Closed):
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


class ContextUnitInput(_Closed):
    text: str
    scope: str | None = None

    _check_scope = field_validator("scope")(_scope)

    @field_validator("text")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("expected a non-empty string")
        return value


class StreamOptions(_Closed):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, not used: this server sends no obfuscation field


class ChatCompletionRequest(_Closed):
    """The body of ``POST /v1/chat/completions``: OpenAI's fields that we serve, plus Tessera's."""

    # OpenAI fields this server does not implement, each with the values that change nothing
    _unsupported: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "tools": ([],),
        "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
        "response_format": ({"type": "text"},), "modalities": (["text"],), "audio": (), "prediction": (),
        "reasoning_effort": (), "verbosity": (), "web_search_options": (), "moderation": ()}

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
    # OpenAI's bookkeeping: accepted and not used (none of them changes what is generated)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Tessera's extensions
    retrieval: RetrievalOptions | None = None
    context_units: list[ContextUnitInput] | None = Field(None, max_length=MAX_UNITS)
    unit_placement: Placement | None = None
    unit_order: UnitOrder | None = None
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

    @field_validator("stop", mode="before", json_schema_input_type=str | list[str] | None)  # OpenAI's: one or a list
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    # a bare string is a unit's text: the schema says so (items: a string or an object)
    @field_validator("context_units", mode="before",
                     json_schema_input_type=Annotated[list[str | ContextUnitInput], Field(max_length=MAX_UNITS)] | None)
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
    unit_order: str = ""  # "fixed" | "free" as the request said; "": its scopes' default

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def top_logprobs(self) -> int:
        """-1: no logprobs (OpenAI ``logprobs: false``)."""
        return self.sampling.top_logprobs

    def order_free(self, scope_free: Callable[[str], bool]) -> bool:
        """Whether its units may be reordered: as the request says, else when every scope its
        units come from is order-free (``scope_free``: the config's default per scope)."""
        if self.unit_order:
            return self.unit_order == "free"
        scopes = {self.retrieval.scope} if self.retrieval is not None else {u.scope for u in self.units}
        return bool(scopes) and all(scope_free(s) for s in scopes)


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


def parse_chat_request(body: Any, *, default_top_k: int, default_placement: str, served_model: str,
                       allow_unknown: bool = False) -> ChatRequest:
    """Validate a decoded JSON body (BadRequest naming every field to fix) and resolve the defaults.

    ``allow_unknown`` (``retrieval.allow_unknown_fields``): unknown and unimplemented fields are
    ignored instead of refused.
    """
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    try:
        req = ChatCompletionRequest.model_validate(body, context={"closed": not allow_unknown})
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
        unit_order=req.unit_order or "",
    )
