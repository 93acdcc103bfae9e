"""Offline composition of one prompt from unit states: the oracle of the serving path.

Steps (the generation node runs the same ones, interleaved with other requests):

1. allocate slots for prompt + decode;
2. match the leading text against the exact-prefix cache;
3. place every unit span the policy does not recompute (RoPE at its real positions);
4. one extend over the selected positions (:func:`tokens_to_compute`), which also yields the
   next-token logits; optionally greedy-continue.

Each step is a small function so the node can reuse them. Unit states are only read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tessera.engines.base import EngineAdapter, Extend, KVSlots, UnitPrefill, UnitState
from tessera.engines.composition import (
    CompositionPolicy,
    FullRecompute,
    Ranges,
    leading_text_tokens,
    merge_ranges,
    text_ranges,
)
from tessera.messages import PromptLayout, Segment, SegmentKind


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


def place_units(engine: EngineAdapter, slots: KVSlots, plan: Sequence[Placement],
                states: Mapping[str, UnitState]) -> int:
    """Place every planned span (views of the states: nothing is copied or modified). Returns tokens placed."""
    for p in plan:
        st = states[p.unit_id]
        assert st.n_tokens == p.length, f"state of {p.unit_id} has {st.n_tokens} tokens, layout says {p.length}"
        engine.place(slots, p.offset + p.start,
                     UnitState(st.keys[:, p.start:p.end], st.values[:, p.start:p.end]))
    return sum(p.end - p.start for p in plan)


def greedy_continue(engine: EngineAdapter, slots: KVSlots, logits: torch.Tensor, position: int,
                    n_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """Greedy tokens after ``logits`` (the next token goes to ``position``), one decode step each."""
    out: list[int] = []
    for i in range(n_tokens):
        token = int(logits.argmax())
        out.append(token)
        if token in stop_ids or i == n_tokens - 1:
            break
        step = Extend(slots, [token], [position + i])
        engine.decode([step])
        assert step.logits is not None
        logits = step.logits
    return out


def prefill_units(engine: EngineAdapter, layout: PromptLayout) -> dict[str, UnitState]:
    """Independently prefill every distinct unit of ``layout`` in one step."""
    work = {seg.unit_id: UnitPrefill(seg.token_ids) for _, seg in layout.unit_offsets()}
    engine.step(list(work.values()))
    return {uid: w.state for uid, w in work.items() if w.state is not None}


@dataclass
class Composition:
    logits: torch.Tensor  # [vocab] float32: the next token after the prompt
    generated: list[int] = field(default_factory=list)
    prefix_len: int = 0  # positions served by the exact-prefix cache
    computed: Ranges = ()  # positions computed by the final extend
    n_placed: int = 0  # unit tokens served from states


def compose(engine: EngineAdapter, layout: PromptLayout, policy: CompositionPolicy,
            states: Mapping[str, UnitState], *, max_new_tokens: int = 0, stop_ids: Sequence[int] = (),
            use_prefix_cache: bool = True, insert_prefix: bool = False) -> Composition:
    n = layout.n_tokens
    assert n > 0, "empty prompt"
    slots = engine.allocate(n + max_new_tokens)
    try:
        prefix_len = engine.match_prefix(slots, leading_text_tokens(layout)[:n - 1]) if use_prefix_cache else 0
        ranges = policy.select(layout)
        check_ranges(layout, ranges)
        n_placed = place_units(engine, slots, placements(layout, ranges, prefix_len), states)
        ids, positions = tokens_to_compute(layout, ranges, prefix_len)
        final = Extend(slots, ids, positions)
        engine.step([final])
        assert final.logits is not None
        if insert_prefix:
            engine.insert_prefix(slots, leading_text_tokens(layout))
        generated = greedy_continue(engine, slots, final.logits, n, max_new_tokens, stop_ids)
        return Composition(final.logits, generated, prefix_len, computed_ranges(layout, ranges, prefix_len),
                           n_placed)
    finally:
        engine.free(slots)


def prefill(engine: EngineAdapter, token_ids: Sequence[int], *, max_new_tokens: int = 0,
            stop_ids: Sequence[int] = (), use_prefix_cache: bool = False) -> Composition:
    """Plain prefill of a token sequence (the baseline every composition is judged against)."""
    layout = PromptLayout((Segment(SegmentKind.TEXT, tuple(token_ids)),))
    return compose(engine, layout, FullRecompute(), {}, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                   use_prefix_cache=use_prefix_cache)
