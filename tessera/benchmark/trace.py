"""Token classification of a request trace (paper §3.1): ``tessera analyze TRACE``.

A trace is JSONL, one rendered prompt per line::

    {"stream": "locomo-conv-26", "tokens": [...token ids...], "units": [[start, end], ...]}

``units`` are the half-open token ranges of the newly injected context units. Per stream, in
order, every unit token is classified as

* prefix-covered: inside the matching prefix, the longest token prefix the prompt shares with
  any earlier prompt of the same stream (an optimistic bound on exact-prefix reuse);
* non-prefix repeat: outside it, but the unit's token sequence appeared (as a unit) in an
  earlier prompt of the stream;
* new: otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.errors import BadRequest, ConfigError

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """Rolling hash of every prefix: out[i] covers tokens[:i+1]."""
    out = []
    h = 0
    for t in tokens:
        h = (h * _BASE + t + 1) % _MOD
        out.append(h)
    return out


@dataclass
class StreamState:
    prefixes: set[tuple[int, int]] = field(default_factory=set)  # (length, hash) of earlier prompts
    units: set[tuple[int, ...]] = field(default_factory=set)

    def matching_prefix(self, hashes: Sequence[int]) -> int:
        # shared prefixes are downward closed, so binary search on the length
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (mid, hashes[mid - 1]) in self.prefixes:
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass
class Counts:
    prefix: int = 0
    repeat: int = 0
    new: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    requests_mostly_repeat: int = 0  # >= half of their unit tokens are non-prefix repeats

    @property
    def unit_tokens(self) -> int:
        return self.prefix + self.repeat + self.new

    def add(self, other: Counts) -> None:
        for k in ("prefix", "repeat", "new", "prompt_tokens", "requests", "requests_mostly_repeat"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def summary(self) -> dict[str, float]:
        u = max(self.unit_tokens, 1)
        return {
            "requests": self.requests,
            "unit_tokens": self.unit_tokens,
            "prefix_covered": self.prefix / u,
            "non_prefix_repeat": self.repeat / u,
            "new": self.new / u,
            "requests_mostly_repeat": self.requests_mostly_repeat / max(self.requests, 1),
            "repeat_share_of_prompt_tokens": self.repeat / max(self.prompt_tokens, 1),
        }


def classify(stream: StreamState, tokens: Sequence[int], units: Sequence[tuple[int, int]]) -> Counts:
    """Classify one prompt's unit tokens against its stream's history, then add it to the history."""
    hashes = prefix_hashes(tokens)
    matched = stream.matching_prefix(hashes)
    c = Counts(prompt_tokens=len(tokens), requests=1)
    for start, end in units:
        if not 0 <= start <= end <= len(tokens):
            raise BadRequest(f"unit range [{start}, {end}) is outside a prompt of {len(tokens)} tokens")
        covered = max(0, min(end, matched) - start)
        rest = end - start - covered
        c.prefix += covered
        if tuple(tokens[start:end]) in stream.units:
            c.repeat += rest
        else:
            c.new += rest
    if c.unit_tokens and 2 * c.repeat >= c.unit_tokens:
        c.requests_mostly_repeat = 1
    stream.prefixes.update(zip(range(1, len(hashes) + 1), hashes, strict=True))
    stream.units.update(tuple(tokens[s:e]) for s, e in units)
    return c


def read_trace(path: Path) -> Iterator[dict[str, Any]]:
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                tokens, units, stream = rec["tokens"], rec["units"], str(rec.get("stream", ""))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise BadRequest(f"{path}:{lineno}: expected {{stream, tokens, units}}: {exc}") from None
            yield {"stream": stream, "tokens": tokens, "units": [tuple(u) for u in units]}


def analyze(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    streams: dict[str, StreamState] = {}
    per_stream: dict[str, Counts] = {}
    total = Counts()
    for rec in records:
        state = streams.setdefault(rec["stream"], StreamState())
        c = classify(state, rec["tokens"], rec["units"])
        per_stream.setdefault(rec["stream"], Counts()).add(c)
        total.add(c)
    return {
        "total": total.summary(),
        "streams": {name: c.summary() for name, c in sorted(per_stream.items())},
    }


def run_analyze(trace: Path, per_stream: bool) -> None:
    """``tessera analyze``: print the trace's classification (and each stream's, if asked)."""
    from tessera.benchmark.options import say

    if not trace.is_file():
        raise ConfigError(f"{trace} does not exist")
    result = analyze(read_trace(trace))
    t = result["total"]
    say(f"requests: {t['requests']}, injected unit tokens: {t['unit_tokens']}")
    say(f"  non-prefix repeat: {t['non_prefix_repeat']:.1%}   prefix-covered: {t['prefix_covered']:.1%}   "
        f"new: {t['new']:.1%}")
    say(f"  requests with >= half their unit tokens non-prefix repeats: {t['requests_mostly_repeat']:.1%}")
    say(f"  non-prefix repeats as a share of all prompt tokens: {t['repeat_share_of_prompt_tokens']:.1%}")
    if per_stream:
        for name, s in result["streams"].items():
            say(f"  {name}: repeat {s['non_prefix_repeat']:.1%} prefix {s['prefix_covered']:.1%} "
                f"new {s['new']:.1%} of prompt {s['repeat_share_of_prompt_tokens']:.1%} ({s['requests']} req)")
