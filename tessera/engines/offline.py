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

from tessera.composition.layout import (
    Placement,
    Ranges,
    check_ranges,
    computed_ranges,
    leading_text_tokens,
    placements,
    tokens_to_compute,
)
from tessera.composition.policies import CompositionPolicy, FullRecompute
from tessera.engines.base import EngineAdapter, Extend, KVSlots, UnitPrefill, UnitState
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind


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


def teacher_force(engine: EngineAdapter, slots: KVSlots, logits: torch.Tensor, position: int,
                  tokens: Sequence[int]) -> list[torch.Tensor]:
    """Logits before each of ``tokens`` when they are fed in order (the first goes to ``position``):
    ``[logits, after tokens[0], ...]``, one per token. Scores a composition on a fixed answer."""
    out = [logits]
    for i, token in enumerate(tokens[:-1]):
        step = Extend(slots, [token], [position + i])
        engine.decode([step])
        assert step.logits is not None
        out.append(step.logits)
    return out[:len(tokens)]


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
    forced_logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] before each forced token


def compose(engine: EngineAdapter, layout: PromptLayout, policy: CompositionPolicy,
            states: Mapping[str, UnitState], *, max_new_tokens: int = 0, stop_ids: Sequence[int] = (),
            use_prefix_cache: bool = True, insert_prefix: bool = False, forced: Sequence[int] = (),
            match_into_units: bool = False) -> Composition:
    """Compose ``layout`` and greedy-continue ``max_new_tokens``, or (``forced``) score a fixed answer.
    ``match_into_units``: the prefix cache may match past the leading text, into the units (an
    order-free request, as the generation node serves it)."""
    n = layout.n_tokens
    assert n > 0, "empty prompt"
    assert not (forced and max_new_tokens), "greedy continuation and a forced answer are exclusive"
    slots = engine.allocate(n + max(max_new_tokens, len(forced)))
    lead = layout.token_ids() if match_into_units else leading_text_tokens(layout)
    try:
        prefix_len = engine.match_prefix(slots, lead[:n - 1]) if use_prefix_cache else 0
        ranges = policy.bound(engine).select(layout)
        check_ranges(layout, ranges)
        n_placed = place_units(engine, slots, placements(layout, ranges, prefix_len), states)
        ids, positions = tokens_to_compute(layout, ranges, prefix_len)
        one_pass = bool(forced) and engine.scores_tail
        if one_pass:  # the answer rides in the prompt's own forward: one pass scores it all
            ids, positions = [*ids, *forced[:-1]], [*positions, *range(n, n + len(forced) - 1)]
        final = Extend(slots, ids, positions, tail_logits=len(forced) if one_pass else 0)
        engine.step([final])
        assert final.logits is not None
        if insert_prefix:
            engine.insert_prefix(slots, leading_text_tokens(layout))
        computed = computed_ranges(layout, ranges, prefix_len)
        if one_pass:
            assert final.tail is not None
            scored = list(final.tail)
            return Composition(scored[0], [], prefix_len, computed, n_placed, scored)
        generated = greedy_continue(engine, slots, final.logits, n, max_new_tokens, stop_ids)
        scored = teacher_force(engine, slots, final.logits, n, forced) if forced else []
        return Composition(final.logits, generated, prefix_len, computed, n_placed, scored)
    finally:
        engine.free(slots)


def prefill(engine: EngineAdapter, token_ids: Sequence[int], *, max_new_tokens: int = 0,
            stop_ids: Sequence[int] = (), use_prefix_cache: bool = False) -> Composition:
    """Plain prefill of a token sequence (the baseline every composition is judged against)."""
    layout = PromptLayout((Segment(SegmentKind.TEXT, tuple(token_ids)),))
    return compose(engine, layout, FullRecompute(), {}, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                   use_prefix_cache=use_prefix_cache)
