"""Placement re-rotates cached pre-RoPE keys to exactly the keys the model computes at those positions."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.engines import LLAMA3_SCALING, max_diff, random_tokens, tiny_engine

from tessera.engines.base import Extend, UnitPrefill
from tessera.engines.reference import ReferenceEngine, TorchSlots
from tessera.engines.rope import apply_rope
from tessera.kernels.rope import rope_place, rope_place_span

ROPES = pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])


def _engine(tmp_path: Path, scaling: dict[str, object] | None) -> ReferenceEngine:
    opts = {} if scaling is None else {"rope_scaling": scaling}
    return tiny_engine(tmp_path, "llama", checkpoint_opts=opts)


def _unit_state(engine: ReferenceEngine, tokens: tuple[int, ...]) -> UnitPrefill:
    work = UnitPrefill(tokens)
    engine.step([work])
    assert work.state is not None
    return work


@ROPES
@pytest.mark.integration
def test_placed_keys_equal_transformers_rotation(tmp_path: Path, scaling: dict[str, object] | None) -> None:
    """place() gives transformers' RoPE (incl. llama3 scaling) of the cached keys at the new positions."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

    engine = _engine(tmp_path, scaling)
    state = _unit_state(engine, random_tokens(40, seed=2)).state
    assert state is not None
    offset = 300  # beyond original_max_position_embeddings: the scaled bands matter
    slots = engine.allocate(offset + 40)
    engine.place(slots, offset, state)
    rotary = LlamaRotaryEmbedding(config=AutoConfig.from_pretrained(str(tmp_path)))
    cos, sin = rotary(state.keys, torch.arange(offset, offset + 40)[None])
    cos, sin = cos[0][:, None], sin[0][:, None]  # [T, 1, D]
    expected = state.keys * cos + rotate_half(state.keys) * sin
    assert isinstance(slots, TorchSlots)
    assert max_diff(slots.keys[:, offset:offset + 40], expected) < 1e-6
    assert torch.equal(slots.values[:, offset:offset + 40], state.values)


@ROPES
@pytest.mark.integration
def test_layer0_placed_keys_equal_keys_computed_at_target_positions(tmp_path: Path,
                                                                    scaling: dict[str, object] | None) -> None:
    """Layer-0 keys do not depend on context, so a placed unit must match a prefill at its offset."""
    engine = _engine(tmp_path, scaling)
    lead, unit = random_tokens(150, seed=5), random_tokens(60, seed=6)
    state = _unit_state(engine, unit).state
    assert state is not None
    direct, placed = engine.allocate(210), engine.allocate(210)
    engine.step([Extend(direct, lead + unit, range(210))])
    engine.place(placed, 150, state)
    assert isinstance(direct, TorchSlots) and isinstance(placed, TorchSlots)
    assert max_diff(direct.keys[0, 150:], placed.keys[0, 150:]) < 1e-5
    assert max_diff(direct.values[0, 150:], placed.values[0, 150:]) < 1e-5


