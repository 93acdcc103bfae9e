"""The paged engine (``model.engine = "paged"``): the reference model over a preallocated paged KV pool.

Same model, same contract as :mod:`tessera.engines.reference`, shaped for a GPU:

* every request's post-RoPE KV lives in one :class:`PagedKVPool` allocated at start-up (a
  block table per request, no per-request tensors, no allocator churn);
* one batched forward per step: projections and MLP over all tokens of the ragged batch, the
  K/V of every slotted token scattered into the pool with one ``index_copy_`` per layer;
* attention by kind of item, each with SDPA:
  - unit prefills (positions 0..n-1, own tokens only): causal SDPA over their own K/V;
  - extends of several tokens: the request's visible slots gathered through its block table,
    SDPA with the position-derived mask (key visible iff its position <= the query's), or
    ``is_causal`` when the positions are 0..n-1 (the flash kernel on CUDA);
  - decodes (one token each): ONE SDPA over all of them, keys gathered into ``[B, K_max]``
    with a key-padding mask (optionally replayed from a CUDA graph, ``model.cuda_graphs``);
* placement with the Triton RoPE kernel on CUDA (:func:`rope_place` with the pages' slots);
* compute in ``model.dtype`` (bfloat16 on GPUs).

Why SDPA per item rather than one SDPA over the packed batch or FlexAttention: a packed
batch needs a dense ``[N, N]`` mask that also rules out the flash kernel; FlexAttention's
block mask avoids that but needs ``torch.compile`` per shape class (and falls back unfused on
CPU). Per-item SDPA keeps the flash path for causal prefills and costs one launch per prefill
item; decodes, where per-item launches would dominate, are batched into one call
(bench/attention.py compares the three).

The exact-prefix cache is the reference engine's radix cache of KV copies (not page sharing).
This module knows nothing about plans, transports or which units are cached where.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessera.config import ClusterConfig
from tessera.engines.attention import decode_attention, sdpa
from tessera.engines.base import (
    DTYPES,
    ENGINES,
    EngineAdapter,
    Extend,
    KVSlots,
    UnitPrefill,
    UnitState,
)
from tessera.engines.decode_graphs import DecodeGraphs
from tessera.engines.device import placement
from tessera.engines.geometry import ModelGeometry
from tessera.engines.kv_pages import PagedKVPool, PagedSlots
from tessera.engines.model import Model
from tessera.engines.prefix_cache import PrefixCache
from tessera.engines.reference import DEFAULT_PREFIX_CACHE_TOKENS, load_model
from tessera.engines.tokenizer import Tokenized, Tokenizer
from tessera.errors import BadRequest, ConfigError
from tessera.kernels.rope import rope_place
from tessera.units import ServingFingerprint

CUDA_POOL_FRACTION = 0.9  # of the free device memory after the weights, when kv_pool_tokens = 0


@dataclass
class _Fresh:
    """A unit prefill: rows ``start..end`` attend causally to each other only."""

    start: int
    end: int
    capture: tuple[torch.Tensor, torch.Tensor]  # [L, T, H_kv, D] pre-RoPE K and V
    capture_from: int


@dataclass
class _Slotted:
    """An extend of several tokens: rows ``start..end`` attend to the request's slots ``keys``."""

    start: int
    end: int
    keys: torch.Tensor  # [n_keys] physical slots of positions 0..n_keys-1
    causal: bool  # the rows are positions 0..n-1 (SDPA's is_causal)
    mask: torch.Tensor | None  # [n, n_keys] bool, True = visible


@dataclass
class _Decodes:
    """Single-token extends, attended together: row b sees gather[b, :n_keys_b]."""

    rows: torch.Tensor  # [B] batch rows
    gather: torch.Tensor  # [B, K_max] physical slots, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, K_max] bool


@dataclass
class _Batch:
    ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    write_rows: torch.Tensor  # [W] rows whose K/V go to the pool ...
    write_slots: torch.Tensor  # [W] ... at these physical slots
    fresh: list[_Fresh]
    slotted: list[_Slotted]
    decodes: _Decodes | None
    logit_rows: list[int]  # one per extend, in work order
    extends: list[Extend]
    top: int  # highest position in the batch


