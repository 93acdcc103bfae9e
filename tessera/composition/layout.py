"""Prompt-layout math of composition: ranges, placements and the tokens to compute.

Pure functions over a :class:`~tessera.messages.prompt.PromptLayout` and a policy's ranges. The
planner, the generation node's executor and the offline oracle all use them; nothing here
touches tensors or engines.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tessera.messages.prompt import PromptLayout, Segment, SegmentKind

Ranges = tuple[tuple[int, int], ...]


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sort, drop empties, and merge overlapping or touching ranges."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def text_ranges(layout: PromptLayout) -> Ranges:
    """Positions of every TEXT segment."""
    spans, offset = [], 0
    for seg in layout.segments:
        if seg.kind is SegmentKind.TEXT:
            spans.append((offset, offset + len(seg.token_ids)))
        offset += len(seg.token_ids)
    return merge_ranges(spans)


def leading_text_tokens(layout: PromptLayout) -> list[int]:
    """Token ids of the text before the first unit: the part an exact-prefix cache can serve."""
    out: list[int] = []
    for seg in layout.segments:
        if seg.kind is SegmentKind.UNIT:
            break
        out.extend(seg.token_ids)
    return out


@dataclass(frozen=True)
class Placement:
    """Place tokens ``start..end`` of unit ``unit_id`` (whose token 0 sits at ``offset``)."""

    unit_id: str
    offset: int
    start: int
    end: int
    length: int  # tokens in the whole unit (its state must have exactly this many)


def computed_ranges(layout: PromptLayout, ranges: Ranges, prefix_len: int) -> Ranges:
    """What the final extend computes: the policy's ranges above the prefix hit, plus the
    last prompt position (its logits are the answer's first token)."""
    n = layout.n_tokens
    clipped = [(max(a, prefix_len), min(b, n)) for a, b in ranges]
    return merge_ranges([*clipped, (n - 1, n)])


def tokens_to_compute(layout: PromptLayout, ranges: Ranges, prefix_len: int) -> tuple[list[int], list[int]]:
    """Token ids and positions of the final extend, in prompt order."""
    prompt = layout.token_ids()
    ids: list[int] = []
    positions: list[int] = []
    for a, b in computed_ranges(layout, ranges, prefix_len):
        ids.extend(prompt[a:b])
        positions.extend(range(a, b))
    return ids, positions


def placements(layout: PromptLayout, ranges: Ranges, prefix_len: int) -> list[Placement]:
    """Unit spans served from their states: everything not computed and not prefix-matched."""
    computed = computed_ranges(layout, ranges, prefix_len)
    out = []
    for offset, seg in layout.unit_offsets():
        lo, hi = max(offset, prefix_len), offset + len(seg.token_ids)
        for a, b in computed:
            if lo < hi and a > lo:
                out.append(Placement(seg.unit_id, offset, lo - offset, min(a, hi) - offset, hi - offset))
            lo = max(lo, b)
        if lo < hi:
            out.append(Placement(seg.unit_id, offset, lo - offset, hi - offset, hi - offset))
    return out


def check_ranges(layout: PromptLayout, ranges: Ranges) -> None:
    """Assert the policy contract: sorted disjoint ranges inside the prompt covering all text."""
    assert ranges == merge_ranges(ranges), f"ranges must be sorted and disjoint: {ranges}"
    assert all(a >= 0 and b <= layout.n_tokens for a, b in ranges), (ranges, layout.n_tokens)
    for a, b in text_ranges(layout):
        assert any(x <= a and b <= y for x, y in ranges), f"text {a}..{b} is not computed: {ranges}"


def layout_from_trace(trace: dict[str, Any]) -> PromptLayout:
    """The PromptLayout a reply's ``tessera_layout`` describes (unit ids are local names).

    For checking a served reply offline: its token ids and unit spans, as the API returned them.
    """
    tokens = trace["tokens"]
    segments: list[Segment] = []
    at = 0
    for start, end in trace["units"]:
        if start > at:
            segments.append(Segment(SegmentKind.TEXT, tuple(tokens[at:start])))
        segments.append(Segment(SegmentKind.UNIT, tuple(tokens[start:end]), f"u{start}-{end}"))
        at = end
    if at < len(tokens):
        segments.append(Segment(SegmentKind.TEXT, tuple(tokens[at:])))
    return PromptLayout(tuple(segments))
