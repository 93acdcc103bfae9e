"""Token classification of a request trace (paper §3.1): ``tessera analyze TRACE``.

``tessera analyze`` reads either a traffic trace (:mod:`tessera.benchmark.traffic`: chat
requests, rendered here through the server's prompt path) or a rendered trace, one prompt per line::

    {"stream": "locomo-conv-26", "tokens": [...token ids...], "units": [[start, end], ...]}

``units`` are the half-open token ranges of the newly injected context units. Per stream, in
order, every unit token is classified as

* prefix-covered: inside the matching prefix, the longest token prefix the prompt shares with
  any earlier prompt of the same stream (an optimistic bound on exact-prefix reuse);
* non-prefix repeat: outside it, but the unit's token sequence appeared (as a unit) in an
  earlier prompt of the stream;
* new: otherwise.

The ceiling it prints: prefix caching computes every prompt token outside the matching
prefix; composition at best computes those minus the non-prefix repeats (their states are
reused), and with the configured policy minus the repeats less what the policy recomputes of
each reused unit (a unit it inlines counts whole). Both savings are relative to prefix caching.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from tessera.benchmark.jsonl import records
from tessera.composition.policies import CompositionPolicy
from tessera.config import ClusterConfig
from tessera.errors import BadRequest, ConfigError
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind

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
    prompt_prefix: int = 0  # prompt tokens (text and units) inside the matching prefix
    recomputed: int = 0  # non-prefix repeat tokens the policy recomputes anyway
    requests: int = 0
    requests_mostly_repeat: int = 0  # >= half of their unit tokens are non-prefix repeats

    @property
    def unit_tokens(self) -> int:
        return self.prefix + self.repeat + self.new

    def add(self, other: Counts) -> None:
        for k in ("prefix", "repeat", "new", "prompt_tokens", "prompt_prefix", "recomputed", "requests",
                  "requests_mostly_repeat"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def summary(self) -> dict[str, float]:
        u, p = max(self.unit_tokens, 1), max(self.prompt_tokens, 1)
        prefix_computes = self.prompt_tokens - self.prompt_prefix
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "unit_tokens": self.unit_tokens,
            "prefix_covered": self.prefix / u,
            "non_prefix_repeat": self.repeat / u,
            "new": self.new / u,
            "requests_mostly_repeat": self.requests_mostly_repeat / max(self.requests, 1),
            "prefix_share_of_prompt_tokens": self.prefix / p,
            "repeat_share_of_prompt_tokens": self.repeat / p,
            "new_share_of_prompt_tokens": self.new / p,
            "prefix_caching_computes": prefix_computes,
            "ceiling_computes": prefix_computes - self.repeat,
            "policy_computes": prefix_computes - self.repeat + self.recomputed,
            "best_case_saving": self.repeat / max(prefix_computes, 1),
            "policy_saving": (self.repeat - self.recomputed) / max(prefix_computes, 1),
        }


class _EvenScores:
    """Scores every position the same: how many tokens a policy that reads the model selects
    does not depend on which (the trace has no model to ask)."""

    probes_model = True

    def first_layer_attention(self, token_ids: Sequence[int], query_from: int) -> list[float]:
        return [1.0] * len(token_ids)

    def second_layer_deviation(self, token_ids: Sequence[int], units: Sequence[tuple[int, int]]) -> list[float]:
        return [1.0] * len(token_ids)


def reuse_cost(policy: CompositionPolicy) -> Callable[[int], int]:
    """Tokens ``policy`` recomputes of a reused unit of n tokens (all n when it inlines the unit)."""
    policy = policy.bound(_EvenScores())

    @cache
    def cost(n: int) -> int:
        layout = PromptLayout((Segment(SegmentKind.TEXT, (0,)), Segment(SegmentKind.UNIT, (0,) * n, "u"),
                               Segment(SegmentKind.TEXT, (0,))))
        if not policy.inline(layout).unit_offsets():
            return n
        return sum(max(0, min(b, 1 + n) - max(a, 1)) for a, b in policy.select(layout))

    return cost


def classify(stream: StreamState, tokens: Sequence[int], units: Sequence[tuple[int, int]],
             recompute: Callable[[int], int] | None = None) -> Counts:
    """Classify one prompt's unit tokens against its stream's history, then add it to the history.

    ``recompute(n)``: tokens the policy recomputes of a reused unit of n tokens (``reuse_cost``).
    """
    hashes = prefix_hashes(tokens)
    matched = stream.matching_prefix(hashes)
    c = Counts(prompt_tokens=len(tokens), prompt_prefix=matched, requests=1)
    for start, end in units:
        if not 0 <= start <= end <= len(tokens):
            raise BadRequest(f"unit range [{start}, {end}) is outside a prompt of {len(tokens)} tokens")
        covered = max(0, min(end, matched) - start)
        rest = end - start - covered
        c.prefix += covered
        if tuple(tokens[start:end]) in stream.units:
            c.repeat += rest
            if recompute is not None and rest:
                c.recomputed += min(rest, recompute(end - start))
        else:
            c.new += rest
    if c.unit_tokens and 2 * c.repeat >= c.unit_tokens:
        c.requests_mostly_repeat = 1
    stream.prefixes.update(zip(range(1, len(hashes) + 1), hashes, strict=True))
    stream.units.update(tuple(tokens[s:e]) for s, e in units)
    return c


def read_trace(path: Path) -> Iterator[dict[str, Any]]:
    """A rendered trace's lines: {stream, tokens, units}."""
    for where, rec in records(path):
        try:
            tokens, units, stream = rec["tokens"], rec["units"], str(rec.get("stream", ""))
        except (KeyError, TypeError) as exc:
            raise BadRequest(f"{where}: expected {{stream, tokens, units}} or a traffic trace line "
                             f"{{messages, units, ...}}: {exc}") from None
        yield {"stream": stream, "tokens": tokens, "units": [tuple(u) for u in units]}