def test_torch_placement_handles_scattered_positions_and_strided_sources() -> None:
    """The torch path rotates a strided half-precision view into arbitrary slot positions."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(64, 8, generator=g)
    cos, sin = table.cos(), table.sin()
    cos, sin = torch.cat((cos[:, :4], cos[:, :4]), 1), torch.cat((sin[:, :4], sin[:, :4]), 1)
    src = torch.randn(3, 20, 2, 8, generator=g).half()[:, 5:15]  # a view: strided along T
    positions = torch.tensor([40, 3, 7, 8, 9, 10, 60, 61, 0, 33])
    dst = torch.zeros(3, 64, 2, 8)
    rope_place(src, positions, cos, sin, dst, backend="torch")
    expected = apply_rope(src.float(), cos[positions][:, None], sin[positions][:, None])
    assert max_diff(dst[:, positions], expected) < 1e-6
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[positions] = False
    assert torch.count_nonzero(dst[:, untouched]) == 0


def test_paged_placement_writes_rows_given_by_slots() -> None:
    """With slots, position p's rotation lands in row slots[t] (a paged pool's physical slot)."""
    g = torch.Generator().manual_seed(1)
    angles = torch.randn(64, 4, generator=g)
    cos, sin = torch.cat((angles.cos(),) * 2, 1), torch.cat((angles.sin(),) * 2, 1)
    src = torch.randn(2, 6, 2, 8, generator=g)
    positions, slots = torch.arange(10, 16), torch.tensor([33, 34, 35, 4, 5, 6])
    dst = torch.zeros(2, 40, 2, 8)
    rope_place(src, positions, cos, sin, dst, backend="torch", slots=slots)
    assert max_diff(dst[:, slots], apply_rope(src, cos[positions][:, None], sin[positions][:, None])) < 1e-6
    assert torch.count_nonzero(dst[:, 10:16]) == 0


def test_a_span_placement_equals_the_positions_one_and_stays_inside_its_rows() -> None:
    """rope_place_span (the reference engine's path: position p in row p) writes exactly what
    rope_place writes for the same contiguous positions, from a strided fp16 view, bit for bit,
    touches no other row, and refuses a span past dst or the tables."""
    g = torch.Generator().manual_seed(2)
    angles = torch.randn(64, 4, generator=g)
    cos, sin = torch.cat((angles.cos(),) * 2, 1), torch.cat((angles.sin(),) * 2, 1)
    src = torch.randn(3, 20, 2, 8, generator=g).half()[:, 4:13]
    by_positions, by_span = torch.zeros(3, 40, 2, 8), torch.zeros(3, 40, 2, 8)
    rope_place(src, torch.arange(17, 26), cos, sin, by_positions, backend="torch")
    rope_place_span(src, 17, cos, sin, by_span)
    assert torch.equal(by_span, by_positions)
    assert max_diff(by_span[:, 17:26], apply_rope(src.float(), cos[17:26][:, None], sin[17:26][:, None])) < 1e-6
    assert torch.count_nonzero(by_span[:, :17]) == 0 and torch.count_nonzero(by_span[:, 26:]) == 0
    for start in (-1, 32):
        with pytest.raises(ValueError, match="outside dst"):
            rope_place_span(src, start, cos, sin, by_span)


@pytest.mark.parametrize(
    ("src_shape", "dst_shape", "cos_dtype", "needle"),
    [
        ((2, 4, 2, 8), (2, 10, 3, 8), torch.float32, "does not match"),
        ((2, 4, 2, 7), (2, 10, 2, 7), torch.float32, "even"),
        ((2, 4, 2, 8), (2, 10, 2, 8), torch.float16, "compute dtype"),
    ],
)
def test_placement_wrapper_rejects_bad_launches(src_shape: tuple[int, ...], dst_shape: tuple[int, ...],
                                                cos_dtype: torch.dtype, needle: str) -> None:
    """The typed wrapper names what is wrong before any kernel runs."""
    d = src_shape[-1]
    cos = torch.zeros(16, d, dtype=cos_dtype)
    with pytest.raises(ValueError, match=needle):
        rope_place(torch.zeros(src_shape), torch.arange(4), cos, cos.clone(), torch.zeros(dst_shape))


TRITON_CHECK = textwrap.dedent("""
    import torch
    from tessera.kernels.rope import rope_place
    g = torch.Generator().manual_seed(0)
    angles = torch.randn(128, 32, generator=g)
    for src_dtype, dst_dtype in [(torch.float16, torch.float32), (torch.float32, torch.float32),
                                 (torch.bfloat16, torch.bfloat16)]:
        cos = torch.cat((angles.cos(), angles.cos()), 1).to(dst_dtype)
        sin = torch.cat((angles.sin(), angles.sin()), 1).to(dst_dtype)
        src = torch.randn(3, 30, 3, 64, generator=g).to(src_dtype)[:, 4:24]   # strided view, 3 heads
        for positions in (torch.arange(50, 70), torch.randperm(128, generator=g)[:20]):
            a, b = torch.zeros(3, 128, 3, 64, dtype=dst_dtype), torch.zeros(3, 128, 3, 64, dtype=dst_dtype)
            rope_place(src, positions, cos, sin, a, backend="triton")
            rope_place(src, positions, cos, sin, b, backend="torch")
            # bf16: the kernel rounds once from float32, torch rounds after each op (1 ulp apart)
            tol = 1e-6 if dst_dtype == torch.float32 else 1e-2
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
            # paged destination: rows given by slots, not by positions
            slots = torch.randperm(128, generator=g)[:20]
            a.zero_(), b.zero_()
            rope_place(src, positions, cos, sin, a, backend="triton", slots=slots)
            rope_place(src, positions, cos, sin, b, backend="torch", slots=slots)
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.integration
def test_triton_kernel_matches_torch_under_the_interpreter() -> None:
    """The Triton placement kernel, run by TRITON_INTERPRET=1 on CPU, equals the torch reference."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
