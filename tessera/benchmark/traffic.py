"""The traffic trace format: one chat request a line (JSONL), replayable against any server.

Each line is one JSON object (``"version": 1`` optional)::

    {"arrival_s": 0.42,                          # optional: seconds since the trace began
     "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "units": ["a recalled record",              # the context units, in prompt order:
               {"text": "a passage", "scope": "kb"},   # text (scope defaults to the line's)
               {"id": "doc-17", "tokens": 180}],       # or an id and a token length (private text)
     "placement": "system",                      # optional: system (default) or user
     "scope": "kb", "tenant": "acme",            # optional: sharing scope; tenant ("" = open)
     "max_tokens": 16,                           # optional: the reply's length (default: the command's)
     "stream": "conv-26"}                        # optional: what "earlier" means for analyze (default: tenant)

A unit given as ``{id, tokens}`` stands for private text of that length: every use of one id
becomes the same synthetic text (:func:`synthetic_text`, seeded by the id), of exactly
``tokens`` tokens under the served tokenizer (words that tokenize as one token each), so a
trace can keep who-reuses-what and how long without the text itself.

Lines are checked with the API's own validator (:func:`parse_chat_request`), so a trace line
the API would refuse is refused here with its line number. This module never talks to a server.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.benchmark.jsonl import records
from tessera.benchmark.workloads import BenchRequest, Workload
from tessera.errors import BadRequest
from tessera.retrieval.chat.request import parse_chat_request

TRAFFIC_VERSION = 1
# common English words that SmolLM2's (and most BPE) tokenizers encode as one token after a space
_WORDS = ("time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school",
          "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week",
          "company", "system", "program", "question", "work", "government", "number", "night", "point", "home",
          "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book",
          "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend",
          "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "name", "team",
          "minute", "idea", "body", "information", "back", "parent", "face", "level", "office", "door",
          "health", "person", "art", "war", "history", "party", "result", "change", "morning", "reason",
          "research", "girl", "guy", "moment", "air", "teacher", "force", "education")


@dataclass(frozen=True)
class TraceUnit:
    """One context unit of a trace line: its text, or (``id``, ``tokens``) for private text."""

    scope: str
    text: str | None = None
    id: str | None = None
    tokens: int = 0

    def as_json(self, line_scope: str) -> Any:
        if self.text is None:
            out: dict[str, Any] = {"id": self.id, "tokens": self.tokens}
        else:
            out = {"text": self.text}
            if self.scope == line_scope:
                return self.text
        if self.scope != line_scope:
            out["scope"] = self.scope
        return out


@dataclass(frozen=True)
class TraceRequest:
    """One line of a traffic trace."""

    messages: tuple[dict[str, str], ...]
    units: tuple[TraceUnit, ...] = ()
    placement: str = "system"
    scope: str = "default"
    tenant: str = ""
    max_tokens: int | None = None
    arrival_s: float | None = None
    stream: str | None = None

    @property
    def history(self) -> str:
        """Which earlier requests count as "before" this one in ``tessera analyze`` (caches are per tenant)."""
        return self.tenant if self.stream is None else self.stream

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": TRAFFIC_VERSION}
        if self.arrival_s is not None:
            out["arrival_s"] = round(self.arrival_s, 6)
        out["messages"] = list(self.messages)
        if self.units:
            out["units"] = [u.as_json(self.scope) for u in self.units]
        out["placement"] = self.placement
        out["scope"] = self.scope
        if self.tenant:
            out["tenant"] = self.tenant
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.stream is not None:
            out["stream"] = self.stream
        return out


def _unit(value: Any, scope: str, where: str) -> TraceUnit:
    if isinstance(value, str):
        return TraceUnit(scope, text=value)
    if not isinstance(value, dict):
        raise BadRequest(f"{where}: expected a string, {{text, scope?}} or {{id, tokens, scope?}}")
    unit_scope = value.get("scope", scope)
    if "text" in value:
        return TraceUnit(unit_scope, text=value["text"])
    uid, n = value.get("id"), value.get("tokens")
    if not isinstance(uid, str) or not uid or isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"{where}: a private unit needs a non-empty string id and tokens >= 1, got {value!r}")
    return TraceUnit(unit_scope, id=uid, tokens=n)


def parse_line(rec: Any, where: str) -> TraceRequest:
    """One decoded trace line, checked (BadRequest naming ``where`` and the field)."""
    if not isinstance(rec, dict) or "messages" not in rec:
        raise BadRequest(f"{where}: expected an object with messages "
                         "(the traffic trace format, see docs/bench/traces.md)")
    if rec.get("version", TRAFFIC_VERSION) != TRAFFIC_VERSION:
        raise BadRequest(f"{where}: trace version {rec['version']!r}; this Tessera reads version {TRAFFIC_VERSION}")
    scope = rec.get("scope", "default")
    units = tuple(_unit(u, scope, f"{where}: units[{i}]") for i, u in enumerate(rec.get("units") or ()))
    arrival, tenant, stream = rec.get("arrival_s"), rec.get("tenant", ""), rec.get("stream")
    if arrival is not None and (isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or arrival < 0):
        raise BadRequest(f"{where}: arrival_s must be a number of seconds >= 0, got {arrival!r}")
    if not isinstance(tenant, str) or (stream is not None and not isinstance(stream, str)):
        raise BadRequest(f"{where}: tenant and stream must be strings")
    # the API's own validator: what it would refuse, the trace refuses (private units stand in as text)
    body = {"messages": rec["messages"], "scope": scope, "unit_placement": rec.get("placement", "system"),
            "context_units": [{"text": u.text or "x", "scope": u.scope} for u in units] or None}
    if rec.get("max_tokens") is not None:
        body["max_tokens"] = rec["max_tokens"]
    try:
        chat = parse_chat_request(body, default_top_k=1, default_placement="system", served_model="trace")
    except BadRequest as exc:
        raise BadRequest(f"{where}: {exc}") from None
    return TraceRequest(tuple(chat.messages), units, chat.placement, scope, tenant,
                        rec.get("max_tokens"), None if arrival is None else float(arrival), stream)


def is_traffic_line(rec: Any) -> bool:
    """Whether a decoded JSONL line is in this format (``tessera analyze`` also reads rendered traces)."""
    return isinstance(rec, dict) and "messages" in rec


# keys of a trace line that a chat request (the API's format, which also has messages) does not have
TRACE_ONLY_KEYS = frozenset({"units", "placement", "arrival_s", "tenant"})


def is_trace_not_request(rec: Any) -> bool:
    """Whether a line with messages is a trace line rather than a chat request in the API's format."""
    return is_traffic_line(rec) and (bool(TRACE_ONLY_KEYS & rec.keys()) or isinstance(rec.get("stream"), str))