def _is_traffic(path: Path) -> bool:
    from tessera.benchmark.traffic import is_traffic_line

    with open(path) as fh:
        for line in fh:
            if line.strip():
                try:
                    return is_traffic_line(json.loads(line))
                except json.JSONDecodeError:
                    return False
    return False


def analyze(records: Iterable[dict[str, Any]], recompute: Callable[[int], int] | None = None) -> dict[str, Any]:
    streams: dict[str, StreamState] = {}
    per_stream: dict[str, Counts] = {}
    total = Counts()
    for rec in records:
        state = streams.setdefault(rec["stream"], StreamState())
        c = classify(state, rec["tokens"], rec["units"], recompute)
        per_stream.setdefault(rec["stream"], Counts()).add(c)
        total.add(c)
    return {
        "total": total.summary(),
        "streams": {name: c.summary() for name, c in sorted(per_stream.items())},
    }


def analyze_file(trace: Path, config: ClusterConfig) -> dict[str, Any]:
    """Classify a traffic or rendered trace; the policy's recompute is ``config``'s."""
    from tessera.composition.policies import policy_from_config

    if not trace.is_file():
        raise ConfigError(f"{trace} does not exist")
    if _is_traffic(trace):
        from tessera.benchmark.traffic import read_traffic
        from tessera.benchmark.traffic_render import TraceRenderer

        renderer = TraceRenderer(config)
        records: Iterable[dict[str, Any]] = (renderer.record(r) for r in read_traffic(trace))
    else:
        records = read_trace(trace)
    result = analyze(records, reuse_cost(policy_from_config(config.composition)))
    result["policy"] = policy_label(config)
    return result


def policy_label(config: ClusterConfig) -> str:
    from tessera.composition.calibration import setting_label

    return setting_label(config.composition, lead=False)


def run_analyze(trace: Path, per_stream: bool, config: ClusterConfig) -> None:
    """``tessera analyze``: print the trace's classification and ceiling (and each stream's, if asked)."""
    from tessera.benchmark.options import say

    result = analyze_file(trace, config)
    t = result["total"]
    say(f"requests: {t['requests']}, prompt tokens: {t['prompt_tokens']}, injected unit tokens: {t['unit_tokens']}")
    say(f"  of unit tokens:   non-prefix repeat {t['non_prefix_repeat']:.1%}   prefix-covered "
        f"{t['prefix_covered']:.1%}   new {t['new']:.1%}")
    say(f"  of prompt tokens: non-prefix repeat {t['repeat_share_of_prompt_tokens']:.1%}   prefix-covered units "
        f"{t['prefix_share_of_prompt_tokens']:.1%}   new units {t['new_share_of_prompt_tokens']:.1%}")
    say(f"  requests with >= half their unit tokens non-prefix repeats: {t['requests_mostly_repeat']:.1%}")
    say(f"  prefill tokens: prefix caching {t['prefix_caching_computes']}, composition at best "
        f"{t['ceiling_computes']}, with {result['policy']} {t['policy_computes']}")
    say(f"  best-case prefill saving over prefix caching: {t['best_case_saving']:.1%} "
        f"(with {result['policy']}: {t['policy_saving']:.1%})")
    if per_stream:
        for name, s in result["streams"].items():
            say(f"  {name or '(no stream)'}: repeat {s['non_prefix_repeat']:.1%} prefix {s['prefix_covered']:.1%} "
                f"new {s['new']:.1%} of prompt {s['repeat_share_of_prompt_tokens']:.1%} "
                f"saving {s['best_case_saving']:.1%} ({s['requests']} req)")
