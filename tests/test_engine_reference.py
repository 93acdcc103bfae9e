"""Both CPU engines (reference, paged) keep the EngineAdapter contract: ragged steps, slots, unit capture,
limits; and the paged engine's logits equal the reference engine's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.engines import ENGINE_NAMES, max_diff, random_tokens, slot_kv, tiny_engine

from tessera.engines.base import EngineAdapter, Extend, KVSlots, UnitPrefill
from tessera.engines.offline import prefill
from tessera.errors import BadRequest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module", params=ENGINE_NAMES)
def engine_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path, engine_name: str) -> EngineAdapter:
    return tiny_engine(tiny_dir, "qwen2", engine=engine_name)


def _prefilled(engine: EngineAdapter, tokens: tuple[int, ...], n_slots: int) -> KVSlots:
    slots = engine.allocate(n_slots)
    engine.step([Extend(slots, tokens, range(len(tokens)))])
    return slots


def test_ragged_batch_equals_one_by_one(engine: EngineAdapter) -> None:
    """Unit prefills, a fresh prefill, a decode and a scattered extend in one step = each run alone."""
    unit_a, unit_b = random_tokens(33, 1), random_tokens(9, 2)
    prompt, history = random_tokens(41, 3), random_tokens(57, 4)

    def work() -> tuple[list[UnitPrefill | Extend], list[KVSlots]]:
        fresh = engine.allocate(41)
        decoding = _prefilled(engine, history, 58)
        # scattered: positions 20..29 and 50..56 recomputed over a prefilled request
        scattered = _prefilled(engine, history, 57)
        positions = [*range(20, 30), *range(50, 57)]
        return [UnitPrefill(unit_a), Extend(fresh, prompt, range(41)), UnitPrefill(unit_b),
                Extend(decoding, (7,), (57,)), Extend(scattered, [history[p] for p in positions], positions)], \
            [fresh, decoding, scattered]

    batched, batched_slots = work()
    engine.step(batched)
    alone, alone_slots = work()
    for w in alone:
        engine.step([w])
    for b, a in zip(batched, alone, strict=True):
        if isinstance(b, UnitPrefill):
            assert isinstance(a, UnitPrefill) and b.state is not None and a.state is not None
            assert max_diff(b.state.keys, a.state.keys) < 1e-5 and max_diff(b.state.values, a.state.values) < 1e-5
        else:
            assert isinstance(a, Extend) and b.logits is not None and a.logits is not None
            assert max_diff(b.logits, a.logits) < 1e-4
    for bs, as_ in zip(batched_slots, alone_slots, strict=True):
        assert max_diff(slot_kv(engine, bs)[0], slot_kv(engine, as_)[0]) < 1e-5


def test_chunked_prefill_and_decode_equal_one_prefill(engine: EngineAdapter) -> None:
    """Extending in chunks, then decoding token by token, gives the logits of one long prefill."""
    tokens = random_tokens(90, 5)
    slots = engine.allocate(90)
    for a, b in ((0, 40), (40, 75)):
        engine.step([Extend(slots, tokens[a:b], range(a, b))])
    for p in range(75, 90):
        step = Extend(slots, tokens[p:p + 1], (p,))
        engine.decode([step])
        assert step.logits is not None
        assert max_diff(step.logits, prefill(engine, tokens[:p + 1]).logits) < 1e-4


def test_unit_prefill_captures_prerope_keys_in_the_storage_dtype(tiny_dir: Path, engine_name: str) -> None:
    """A unit's state is [L, T, H_kv, D] in kv_dtype; layer-0 keys are the unrotated projection."""
    engine = tiny_engine(tiny_dir, kv_dtype="float16", engine=engine_name)
    tokens = random_tokens(25, 6)
    work = UnitPrefill(tokens)
    engine.step([work])
    g = engine.geometry
    assert work.state is not None
    assert work.state.keys.shape == (g.n_layers, 25, g.n_kv_heads, g.head_dim)
    assert work.state.keys.dtype == torch.float16 and g.kv_dtype == "float16"
    # at position 0 RoPE is the identity, so slot 0 of a prefill holds the unrotated key
    slots = _prefilled(engine, tokens, 25)
    assert max_diff(work.state.keys[:, 0], slot_kv(engine, slots)[0][:, 0]) < 1e-2


def test_unit_bos_prefills_behind_bos_without_capturing_it(tiny_dir: Path, engine_name: str) -> None:
    """With composition.unit_bos the unit attends to a BOS sink that is not part of its state."""
    plain, sink = tiny_engine(tiny_dir, engine=engine_name), tiny_engine(tiny_dir, unit_bos=True, engine=engine_name)
    assert sink.fingerprint.unit_bos and not plain.fingerprint.unit_bos
    tokens = random_tokens(20, 7)
    a, b = UnitPrefill(tokens), UnitPrefill(tokens)
    plain.step([a])
    sink.step([b])
    assert a.state is not None and b.state is not None
    assert b.state.n_tokens == 20
    # layer 0 sees no context; deeper layers attend to the sink
    assert max_diff(a.state.keys[0], b.state.keys[0]) < 1e-5
    assert max_diff(a.state.keys[1], b.state.keys[1]) > 1e-3


