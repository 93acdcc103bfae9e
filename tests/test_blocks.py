"""Storage blocks: layout, headers, and unit states encoded into blocks and decoded with verification."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from helpers.kvpool import BLOCK_TOKENS, TINY_GEOMETRY, random_state, tiny_layout

from tessera.auth import block_mac_key
from tessera.engines.base import DTYPES
from tessera.engines.geometry import KV_ITEMSIZE
from tessera.errors import ChecksumMismatch
from tessera.transport.blocks import HEADER_BYTES, BlockHeader, BlockLayout, unit_key
from tessera.transport.unit_blocks import decode_unit, encode_unit

UNIT = "unit-a"


def assert_same_state(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a, b)


def test_slot_holds_a_header_and_b_tokens_of_k_and_v_for_all_layers() -> None:
    """slot = 64-byte header + B * (2 * L * H_kv * D * itemsize), rounded up to 64 bytes."""
    layout = tiny_layout()
    assert layout.payload_bytes == BLOCK_TOKENS * 2 * 2 * 2 * 8 * 2
    assert layout.slot_bytes == HEADER_BYTES + layout.payload_bytes
    odd = BlockLayout(TINY_GEOMETRY, 3)
    assert odd.slot_bytes % 64 == 0 and odd.slot_bytes >= HEADER_BYTES + odd.payload_bytes


def test_the_slot_sizes_a_memory_node_computes_without_torch_match_torchs_dtypes() -> None:
    """KV_ITEMSIZE (read by memory nodes, which never load torch) agrees with DTYPES' element sizes."""
    assert {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()} == KV_ITEMSIZE


@pytest.mark.parametrize("n_tokens", [1, 3, 4, 5, 8, 13])
def test_a_unit_round_trips_through_its_blocks(n_tokens: int) -> None:
    """encode then decode returns the same keys and values, including a partial last block."""
    layout = tiny_layout()
    state = random_state(n_tokens)
    blocks = encode_unit(layout, state, UNIT, epoch=7)
    assert len(blocks) == -(-n_tokens // BLOCK_TOKENS)
    assert [len(b) for b in blocks] == [layout.used_bytes(i, n_tokens) for i in range(len(blocks))]
    out = decode_unit(layout, blocks, UNIT, 7, n_tokens)
    assert_same_state(out.keys, state.keys)
    assert_same_state(out.values, state.values)


def test_block_payload_is_k_then_v_of_its_token_range() -> None:
    """Block b stores K[:, bB:(b+1)B] then V[:, bB:(b+1)B], each [L, t, H_kv, D] contiguous."""
    layout = tiny_layout()
    state = random_state(6)
    block = encode_unit(layout, state, UNIT, epoch=1)[1]  # tokens 4..5
    payload = bytes(block[HEADER_BYTES:])
    k = state.keys[:, 4:6].contiguous().numpy().tobytes()
    v = state.values[:, 4:6].contiguous().numpy().tobytes()
    assert payload == k + v


def test_header_names_unit_epoch_index_and_token_counts() -> None:
    """The header carries what a reader checks against its lease."""
    layout = tiny_layout()
    blocks = encode_unit(layout, random_state(6), UNIT, epoch=42)
    h = BlockHeader.unpack(blocks[1])
    assert (h.epoch, h.unit_key, h.block_index, h.tokens, h.unit_tokens) == (42, unit_key(UNIT), 1, 2, 6)
    assert h.payload_len == 2 * TINY_GEOMETRY.token_bytes


@pytest.mark.parametrize("signed", [False, True], ids=["crc", "mac"])
@pytest.mark.parametrize("offset", [0, 9, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 100, -1])
def test_a_flipped_byte_anywhere_in_a_block_is_detected(offset: int, signed: bool) -> None:
    """Header or payload corruption fails verification with ChecksumMismatch: by the payload's
    CRC-32 without a cluster secret, by the MAC alone with one (the reader skips the CRC there)."""
    layout = tiny_layout()
    if signed:
        layout = dataclasses.replace(layout, mac_key=block_mac_key(b"s" * 32))
    blocks = encode_unit(layout, random_state(8), UNIT, epoch=3)
    blocks[1][offset] ^= 0x40
    with pytest.raises(ChecksumMismatch):
        decode_unit(layout, blocks, UNIT, 3, 8)


def test_a_signed_blocks_payload_corruption_is_the_macs_to_find() -> None:
    """With a secret the reader verifies the MAC, not the CRC: a payload flip reads as a MAC mismatch,
    and the writer still fills the CRC a restarted memory node checks its blocks with."""
    layout = dataclasses.replace(tiny_layout(), mac_key=block_mac_key(b"s" * 32))
    blocks = encode_unit(layout, random_state(8), UNIT, epoch=3)
    h = BlockHeader.unpack(blocks[1])
    assert h.payload_crc == zlib.crc32(blocks[1][HEADER_BYTES:HEADER_BYTES + h.payload_len])
    blocks[1][HEADER_BYTES + 5] ^= 0x01
    with pytest.raises(ChecksumMismatch, match="MAC mismatch"):
        decode_unit(layout, blocks, UNIT, 3, 8)
    unsigned = tiny_layout()
    plain = encode_unit(unsigned, random_state(8), UNIT, epoch=3)
    plain[1][HEADER_BYTES + 5] ^= 0x01
    with pytest.raises(ChecksumMismatch, match="crc32"):
        decode_unit(unsigned, plain, UNIT, 3, 8)


@pytest.mark.parametrize(
    ("unit", "epoch", "n_tokens", "what"),
    [("unit-b", 3, 8, "another unit"), (UNIT, 4, 8, "another epoch"), (UNIT, 3, 7, "another length")],
)
def test_a_block_of_another_unit_epoch_or_length_is_rejected(unit: str, epoch: int, n_tokens: int, what: str) -> None:
    """Intact blocks that the lease does not describe are not accepted (stale or foreign writer)."""
    layout = tiny_layout()
    blocks = encode_unit(layout, random_state(8), UNIT, epoch=3)
    if n_tokens != 8:
        blocks = [blocks[0], blocks[1][: layout.used_bytes(1, n_tokens)]]
    with pytest.raises(ChecksumMismatch):
        decode_unit(layout, blocks, unit, epoch, n_tokens)


def test_blocks_in_the_wrong_order_are_rejected() -> None:
    """Swapped slots (a misdirected write) fail on the block index."""
    layout = tiny_layout()
    blocks = encode_unit(layout, random_state(8), UNIT, epoch=3)
    with pytest.raises(ChecksumMismatch, match="block 0"):
        decode_unit(layout, [blocks[1], blocks[0]], UNIT, 3, 8)


def test_an_empty_slot_is_not_a_block() -> None:
    """A zeroed slot (fresh or restarted arena) has no header."""
    layout = tiny_layout()
    with pytest.raises(ChecksumMismatch, match="no block header"):
        decode_unit(layout, [memoryview(bytearray(layout.slot_bytes))], UNIT, 1, 4)
