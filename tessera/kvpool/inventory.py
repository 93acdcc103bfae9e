"""What a memory node's arena still holds: the verified blocks, named by their headers.

After the retrieval role (the control plane) restarts, the shared tier's directory is gone
but the memory nodes' arenas are not. Each block carries a header naming its unit digest,
storage epoch, block index and token counts, with CRC-32s of header and payload
(transport/blocks.py), so a node can list what it holds without knowing any unit: the
control plane decides which of these become READY entries again (control/plane.py, adopt).

A slot being written while it is scanned fails its checksum and is simply not listed.
This module knows nothing about units, epochs' meaning or the control plane.
"""

from __future__ import annotations

import zlib

from tessera.errors import ChecksumMismatch
from tessera.messages.kvpool import InventoryBlock
from tessera.transport.arena import Arena
from tessera.transport.blocks import HEADER_BYTES, BlockHeader, BlockLayout


def scan(arena: Arena, layout: BlockLayout) -> list[InventoryBlock]:
    """Every slot whose header and payload verify, as an InventoryBlock."""
    token_bytes = layout.geometry.token_bytes
    out: list[InventoryBlock] = []
    for slot in range(arena.capacity):
        view = arena.slot(slot)
        try:
            h = BlockHeader.unpack(view[:HEADER_BYTES])
        except ChecksumMismatch:
            continue  # empty, torn or overwritten
        end = HEADER_BYTES + h.payload_len
        if h.tokens <= 0 or h.payload_len != h.tokens * token_bytes or end > len(view):
            continue
        if zlib.crc32(view[HEADER_BYTES:end]) != h.payload_crc:
            continue
        out.append(InventoryBlock(slot, h.unit_key.hex(), h.epoch, h.block_index, h.tokens, h.unit_tokens))
    return out