def test_slots_and_limits_fail_with_a_reason(engine: EngineAdapter) -> None:
    """Requests beyond the context, units beyond their slots and reuse after free are refused."""
    with pytest.raises(BadRequest, match="positions"):
        engine.allocate(engine.geometry.max_context + 1)
    slots = engine.allocate(10)
    work = UnitPrefill(random_tokens(8, 8))
    engine.step([work])
    assert work.state is not None
    with pytest.raises(ValueError, match="does not fit"):
        engine.place(slots, 5, work.state)
    engine.free(slots)
    with pytest.raises(AssertionError, match="after free"):
        engine.place(slots, 0, work.state)


def test_geometry_fingerprint_and_tokenizer_describe_the_model(engine: EngineAdapter) -> None:
    """Geometry, serving fingerprint and tokenizer come from the loaded checkpoint and config."""
    g = engine.geometry
    assert (g.n_layers, g.n_kv_heads, g.head_dim, g.vocab_size) == (2, 2, 16, 49152)
    assert g.token_bytes == 2 * 2 * 2 * 16 * 4  # fp32 storage in this fixture
    assert engine.fingerprint.kv_dtype == "float32"
    text = "Composable KV caches."
    assert engine.decode_tokens(engine.encode(text)) == text
    assert 2 in engine.eos_token_ids


def test_bfloat16_compute_stays_close_to_float32(tiny_dir: Path, engine: EngineAdapter, engine_name: str) -> None:
    """model.dtype = bfloat16 runs the same forward in half precision (same argmax, small drift)."""
    half = tiny_engine(tiny_dir, dtype="bfloat16", kv_dtype="bfloat16", engine=engine_name)
    tokens = random_tokens(40, 9)
    a, b = prefill(engine, tokens).logits, prefill(half, tokens).logits
    assert b.dtype == torch.float32
    assert int(a.argmax()) == int(b.argmax())
    assert max_diff(a, b) < 0.1 * float(a.abs().max())


def test_paged_engine_equals_the_reference_engine(tiny_dir: Path) -> None:
    """Same checkpoint, same ragged work: the paged engine's logits and unit states equal the reference's."""
    ref, paged = tiny_engine(tiny_dir, "qwen2"), tiny_engine(tiny_dir, "qwen2", engine="paged")
    history, unit = random_tokens(70, 11), random_tokens(30, 12)
    results = []
    for engine in (ref, paged):
        a, b = _prefilled(engine, history[:50], 72), _prefilled(engine, history, 70)
        positions = [*range(10, 20), *range(40, 70)]  # scattered recompute over a filled request
        work: list[UnitPrefill | Extend] = [UnitPrefill(unit), Extend(a, (9,), (50,)),
                                            Extend(b, [history[p] for p in positions], positions)]
        engine.step(work)
        results.append(work)
    for r, p in zip(*results, strict=True):
        if isinstance(r, UnitPrefill):
            assert isinstance(p, UnitPrefill) and r.state is not None and p.state is not None
            assert max_diff(r.state.keys, p.state.keys) < 1e-5 and max_diff(r.state.values, p.state.values) < 1e-5
        else:
            assert isinstance(p, Extend) and r.logits is not None and p.logits is not None
            assert max_diff(r.logits, p.logits) < 1e-4


def test_paged_pool_refuses_what_does_not_fit_and_reuses_freed_pages(tiny_dir: Path) -> None:
    """allocate() takes whole pages: Overloaded when the pool is full now, BadRequest when it never fits."""
    from tessera.engines.kv_pages import PagedSlots
    from tessera.errors import Overloaded

    engine = tiny_engine(tiny_dir, "qwen2", engine="paged")
    pool = engine.pool
    total = pool.free_pages
    first = engine.allocate(2000)  # 125 pages of 16
    assert isinstance(first, PagedSlots) and len(first.pages) == 125 and pool.free_pages == total - 125
    assert first.slot_of[17] == first.pages[1] * 16 + 1
    held = [engine.allocate(2000) for _ in range(total // 125 - 1)]
    with pytest.raises(Overloaded, match="free pages"):
        engine.allocate(2000)
    engine.free(first)
    engine.free(engine.allocate(2000))
    for s in held:
        engine.free(s)
    assert pool.free_pages == total
    with pytest.raises(BadRequest, match="kv_pool_tokens"):
        tiny_engine(tiny_dir, "qwen2", engine="paged", kv_pool_tokens=64).allocate(100)
