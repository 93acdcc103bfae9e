"""Storage blocks of a unit state: slot layout, block header, encode and verified decode.

A unit of T tokens occupies ceil(T / B) blocks. Block b holds tokens [b·B, min((b+1)·B, T)):

    slot = | header (64 B) | K[:, s:e] as [L, t, H_kv, D] | V[:, s:e] as [L, t, H_kv, D] | unused |

in the storage dtype, C-contiguous. The header is written together with the payload and
names what the payload is (unit, storage epoch, block index, token counts) plus a CRC-32 of
the payload and of the header itself. With a cluster secret the header also carries a keyed
MAC (HMAC-SHA256 over the header fields and the payload, truncated to 64 bits, in the
header's padding): a CRC catches accidents, only the MAC catches a forged block. A reader checks every
field against what its lease
says and treats any difference as a failed fetch (:class:`ChecksumMismatch`): a torn write,
a stale writer, a restarted memory node and a flipped bit all look the same to it.

This module knows nothing about where slots live or how bytes move (see the transports), nor
about tensors: it imports no torch, so a memory node (which only scans and serves slots) never
loads it. Turning a unit state into blocks and back is :mod:`tessera.transport.unit_blocks`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct
import zlib
from dataclasses import dataclass

from tessera.engines.geometry import ModelGeometry
from tessera.errors import ChecksumMismatch
from tessera.units import blocks_for, unit_key

MAGIC = b"TKVB"
HEADER_VERSION = 1
HEADER_BYTES = 64
SLOT_ALIGN = 64
# magic, version, reserved, epoch, unit key, block index, tokens in block, unit tokens,
# payload length, payload crc32 | header crc32 (over all other header bytes, padding included)
_FIELDS = struct.Struct("<4sHHQ16sIIIII")
_CRC = struct.Struct("<I")
_PAD = _FIELDS.size + _CRC.size
MAC_BYTES = 8  # the header's padding; a forgery succeeds with probability 2^-64 per try
assert _PAD + MAC_BYTES <= HEADER_BYTES


def _header_crc(buf: memoryview) -> int:
    return zlib.crc32(buf[_PAD:HEADER_BYTES], zlib.crc32(buf[: _FIELDS.size]))


@dataclass(frozen=True, slots=True)
class BlockHeader:
    epoch: int
    unit_key: bytes
    block_index: int
    tokens: int  # tokens stored in this block (B, or fewer in a unit's last block)
    unit_tokens: int  # T of the whole unit
    payload_len: int
    payload_crc: int
    mac: bytes = bytes(MAC_BYTES)  # zeros without a cluster secret

    def fields(self) -> bytes:
        return _FIELDS.pack(MAGIC, HEADER_VERSION, 0, self.epoch, self.unit_key, self.block_index,
                            self.tokens, self.unit_tokens, self.payload_len, self.payload_crc)

    def pack_into(self, buf: memoryview) -> None:
        buf[: _FIELDS.size] = self.fields()
        buf[_PAD:HEADER_BYTES] = self.mac.ljust(HEADER_BYTES - _PAD, b"\0")
        _CRC.pack_into(buf, _FIELDS.size, _header_crc(buf))

    @classmethod
    def unpack(cls, buf: memoryview) -> BlockHeader:
        """Parse and self-check a header; raises ChecksumMismatch if it is not a valid header."""
        if len(buf) < HEADER_BYTES:
            raise ChecksumMismatch(f"block of {len(buf)} bytes is shorter than its {HEADER_BYTES}-byte header")
        magic, version, _, epoch, key, index, tokens, unit_tokens, plen, pcrc = _FIELDS.unpack_from(buf, 0)
        if magic != MAGIC:
            raise ChecksumMismatch(f"slot holds no block header (magic {magic!r}); empty or overwritten slot")
        (stored,) = _CRC.unpack_from(buf, _FIELDS.size)
        computed = _header_crc(buf)
        if stored != computed:
            raise ChecksumMismatch(f"block header checksum {stored:#010x} != computed {computed:#010x}")
        if version != HEADER_VERSION:
            raise ChecksumMismatch(f"block header version {version}, this reader speaks {HEADER_VERSION}")
        return cls(epoch, key, index, tokens, unit_tokens, plen, pcrc, bytes(buf[_PAD : _PAD + MAC_BYTES]))


def block_mac(key: bytes, header: BlockHeader, payload: memoryview) -> bytes:
    mac = hmac.new(key, header.fields(), hashlib.sha256)
    mac.update(payload)
    return mac.digest()[:MAC_BYTES]


@dataclass(frozen=True)
class BlockLayout:
    """Where a unit's tokens go in slots of B tokens, for one model geometry and kv dtype."""

    geometry: ModelGeometry
    block_tokens: int
    # MAC key (tessera.auth.block_mac_key of the cluster secret): writers sign, readers verify
    mac_key: bytes | None = None

    @property
    def payload_bytes(self) -> int:
        return self.geometry.block_payload_bytes(self.block_tokens)

    @property
    def slot_bytes(self) -> int:
        raw = HEADER_BYTES + self.payload_bytes
        return -(-raw // SLOT_ALIGN) * SLOT_ALIGN

    def n_blocks(self, n_tokens: int) -> int:
        return blocks_for(n_tokens, self.block_tokens)

    def token_range(self, block_index: int, n_tokens: int) -> tuple[int, int]:
        start = block_index * self.block_tokens
        assert 0 <= start < n_tokens, (block_index, n_tokens)
        return start, min(start + self.block_tokens, n_tokens)

    def used_bytes(self, block_index: int, n_tokens: int) -> int:
        """Bytes of the slot a block actually uses: header + its tokens' K and V."""
        start, end = self.token_range(block_index, n_tokens)
        return HEADER_BYTES + (end - start) * self.geometry.token_bytes

    def seal(self, out: memoryview, unit_id: str, epoch: int, block_index: int, n_tokens: int) -> None:
        """Write the header of block ``block_index`` of a unit of ``n_tokens`` tokens, whose payload
        ``out`` already holds after the header: what it is, its CRC-32s and (with a secret) its MAC."""
        start, end = self.token_range(block_index, n_tokens)
        payload = out[HEADER_BYTES : self.used_bytes(block_index, n_tokens)]
        header = BlockHeader(epoch, unit_key(unit_id), block_index, end - start, n_tokens, len(payload),
                             zlib.crc32(payload))
        if self.mac_key is not None:
            header = dataclasses.replace(header, mac=block_mac(self.mac_key, header, payload))
        header.pack_into(out[:HEADER_BYTES])

    def verify(self, buf: memoryview, unit_id: str, epoch: int, block_index: int, n_tokens: int) -> memoryview:
        """Check a fetched block against the lease; return its payload or raise ChecksumMismatch."""
        h = BlockHeader.unpack(buf)
        start, end = self.token_range(block_index, n_tokens)
        expected = (epoch, unit_key(unit_id), block_index, end - start, n_tokens)
        found = (h.epoch, h.unit_key, h.block_index, h.tokens, h.unit_tokens)
        if found != expected:
            raise ChecksumMismatch(
                f"unit {unit_id} block {block_index}: header says (epoch {h.epoch}, block {h.block_index}, "
                f"{h.tokens}/{h.unit_tokens} tokens, unit match {h.unit_key == expected[1]}), "
                f"lease expects (epoch {epoch}, block {block_index}, {end - start}/{n_tokens} tokens)"
            )
        want_len = (end - start) * self.geometry.token_bytes
        if h.payload_len != want_len or len(buf) < HEADER_BYTES + want_len:
            raise ChecksumMismatch(
                f"unit {unit_id} block {block_index}: payload length {h.payload_len} (buffer {len(buf)}), "
                f"expected {want_len}"
            )
        payload = buf[HEADER_BYTES : HEADER_BYTES + want_len]
        if self.mac_key is not None:
            # the MAC covers the payload and every header field (its CRC-32 too), so it already
            # catches any corruption the CRC would; checking both cost a reader 16% of a fetch.
            # Writers still fill the CRC: a restarted memory node checks its blocks with it alone.
            if not hmac.compare_digest(block_mac(self.mac_key, h, payload), h.mac):
                raise ChecksumMismatch(f"unit {unit_id} block {block_index}: MAC mismatch (corrupt, or not "
                                       "written by a holder of the cluster secret)")
            return payload
        crc = zlib.crc32(payload)
        if crc != h.payload_crc:
            raise ChecksumMismatch(
                f"unit {unit_id} block {block_index}: payload crc32 {crc:#010x} != header {h.payload_crc:#010x}"
            )
        return payload
