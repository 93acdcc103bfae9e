"""Placement kernel: rotate a unit's pre-RoPE keys to their real positions, straight into slots.

``rope_place(src, positions, cos, sin, dst)`` computes, for every layer ``l``, token ``t`` and
KV head ``h``::

    dst[l, slots[t], h, :] = src[l, t, h, :] * cos[p] + rotate_half(src[l, t, h, :]) * sin[p]

with ``p = positions[t]``. ``slots`` defaults to ``positions`` (position p lives in slot p, as
in the reference engine's per-request slots); a paged KV pool passes the physical slot of
each position instead. ``src`` is in the storage dtype of the
reusable form, ``dst`` and the tables in the compute dtype; the Triton kernel converts on the
fly; the torch path widens the unit straight into ``dst`` and rotates it there when its
positions are contiguous rows, else into one temporary that is then scattered to its rows
(scattered positions, a paged pool's slots). cos/sin come from
:class:`tessera.engines.rope.RopeTable`, which already carries any rope scaling.

Three pieces, as for every kernel here: the Triton kernel (GPU; also runs under
``TRITON_INTERPRET=1`` on CPU for tests), the torch reference that CPU uses, and the typed
wrapper that checks shapes, strides and dtypes before either runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_place_args(src: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     dst: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming the offending argument unless the launch is well-formed."""
    _check_tensors(src, cos, sin, dst)
    n_tokens = src.shape[1]
    if positions.shape != (n_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 of shape ({n_tokens},); "
                         f"got {positions.dtype} {tuple(positions.shape)}")
    if slots is not None and (slots.shape != (n_tokens,) or slots.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"slots must be int32/int64 of shape ({n_tokens},); got {slots.dtype} {tuple(slots.shape)}")
    _check_one_device(src, positions, cos, sin, dst, *(() if slots is None else (slots,)))


def _check_one_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def _check_tensors(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor) -> None:
    if src.dim() != 4 or dst.dim() != 4:
        raise ValueError(f"src and dst must be [L, T, H, D] / [L, S, H, D]; got {tuple(src.shape)}, {tuple(dst.shape)}")
    n_layers, _, n_heads, head_dim = src.shape
    if (dst.shape[0], dst.shape[2], dst.shape[3]) != (n_layers, n_heads, head_dim):
        raise ValueError(f"dst {tuple(dst.shape)} does not match src {tuple(src.shape)} in L, H or D")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos/sin must be [P, {head_dim}]; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if src.dtype not in FLOAT_DTYPES or dst.dtype not in FLOAT_DTYPES:
        raise ValueError(f"src/dst must be floating point; got {src.dtype}, {dst.dtype}")
    if cos.dtype != dst.dtype or sin.dtype != dst.dtype:
        raise ValueError(f"cos/sin must be in the compute dtype {dst.dtype}; got {cos.dtype}")
    if src.stride(-1) != 1 or dst.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous (stride 1) in src, dst, cos and sin")


