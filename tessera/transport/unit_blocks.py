"""A unit state to and from its storage blocks: the tensor side of :mod:`tessera.transport.blocks`.

A generation node encodes a state into blocks before it writes them back, and decodes the
blocks it fetched into a state again. Block ``b`` of a ``BlockLayout`` of B tokens carries
tokens ``[b·B, min((b+1)·B, T))`` of K then V, each ``[L, t, H_kv, D]`` in the storage dtype;
the header, its checks and the slot sizes are the layout's. Memory nodes never come here (they
move bytes, not tensors), which is why this is the one transport module that imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tessera.engines.base import DTYPES, UnitState
from tessera.errors import ChecksumMismatch
from tessera.transport.blocks import HEADER_BYTES, BlockLayout


def _half(layout: BlockLayout, payload: memoryview, tokens: int, which: int) -> torch.Tensor:
    """K (``which`` 0) or V (1) of a block's payload of ``tokens`` tokens, as a view of its bytes."""
    g = layout.geometry
    half = tokens * g.token_bytes // 2
    raw = torch.frombuffer(payload, dtype=torch.uint8, count=half, offset=which * half)
    # [L, t, H_kv, D]
    return raw.view(DTYPES[g.kv_dtype]).view(g.n_layers, tokens, g.n_kv_heads, g.head_dim)


def encode_block(layout: BlockLayout, state: UnitState, unit_id: str, epoch: int, block_index: int,
                 out: memoryview) -> None:
    """Write block ``block_index`` of ``state`` (payload, then its header) into ``out``."""
    n = state.n_tokens
    start, end = layout.token_range(block_index, n)
    used = layout.used_bytes(block_index, n)
    assert len(out) >= used, (len(out), used)
    payload = out[HEADER_BYTES:used]
    _half(layout, payload, end - start, 0).copy_(state.keys[:, start:end])
    _half(layout, payload, end - start, 1).copy_(state.values[:, start:end])
    layout.seal(out, unit_id, epoch, block_index, n)


def encode_unit(layout: BlockLayout, state: UnitState, unit_id: str, epoch: int) -> list[memoryview]:
    """All blocks of a unit, each a view of exactly its used bytes in one fresh buffer."""
    n = state.n_tokens
    sizes = [layout.used_bytes(b, n) for b in range(layout.n_blocks(n))]
    whole = memoryview(bytearray(sum(sizes)))
    out, offset = [], 0
    for b, size in enumerate(sizes):
        view = whole[offset : offset + size]
        encode_block(layout, state, unit_id, epoch, b, view)
        out.append(view)
        offset += size
    return out


def decode_unit(layout: BlockLayout, blocks: Sequence[memoryview], unit_id: str, epoch: int, n_tokens: int, *,
                pin_memory: bool = False) -> UnitState:
    """Verify every block and assemble the unit's ``[L, T, H_kv, D]`` keys and values.

    ``pin_memory``: assemble into pinned host buffers (the engine runs on CUDA and copies
    them to the device asynchronously).
    """
    if len(blocks) != layout.n_blocks(n_tokens):
        raise ChecksumMismatch(f"unit {unit_id}: {len(blocks)} blocks for {n_tokens} tokens, "
                               f"expected {layout.n_blocks(n_tokens)}")
    g = layout.geometry
    shape = (g.n_layers, n_tokens, g.n_kv_heads, g.head_dim)
    keys = torch.empty(shape, dtype=DTYPES[g.kv_dtype], pin_memory=pin_memory)
    values = torch.empty(shape, dtype=DTYPES[g.kv_dtype], pin_memory=pin_memory)
    for b, buf in enumerate(blocks):
        payload = layout.verify(buf, unit_id, epoch, b, n_tokens)
        start, end = layout.token_range(b, n_tokens)
        keys[:, start:end].copy_(_half(layout, payload, end - start, 0))
        values[:, start:end].copy_(_half(layout, payload, end - start, 1))
    return UnitState(keys, values)
