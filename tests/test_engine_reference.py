"""The reference engine keeps the EngineAdapter contract: ragged steps, slots, unit capture, limits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_support import max_diff, random_tokens, tiny_engine

from tessera.engines.base import Extend, UnitPrefill
from tessera.engines.offline import prefill
from tessera.engines.reference import ReferenceEngine, TorchSlots
from tessera.errors import BadRequest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> ReferenceEngine:
    return tiny_engine(tiny_dir, "qwen2")


def _prefilled(engine: ReferenceEngine, tokens: tuple[int, ...], n_slots: int) -> TorchSlots:
    slots = engine.allocate(n_slots)
    engine.step([Extend(slots, tokens, range(len(tokens)))])
    assert isinstance(slots, TorchSlots)
    return slots


def test_ragged_batch_equals_one_by_one(engine: ReferenceEngine) -> None:
    """Unit prefills, a fresh prefill, a decode and a scattered extend in one step = each run alone."""
    unit_a, unit_b = random_tokens(33, 1), random_tokens(9, 2)
    prompt, history = random_tokens(41, 3), random_tokens(57, 4)

    def work() -> tuple[list[UnitPrefill | Extend], list[TorchSlots]]:
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
        assert max_diff(bs.keys, as_.keys) < 1e-5


def test_chunked_prefill_and_decode_equal_one_prefill(engine: ReferenceEngine) -> None:
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


def test_unit_prefill_captures_prerope_keys_in_the_storage_dtype(tiny_dir: Path) -> None:
    """A unit's state is [L, T, H_kv, D] in kv_dtype; layer-0 keys are the unrotated projection."""
    engine = tiny_engine(tiny_dir, kv_dtype="float16")
    tokens = random_tokens(25, 6)
    work = UnitPrefill(tokens)
    engine.step([work])
    g = engine.geometry
    assert work.state is not None
    assert work.state.keys.shape == (g.n_layers, 25, g.n_kv_heads, g.head_dim)
    assert work.state.keys.dtype == torch.float16 and g.kv_dtype == "float16"
    # at position 0 RoPE is the identity, so slot 0 of a prefill holds the unrotated key
    slots = _prefilled(engine, tokens, 25)
    assert max_diff(work.state.keys[:, 0], slots.keys[:, 0]) < 1e-2


def test_unit_bos_prefills_behind_bos_without_capturing_it(tiny_dir: Path) -> None:
    """With composition.unit_bos the unit attends to a BOS sink that is not part of its state."""
    plain, sink = tiny_engine(tiny_dir), tiny_engine(tiny_dir, unit_bos=True)
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


def test_slots_and_limits_fail_with_a_reason(engine: ReferenceEngine) -> None:
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


def test_geometry_fingerprint_and_tokenizer_describe_the_model(engine: ReferenceEngine) -> None:
    """Geometry, serving fingerprint and tokenizer come from the loaded checkpoint and config."""
    g = engine.geometry
    assert (g.n_layers, g.n_kv_heads, g.head_dim, g.vocab_size) == (2, 2, 16, 49152)
    assert g.token_bytes == 2 * 2 * 2 * 16 * 4  # fp32 storage in this fixture
    assert engine.fingerprint.kv_dtype == "float32"
    text = "Composable KV caches."
    assert engine.decode_tokens(engine.encode(text)) == text
    assert 2 in engine.eos_token_ids


def test_bfloat16_compute_stays_close_to_float32(tiny_dir: Path, engine: ReferenceEngine) -> None:
    """model.dtype = bfloat16 runs the same forward in half precision (same argmax, small drift)."""
    half = tiny_engine(tiny_dir, dtype="bfloat16", kv_dtype="bfloat16")
    tokens = random_tokens(40, 9)
    a, b = prefill(engine, tokens).logits, prefill(half, tokens).logits
    assert b.dtype == torch.float32
    assert int(a.argmax()) == int(b.argmax())
    assert max_diff(a, b) < 0.1 * float(a.abs().max())
