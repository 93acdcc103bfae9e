"""Frames of the ``tcp`` block protocol (little-endian, fixed-size headers).

On connect the memory node sends HELLO (magic, boot id, slot size, capacity, nonce), so a
client never talks to an incarnation it did not expect; the client answers the nonce with
AUTH and the node acknowledges it with RESPONSE req_id 0 (:mod:`.handshake`: who the
connection speaks for). Then the client pipelines requests and the node answers each one,
in order:

    REQUEST  = op u8 | flags u8 | 0 u16 | req_id u32 | n_blocks u32 | 0 u32 | payload_bytes u64
               n_blocks x (slot u32 | length u32)
               flags & CAPABILITY: epoch u64 | expires u64 | n_slots u32 | mac 32B, n_slots x slot u32
               payload (WRITE only: the blocks' bytes back to back)
    RESPONSE = status u8 | 0 u8 | 0 u16 | req_id u32 | body_bytes u64
               body: READ ok -> the blocks' bytes back to back; ERROR -> utf-8 reason

A request that breaks the protocol or names a slot outside the arena is answered with
ERROR, and the node then closes the connection (it cannot trust the rest of the stream).

When the cluster has a secret, every request carries a *capability*: the write grant's or
read lease's token for this node (:func:`tessera.auth.capability`, an HMAC over op, node,
holder, slots, epoch and expiry). The node refuses a request whose token is missing, forged,
expired, issued to another node than the one the connection authenticated as, or does not
cover every slot it names.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

HELLO = struct.Struct("<8s32sQQ32s")
HELLO_MAGIC = b"TKVTCP02"
REQUEST = struct.Struct("<BBHIIIQ")
BLOCK = struct.Struct("<II")
RESPONSE = struct.Struct("<BBHIQ")
CAP = struct.Struct("<QQI32s")
SLOT = struct.Struct("<I")
FLAG_CAPABILITY = 1
MAX_BLOCKS = 1 << 16
MAX_ERROR_BYTES = 1 << 12


class Op(enum.IntEnum):
    READ = 1
    WRITE = 2


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1


@dataclass(frozen=True, slots=True)
class Capability:
    """A token for ``slots`` of one memory node under one epoch, valid until ``expires`` (unix s)."""

    epoch: int
    expires: int
    slots: tuple[int, ...]
    mac: bytes  # tessera.auth.capability(secret, op, node, holder, slots, epoch, expires)
    holder: str = ""  # the generation node it was issued to (not sent: the connection says who it is)


def pack_request(op: Op, req_id: int, blocks: list[tuple[int, int]], cap: Capability | None = None) -> bytes:
    payload = sum(n for _, n in blocks) if op is Op.WRITE else 0
    cap_bytes = 0 if cap is None else CAP.size + SLOT.size * len(cap.slots)
    out = bytearray(REQUEST.size + BLOCK.size * len(blocks) + cap_bytes)
    REQUEST.pack_into(out, 0, op, 0 if cap is None else FLAG_CAPABILITY, 0, req_id, len(blocks), 0, payload)
    for i, (slot, length) in enumerate(blocks):
        BLOCK.pack_into(out, REQUEST.size + i * BLOCK.size, slot, length)
    if cap is not None:
        at = REQUEST.size + BLOCK.size * len(blocks)
        CAP.pack_into(out, at, cap.epoch, cap.expires, len(cap.slots), cap.mac)
        for i, slot in enumerate(cap.slots):
            SLOT.pack_into(out, at + CAP.size + i * SLOT.size, slot)
    return bytes(out)


def unpack_blocks(raw: memoryview, n: int) -> list[tuple[int, int]]:
    return [BLOCK.unpack_from(raw, i * BLOCK.size) for i in range(n)]
