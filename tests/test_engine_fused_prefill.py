"""A unit prefilled inside its request's extend (Extend.units, the reference engine) gives, bit
for bit, what a separate prefill and placement give: the same state, slots and logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.engines import random_tokens, tiny_engine

from tessera.engines.base import Extend, UnitFeed, UnitPrefill, UnitState
from tessera.engines.reference import ReferenceEngine, TorchSlots
from tessera.generation.scheduler import Scheduler

PREFIX, UNIT_A = random_tokens(12, 21), random_tokens(30, 22)
UNIT_B, QUESTION = random_tokens(9, 23), random_tokens(7, 24)
N = len(PREFIX) + len(UNIT_A) + len(UNIT_B) + len(QUESTION)  # prefix | A | B | question
A_AT, B_AT = len(PREFIX), len(PREFIX) + len(UNIT_A)
# A: rows 0..3 recomputed in place (an EPIC head), 3..14 placed, 14..17 recomputed, 17..30 placed;
# B: placed whole (its state is another request's, already cached)
A_SPANS = [(3, 14, A_AT + 3), (17, 30, A_AT + 17)]
A_COMPUTED = [*range(A_AT, A_AT + 3), *range(A_AT + 14, A_AT + 17)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-fused")


def _extend_tokens() -> tuple[list[int], list[int]]:
    prompt = [*PREFIX, *UNIT_A, *UNIT_B, *QUESTION]
    positions = [*A_COMPUTED, *range(N - len(QUESTION), N)]
    return [prompt[p] for p in positions], positions


def _request(engine: ReferenceEngine, b_state: UnitState) -> TorchSlots:
    """Slots with the prefix computed and unit B placed (what precedes the final extend)."""
    slots = engine.allocate(N)
    assert isinstance(slots, TorchSlots)
    engine.step([Extend(slots, PREFIX, range(len(PREFIX)))])
    engine.place(slots, B_AT, b_state)
    return slots


def _separate(engine: ReferenceEngine, b_state: UnitState) -> tuple[UnitState, TorchSlots, torch.Tensor]:
    prefill = UnitPrefill(UNIT_A)
    engine.step([prefill])
    assert prefill.state is not None
    slots = _request(engine, b_state)
    for start, end, position in A_SPANS:
        engine.place(slots, position, UnitState(prefill.state.keys[:, start:end], prefill.state.values[:, start:end]))
    ids, positions = _extend_tokens()
    ext = Extend(slots, ids, positions)
    engine.step([ext])
    assert ext.logits is not None
    return prefill.state, slots, ext.logits


@pytest.mark.parametrize("unit_bos", [False, True])
def test_a_unit_fed_in_the_extend_equals_its_prefill_then_placement(tiny_dir: Path, unit_bos: bool) -> None:
    """One forward (unit prefilled and placed layer by layer) = two forwards (prefill, place, extend):
    equal state, slots and logits, with a float16 state (its rounding is what a request sees) and
    a BOS sink that is prefilled but not captured."""
    engine = tiny_engine(tiny_dir, "qwen2", kv_dtype="float16", unit_bos=unit_bos)
    b = UnitPrefill(UNIT_B)
    engine.step([b])
    assert b.state is not None
    state, slots, logits = _separate(engine, b.state)

    fused_slots = _request(engine, b.state)
    feed = UnitFeed(UNIT_A, A_SPANS)
    ids, positions = _extend_tokens()
    ext = Extend(fused_slots, ids, positions, units=[feed])
    assert ext.n_computed == len(ids) + len(UNIT_A)
    engine.step([ext])
    assert feed.state is not None and ext.logits is not None
    assert feed.state.keys.dtype == torch.float16
    assert torch.equal(feed.state.keys, state.keys) and torch.equal(feed.state.values, state.values)
    assert torch.equal(fused_slots.keys, slots.keys) and torch.equal(fused_slots.values, slots.values)
    assert torch.equal(ext.logits, logits)


def test_a_fed_extend_batched_with_another_request_equals_it_alone(tiny_dir: Path) -> None:
    """A fed unit lands in its own request's slots only: batched beside another request's extend,
    both give what they give alone (to the ragged batch's tolerance)."""
    engine = tiny_engine(tiny_dir, "qwen2", kv_dtype="float16")
    b = UnitPrefill(UNIT_B)
    engine.step([b])
    assert b.state is not None
    _, alone_slots, alone_logits = _separate(engine, b.state)
    other_tokens = random_tokens(40, 25)
    other_alone = Extend(engine.allocate(40), other_tokens, range(40))
    engine.step([other_alone])

    fused_slots = _request(engine, b.state)
    ids, positions = _extend_tokens()
    other = Extend(engine.allocate(40), other_tokens, range(40))
    ext = Extend(fused_slots, ids, positions, units=[UnitFeed(UNIT_A, A_SPANS)])
    engine.step([other, ext])
    assert ext.logits is not None and other.logits is not None and other_alone.logits is not None
    assert float((ext.logits - alone_logits).abs().max()) < 1e-4
    assert float((other.logits - other_alone.logits).abs().max()) < 1e-4
    assert float((fused_slots.keys - alone_slots.keys).abs().max()) < 1e-5


def test_a_unit_span_outside_the_unit_or_the_slots_is_refused(tiny_dir: Path) -> None:
    engine = tiny_engine(tiny_dir, "qwen2")
    slots = engine.allocate(20)
    for spans in ([(0, 31, 0)], [(5, 3, 0)], [(0, 10, 15)], [(0, 1, -1)]):
        with pytest.raises(ValueError, match="does not fit"):
            engine.step([Extend(slots, [5], [19], units=[UnitFeed(UNIT_A, spans)])])


async def test_a_chunked_extend_carries_its_units_in_the_first_chunk(tiny_dir: Path) -> None:
    """Scheduler.extend in chunks smaller than the prompt: the units ride the first chunk (every
    later chunk attends to them) and the result is the one-forward result."""
    engine = tiny_engine(tiny_dir, "qwen2", kv_dtype="float16")
    b = UnitPrefill(UNIT_B)
    engine.step([b])
    assert b.state is not None
    _, slots, logits = _separate(engine, b.state)
    scheduler = Scheduler(engine, max_batch_tokens=4)
    assert scheduler.fuses_unit_prefills
    scheduler.start()
    try:
        fused_slots = _request(engine, b.state)
        feed = UnitFeed(UNIT_A, A_SPANS)
        ids, positions = _extend_tokens()
        chunked = await scheduler.extend(fused_slots, ids, positions, units=[feed])
    finally:
        await scheduler.stop()
    assert feed.state is not None
    assert float((chunked - logits).abs().max()) < 1e-4
    assert float((fused_slots.keys - slots.keys).abs().max()) < 1e-5