@ENGINES.register("paged")
class PagedEngine(Tokenized, EngineAdapter):
    probes_model = True  # first_layer_attention, second_layer_deviation: the model's own

    def __init__(self, model: Model, tokenizer: Tokenizer, fingerprint: ServingFingerprint, *,
                 kv_dtype: str = "float16", unit_bos: bool = False, pool_tokens: int = 0, page_tokens: int = 16,
                 prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS, cuda_graphs: bool = False) -> None:
        s = model.spec
        self.model = model
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.kv_dtype = DTYPES[kv_dtype]
        self.geometry = ModelGeometry(s.n_layers, s.n_kv_heads, s.head_dim, s.vocab_size,
                                      model.max_positions, kv_dtype)
        if unit_bos and tokenizer.bos_token_id is None:
            raise ConfigError("composition.unit_bos = true needs a tokenizer with a BOS token; this one has none")
        self.bos: int | None = tokenizer.bos_token_id if unit_bos else None
        self.pool = PagedKVPool.sized(s.n_layers, s.n_kv_heads, s.head_dim,
                                      tokens=pool_tokens or self._default_pool_tokens(),
                                      page_tokens=page_tokens, dtype=model.dtype, device=model.device)
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            if model.device.type != "cuda":
                raise ConfigError("model.cuda_graphs = true needs model.device = \"cuda\"; "
                                  "CUDA graphs do not exist on CPU")
            self.graphs = DecodeGraphs(model, self.pool)

    @classmethod
    def from_config(cls, cfg: ClusterConfig,
                    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS) -> PagedEngine:
        model, tokenizer, fingerprint = load_model(cfg)
        m = cfg.model
        return cls(model, tokenizer, fingerprint, kv_dtype=cfg.kv_dtype, unit_bos=cfg.composition.unit_bos,
                   pool_tokens=m.kv_pool_tokens, page_tokens=m.page_tokens,
                   prefix_cache_tokens=prefix_cache_tokens, cuda_graphs=m.cuda_graphs)

    def _default_pool_tokens(self) -> int:
        g, m = self.geometry, self.model
        if m.device.type != "cuda":
            return 4 * m.max_positions
        free, _ = torch.cuda.mem_get_info(m.device)
        row = 2 * g.n_layers * g.n_kv_heads * g.head_dim * torch.empty((), dtype=m.dtype).element_size()
        return int(free * CUDA_POOL_FRACTION) // row

    # --- slots ----------------------------------------------------------------------------

    def first_layer_attention(self, token_ids: Sequence[int], query_from: int) -> list[float]:
        return self.model.first_layer_attention(token_ids, query_from)

    def second_layer_deviation(self, token_ids: Sequence[int], units: Sequence[tuple[int, int]]) -> list[float]:
        return self.model.second_layer_deviation(token_ids, units, self.bos)

    def allocate(self, n_slots: int) -> PagedSlots:
        if not 0 < n_slots <= self.geometry.max_context:
            raise BadRequest(f"a request needs {n_slots} positions; this model serves 1..{self.geometry.max_context}")
        return self.pool.allocate(n_slots)

    def free(self, slots: KVSlots) -> None:
        self.pool.free(_paged(slots))

    def place(self, slots: KVSlots, offset: int, state: UnitState) -> None:
        s = _paged(slots)
        checked = placement(state, offset, s.n_slots, self.geometry, self.kv_dtype, self.pool.device)
        if checked is None:
            return
        state, n = checked, checked.n_tokens
        rope = self.model.rope
        rope.ensure(offset + n)
        positions = torch.arange(offset, offset + n, device=self.pool.device)
        where = s.slot_of[offset:offset + n]
        rope_place(state.keys, positions, rope.cos, rope.sin, self.pool.keys, slots=where)
        self.pool.values.index_copy_(1, where, state.values.to(self.pool.values.dtype))

    # --- forward --------------------------------------------------------------------------

    def step(self, work: Sequence[UnitPrefill | Extend]) -> None:
        # a batch of decodes only (the scheduler's steady state) replays a captured graph
        if self.graphs is not None and self.graphs.run(work):
            return
        batch = self._batch(work)
        if batch is None:
            return
        logits = self._forward(batch)
        for ext, row in zip(batch.extends, logits, strict=True):
            ext.logits = row

    def _batch(self, work: Sequence[UnitPrefill | Extend]) -> _Batch | None:
        g, dev = self.geometry, self.model.device
        ids: list[int] = []
        positions: list[int] = []
        write_rows: list[int] = []
        write_slots: list[torch.Tensor] = []
        fresh: list[_Fresh] = []
        slotted: list[_Slotted] = []
        dec_rows: list[int] = []
        dec_keys: list[torch.Tensor] = []
        logit_rows: list[int] = []
        extends: list[Extend] = []
        for w in work:
            row = len(ids)
            if isinstance(w, UnitPrefill):
                n = len(w.token_ids)
                shape = (g.n_layers, n, g.n_kv_heads, g.head_dim)
                w.state = UnitState(torch.empty(shape, dtype=self.kv_dtype, device=dev),
                                    torch.empty(shape, dtype=self.kv_dtype, device=dev))
                if n == 0:
                    continue
                lead = [] if self.bos is None else [self.bos]
                tokens = lead + list(w.token_ids)
                ids.extend(tokens)
                positions.extend(range(len(tokens)))
                fresh.append(_Fresh(row, row + len(tokens), (w.state.keys, w.state.values), len(lead)))
                continue
            s = _paged(w.slots)
            n = len(w.token_ids)
            if not n or n != len(w.positions):
                raise ValueError(f"an extend needs >= 1 token and one position per token; got "
                                 f"{n} tokens, {len(w.positions)} positions")
            pos = list(w.positions)
            top = max(pos)
            assert min(pos) >= 0, f"negative position in {pos[:8]}..."
            assert top < s.n_slots, f"position {top} is beyond the {s.n_slots} slots"
            where = torch.tensor(pos, device=dev)
            ids.extend(w.token_ids)
            positions.extend(pos)
            write_rows.extend(range(row, row + n))
            write_slots.append(s.slot_of[where])
            logit_rows.append(row + pos.index(top))
            extends.append(w)
            if n == 1:
                dec_rows.append(row)
                dec_keys.append(s.slot_of[:top + 1])
            else:
                causal = pos == list(range(n))
                mask = None if causal else torch.arange(top + 1, device=dev)[None, :] <= where[:, None]
                slotted.append(_Slotted(row, row + n, s.slot_of[:top + 1], causal, mask))
        if not ids:
            return None
        return _Batch(
            ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            write_rows=torch.tensor(write_rows, dtype=torch.int64, device=dev),
            write_slots=torch.cat(write_slots) if write_slots else torch.empty(0, dtype=torch.int64, device=dev),
            fresh=fresh, slotted=slotted, decodes=_decodes(dec_rows, dec_keys, dev),
            logit_rows=logit_rows, extends=extends, top=max(positions),
        )

    @torch.no_grad()
    def _forward(self, b: _Batch) -> torch.Tensor:
        m = self.model
        m.rope.ensure(b.top + 1)
        cos, sin = m.rope.lookup(b.positions)  # [N, 1, D]: shared by every layer
        x = F.embedding(b.ids, m.w.embed)
        for layer, lw in enumerate(m.w.layers):
            raw, qk, v = m.attention_inputs(lw, x, cos, sin)
            attn = self._attention(layer, raw, qk, v, b)
            x = m.attention_output(lw, x, attn)
        if not b.logit_rows:
            return torch.empty((0, self.geometry.vocab_size), dtype=torch.float32, device=m.device)
        return m.logits(x[b.logit_rows])

    def _attention(self, layer: int, raw: torch.Tensor, qk: torch.Tensor, v: torch.Tensor,
                   b: _Batch) -> torch.Tensor:
        h = self.model.spec.n_heads
        q, k = qk[:, :h], qk[:, h:]
        for f in b.fresh:  # the reusable form: keys before RoPE, values
            f.capture[0][layer].copy_(raw[f.start + f.capture_from:f.end, h:])
            f.capture[1][layer].copy_(v[f.start + f.capture_from:f.end])
        keys, values = self.pool.keys[layer], self.pool.values[layer]  # [S, H_kv, D]
        if b.write_rows.numel():
            keys.index_copy_(0, b.write_slots, k.index_select(0, b.write_rows))
            values.index_copy_(0, b.write_slots, v.index_select(0, b.write_rows))
        attn = torch.empty_like(q)  # [N, H, D]
        for f in b.fresh:
            attn[f.start:f.end] = sdpa(q[f.start:f.end], k[f.start:f.end], v[f.start:f.end], None, True)
        for e in b.slotted:
            attn[e.start:e.end] = sdpa(q[e.start:e.end], keys.index_select(0, e.keys),
                                       values.index_select(0, e.keys), e.mask, e.causal)
        if b.decodes is not None:
            attn[b.decodes.rows] = decode_attention(q.index_select(0, b.decodes.rows), keys, values,
                                                    b.decodes.gather, b.decodes.mask)
        return attn

    # --- exact prefix cache ---------------------------------------------------------------

    def match_prefix(self, slots: KVSlots, token_ids: Sequence[int], namespace: str = "") -> int:
        s = _paged(slots)
        hit = self.prefix_cache.match(token_ids[:s.n_slots], namespace)
        for start, keys, values in hit.chunks:
            self.pool.write(s, start, keys, values)
        return hit.length

    def insert_prefix(self, slots: KVSlots, token_ids: Sequence[int], namespace: str = "") -> None:
        s = _paged(slots)
        assert len(token_ids) <= s.n_slots, (len(token_ids), s.n_slots)
        self.prefix_cache.insert(token_ids, lambda a, b: self.pool.read(s, a, b), namespace)


def _decodes(rows: list[int], keys: list[torch.Tensor], device: torch.device) -> _Decodes | None:
    """Pad the decodes' slot lists to one ``[B, K_max]`` gather with a key-padding mask."""
    if not rows:
        return None
    longest = max(int(k.numel()) for k in keys)
    gather = torch.zeros((len(rows), longest), dtype=torch.int64, device=device)
    lengths = torch.tensor([int(k.numel()) for k in keys], device=device)
    for i, k in enumerate(keys):
        gather[i, :k.numel()] = k
    mask = torch.arange(longest, device=device)[None, :] < lengths[:, None]
    return _Decodes(torch.tensor(rows, dtype=torch.int64, device=device), gather, mask[:, None, None, :])


def _paged(slots: KVSlots) -> PagedSlots:
    assert isinstance(slots, PagedSlots), f"slots from another engine: {type(slots).__name__}"
    assert not slots.freed, "slots used after free()"
    return slots