def read_traffic(path: Path) -> list[TraceRequest]:
    out = [parse_line(rec, where) for where, rec in records(path)]
    if not out:
        raise BadRequest(f"{path} holds no requests")
    arrivals = [r.arrival_s for r in out]
    timed = [a for a in arrivals if a is not None]
    if timed and (len(timed) < len(arrivals) or any(b < a for a, b in itertools.pairwise(timed))):
        raise BadRequest(f"{path}: arrival_s must be given on every line or none, in non-decreasing order")
    return out


def write_traffic(path: Path, requests: Iterable[TraceRequest]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w") as fh:
        for r in requests:
            fh.write(json.dumps(r.as_json()) + "\n")
            n += 1
    return n


def synthetic_text(unit_id: str, n_tokens: int, encode: Callable[[str], Sequence[int]]) -> str:
    """Deterministic stand-in text for private unit ``unit_id``: ``n_tokens`` tokens under ``encode``
    (one word per token where the words tokenize so; the closest length below otherwise)."""
    seed = int.from_bytes(hashlib.blake2b(unit_id.encode(), digest_size=8).digest(), "little")
    rng = random.Random(seed)
    words = [rng.choice(_WORDS) for _ in range(n_tokens)]
    lo, hi = 1, n_tokens  # the longest word prefix within n_tokens (token counts grow with words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(" ".join(words[:mid]))) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


class UnitTexts:
    """Every unit of a trace as text: its own, or the synthetic text of its id (cached)."""

    def __init__(self, encode: Callable[[str], Sequence[int]]) -> None:
        self.encode = encode
        self._synthetic: dict[tuple[str, int], str] = {}

    def text(self, unit: TraceUnit) -> str:
        if unit.text is not None:
            return unit.text
        assert unit.id is not None, unit
        key = (unit.id, unit.tokens)
        if key not in self._synthetic:
            self._synthetic[key] = synthetic_text(unit.id, unit.tokens, self.encode)
        return self._synthetic[key]

    def pairs(self, req: TraceRequest) -> list[tuple[str, str]]:
        """(scope, text) of the request's units, in prompt order."""
        return [(u.scope, self.text(u)) for u in req.units]


def trace_workload(name: str, requests: Sequence[TraceRequest], texts: UnitTexts) -> Workload:
    """A trace as a bench workload: every request brings its units (``context_units``)."""
    out = []
    for r in requests:
        scopes = {u.scope for u in r.units}
        if len(scopes) > 1:
            raise BadRequest(f"{name}: a request's units span scopes {sorted(scopes)}; the bench sends one scope "
                             "per request")
        out.append(BenchRequest(messages=r.messages, stream=r.history,
                                context_units=tuple(t for _, t in texts.pairs(r)), scope=next(iter(scopes), r.scope),
                                placement=r.placement, max_tokens=r.max_tokens))
    return Workload(name, [], out, {"trace": name, "requests": len(out)})