def rope_place_torch(src: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     dst: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    """Torch reference (and the CPU path): contiguous positions are rotated in place in their
    rows of ``dst``; scattered positions or slots go through one temporary of the unit's size."""
    n = src.shape[1]
    if slots is not None:
        out = torch.empty((src.shape[0], n, *src.shape[2:]), dtype=dst.dtype, device=dst.device)
        rotate_into(src, cos[positions, None], sin[positions, None], out)
        dst.index_copy_(1, slots.to(torch.int64), out)
        return
    start = int(positions[0]) if n else 0
    contiguous = n > 0 and int(positions[-1]) - start == n - 1 and bool(
        (positions == torch.arange(start, start + n, device=positions.device)).all())
    if contiguous:
        _rotate_rows(src, start, cos, sin, dst)
    else:
        out = torch.empty((src.shape[0], n, *src.shape[2:]), dtype=dst.dtype, device=dst.device)
        rotate_into(src, cos[positions, None], sin[positions, None], out)
        dst.index_copy_(1, positions.to(torch.int64), out)


def rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = x * cos + rotate_half(x) * sin``; across dtypes one converting copy, then the rotation in place.

    cos/sin have duplicated halves (``[..., D]``) and broadcast to ``x``; ``out`` may be a strided
    view (e.g. slots), may have a wider dtype than ``x`` and must not overlap it. The only
    temporary is one half of ``out``. Why this order: on CPU a mixed-dtype op (fp16 ``x``
    times fp32 tables) runs a slower casting loop, so ``x`` is widened once into ``out`` and
    rotated in the compute dtype; placement is on every reused unit's path.
    """
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    o1, o2 = out[..., :half], out[..., half:]
    if x.dtype == out.dtype:
        # one dtype (the model's own q/k): four ops straight from x, no copy at all
        x1, x2 = x[..., :half], x[..., half:]
        torch.mul(x1, c, out=o1)
        o1.addcmul_(x2, s, value=-1)
        torch.mul(x2, c, out=o2)
        o2.addcmul_(x1, s)
        return out
    out.copy_(x)
    x1 = o1.clone()
    # rotate_half(x) = [-x2, x1]:  o1 = x1 c - x2 s,  o2 = x2 c + x1 s
    o1.mul_(c).addcmul_(o2, s, value=-1)
    o2.mul_(c).addcmul_(x1, s)
    return out


def rope_place_span(src: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor) -> None:
    """:func:`rope_place` for positions ``start .. start+T-1`` into the same rows of ``dst``.

    The per-request slots of the reference engine hold position p in row p, so a unit's span
    is one slice: no positions tensor is built, checked and compared on the placement path.
    """
    _check_tensors(src, cos, sin, dst)
    n = src.shape[1]
    if not 0 <= start <= min(dst.shape[1], cos.shape[0]) - n:
        raise ValueError(f"span {start}..{start + n - 1} is outside dst ({dst.shape[1]} rows) "
                         f"or the rope tables ({cos.shape[0]} rows)")
    _check_one_device(src, cos, sin, dst)
    if n == 0:
        return
    if dst.is_cuda and triton_available():
        rope_place_triton(src, torch.arange(start, start + n, device=dst.device), cos, sin, dst)
        return
    _rotate_rows(src, start, cos, sin, dst)


def _rotate_rows(src: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor) -> None:
    """Positions ``start .. start+T-1`` rotated into the same rows of ``dst`` (a view: no scatter)."""
    n = src.shape[1]
    rotate_into(src, cos[start:start + n, None], sin[start:start + n, None], dst[:, start:start + n])


@functools.cache
def _triton_kernel() -> Any:
    """Build the Triton kernel on first use (None if triton is not installed)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rope_place_kernel(src, pos, slot, cos, sin, dst, n_tokens,
                          s_l, s_t, s_h, d_l, d_s, d_h, c_p,
                          N_HEADS: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program per (layer, token): all KV heads of that row at once
        row = tl.program_id(0)
        layer = row // n_tokens
        tok = row % n_tokens
        p = tl.load(pos + tok).to(tl.int64)
        q = tl.load(slot + tok).to(tl.int64)  # destination row (== p unless the KV is paged)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < N_HEADS) & (d < HALF)
        base = src + layer.to(tl.int64) * s_l + tok.to(tl.int64) * s_t + h * s_h + d
        x1 = tl.load(base, mask=mask).to(tl.float32)
        x2 = tl.load(base + HALF, mask=mask).to(tl.float32)
        c = tl.load(cos + p * c_p + d, mask=d < HALF).to(tl.float32)
        s = tl.load(sin + p * c_p + d, mask=d < HALF).to(tl.float32)
        out = dst + layer.to(tl.int64) * d_l + q * d_s + h * d_h + d
        tl.store(out, (x1 * c - x2 * s).to(dst.dtype.element_ty), mask=mask)
        tl.store(out + HALF, (x2 * c + x1 * s).to(dst.dtype.element_ty), mask=mask)

    return rope_place_kernel


def triton_available() -> bool:
    return _triton_kernel() is not None


def rope_place_triton(src: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      dst: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("triton is not installed; use backend='torch'")
    import triton

    n_layers, n_tokens, n_heads, head_dim = src.shape
    if n_layers * n_tokens == 0:
        return
    if cos.stride(0) != sin.stride(0):
        raise ValueError("cos and sin must share their row stride")
    half = head_dim // 2
    positions = positions.contiguous()
    slots = positions if slots is None else slots.contiguous()
    kernel[(n_layers * n_tokens,)](
        src, positions, slots, cos, sin, dst, n_tokens,
        src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1), dst.stride(2), cos.stride(0),
        N_HEADS=n_heads, HALF=half,
        BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_D=triton.next_power_of_2(half),
    )


def rope_place(src: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               dst: torch.Tensor, backend: str = "auto", slots: torch.Tensor | None = None) -> None:
    """Checked entry point. ``backend``: ``auto`` (Triton on CUDA when available, else torch),
    ``triton`` or ``torch``. ``slots``: destination rows of ``dst`` (default: ``positions``)."""
    check_place_args(src, positions, cos, sin, dst, slots)
    if backend == "auto":
        backend = "triton" if dst.is_cuda and triton_available() else "torch"
    if backend == "triton":
        rope_place_triton(src, positions, cos, sin, dst, slots)
    elif backend == "torch":
        rope_place_torch(src, positions, cos, sin, dst, slots)
    else:
        raise ValueError(f"backend must be auto, triton or torch; got {backend!r}")
