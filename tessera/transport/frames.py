"""Frames of the ``tcp`` block protocol (little-endian, fixed-size headers).

On connect the memory node sends HELLO (magic, boot id, slot size, capacity), so a client
never talks to an incarnation it did not expect. Then the client pipelines requests and the
node answers each one, in order:

    REQUEST  = op u8 | 0 u8 | 0 u16 | req_id u32 | n_blocks u32 | 0 u32 | payload_bytes u64
               n_blocks x (slot u32 | length u32)
               payload (WRITE only: the blocks' bytes back to back)
    RESPONSE = status u8 | 0 u8 | 0 u16 | req_id u32 | body_bytes u64
               body: READ ok -> the blocks' bytes back to back; ERROR -> utf-8 reason

A request that breaks the protocol or names a slot outside the arena is answered with
ERROR, and the node then closes the connection (it cannot trust the rest of the stream).
"""

from __future__ import annotations

import enum
import struct

HELLO = struct.Struct("<8s32sQQ")
HELLO_MAGIC = b"TKVTCP01"
REQUEST = struct.Struct("<BBHIIIQ")
BLOCK = struct.Struct("<II")
RESPONSE = struct.Struct("<BBHIQ")
MAX_BLOCKS = 1 << 16
MAX_ERROR_BYTES = 1 << 12


class Op(enum.IntEnum):
    READ = 1
    WRITE = 2


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1


def pack_request(op: Op, req_id: int, blocks: list[tuple[int, int]]) -> bytes:
    payload = sum(n for _, n in blocks) if op is Op.WRITE else 0
    out = bytearray(REQUEST.size + BLOCK.size * len(blocks))
    REQUEST.pack_into(out, 0, op, 0, 0, req_id, len(blocks), 0, payload)
    for i, (slot, length) in enumerate(blocks):
        BLOCK.pack_into(out, REQUEST.size + i * BLOCK.size, slot, length)
    return bytes(out)


def unpack_blocks(raw: memoryview, n: int) -> list[tuple[int, int]]:
    return [BLOCK.unpack_from(raw, i * BLOCK.size) for i in range(n)]
