"""Context units and their identity.

A context unit is an independently retrieved text segment (a document chunk or a memory
record) inside a sharing scope of one tenant. Its identity is a stable digest of (tenant,
scope, token ids, serving fingerprint): the tenant is part of every key derived from it, so
no tenant can hit or probe another tenant's units. It never depends on the unit's position or neighbours: there is no
prefix chaining, which is the whole point (paper §5.1).

This module knows nothing about tensors, caches or where a unit's state lives.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# Bumped when the layout of the reusable form changes; part of every fingerprint.
KV_LAYOUT = "prerope-k+v/[L,T,Hkv,D]/v1"


def blocks_for(n_tokens: int, block_tokens: int) -> int:
    """Blocks of B tokens a unit of n tokens occupies: ceil(n / B)."""
    assert n_tokens >= 0 and block_tokens > 0, (n_tokens, block_tokens)
    return -(-n_tokens // block_tokens)


@dataclass(frozen=True, slots=True)
class ServingFingerprint:
    """Everything that changes a unit's reusable KV state.

    Two deployments share unit states only if their fingerprints are equal.
    """

    model: str  # model identity (name + weights digest)
    tokenizer: str  # tokenizer identity (vocabulary digest)
    kv_dtype: str  # storage dtype of the reusable form
    kv_layout: str = KV_LAYOUT
    unit_bos: bool = False  # composition-policy choice: unit prefilled behind BOS

    @property
    def digest(self) -> bytes:
        text = "\x1f".join((self.model, self.tokenizer, self.kv_dtype, self.kv_layout, str(int(self.unit_bos))))
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


UNIT_ID_PATTERN = "[0-9a-f]{32}"  # what unit_id_for returns: a unit id in a URL path matches this


def in_scopes(scope: str, patterns: Iterable[str]) -> bool:
    """Whether ``scope`` is one of ``patterns``: exact scope names, or prefixes ending in ``*``
    (``"*"``: every scope), as tenants and ``retrieval.order_free_scopes`` write them."""
    return any(scope == p or (p.endswith("*") and scope.startswith(p[:-1])) for p in patterns)


def unit_id_for(scope: str, token_ids: Sequence[int], fingerprint: ServingFingerprint, tenant: str = "") -> str:
    """Stable identity of a unit: blake2b-128 over (tenant, scope, token ids, fingerprint), hex.

    The open tenant ``""`` (no API keys) hashes as before tenants existed.
    """
    h = hashlib.blake2b(digest_size=16)
    if tenant:
        tenant_bytes = tenant.encode()
        h.update(b"tenant" + struct.pack("<I", len(tenant_bytes)) + tenant_bytes)
    scope_bytes = scope.encode()
    h.update(struct.pack("<I", len(scope_bytes)))
    h.update(scope_bytes)
    h.update(fingerprint.digest)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.hexdigest()


def unit_key(unit_id: str) -> bytes:
    """16-byte digest of a unit id: what storage block headers carry to name their unit."""
    return hashlib.blake2b(unit_id.encode(), digest_size=16).digest()


def unit_key_hex(unit_id: str) -> str:
    return unit_key(unit_id).hex()


@dataclass(frozen=True, slots=True)
class ContextUnit:
    """A retrieved (or caller-supplied) unit, tokenized and identified."""

    unit_id: str
    scope: str
    text: str
    token_ids: tuple[int, ...]
    tenant: str = ""

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def _entry_bytes(text: str, ids: tuple[int, ...]) -> int:
    """Approximate memory of one cache entry: the text, the tuple and its int objects."""
    return 100 + len(text) + 36 * len(ids)


class TokenCache:
    """LRU cache of unit text -> token ids, so recurring units are tokenized once.

    Bounded in entries and in (approximate) bytes: a text larger than an eighth of the byte
    budget is tokenized but not kept, so one huge text cannot take the cache.
    """

    def __init__(self, encode: Callable[[str], list[int]], capacity: int = 65536,
                 capacity_bytes: int = 256 << 20) -> None:
        assert capacity > 0 and capacity_bytes > 0, (capacity, capacity_bytes)
        self._encode = encode
        self._capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def tokens(self, text: str) -> tuple[int, ...]:
        found = self._entries.get(text)
        if found is not None:
            self._entries.move_to_end(text)
            self.hits += 1
            return found
        self.misses += 1
        ids = tuple(self._encode(text))
        size = _entry_bytes(text, ids)
        if size > self.capacity_bytes // 8:
            return ids
        self._entries[text] = ids
        self.nbytes += size
        while len(self._entries) > self._capacity or self.nbytes > self.capacity_bytes:
            old_text, old_ids = self._entries.popitem(last=False)
            self.nbytes -= _entry_bytes(old_text, old_ids)
        return ids


class UnitFactory:
    """Turns (scope, text) into identified :class:`ContextUnit` values for one serving fingerprint.

    ``lead`` token ids start every unit (e.g. ``<|endoftext|>`` as an attention sink, the way
    EPIC's chunks start with BOS). They are part of the unit's token ids, hence of its
    identity and of the prompt.
    """

    def __init__(self, fingerprint: ServingFingerprint, tokens: TokenCache, lead: tuple[int, ...] = ()) -> None:
        self.fingerprint = fingerprint
        self.tokens = tokens
        self.lead = lead

    def make(self, scope: str, text: str, tenant: str = "") -> ContextUnit:
        ids = self.lead + self.tokens.tokens(text)
        return ContextUnit(unit_id_for(scope, ids, self.fingerprint, tenant), scope, text, ids, tenant)
