"""Attention for Tessera's batches on SGLang's KV pool: SGLang's kernels, or portable masked torch.

One forward carries two kinds of sequence (:class:`Seq`):

* ``unit``: a unit prefilled from position 0, attending causally to itself only. Nothing is
  written to the pool; its K/V are captured by the engine.
* ``tail``: a run of a request's tokens at consecutive positions ``a .. b-1``. A key is visible
  to a query iff its position is at most the query's, so the run sees positions ``0 .. a-1``
  from the pool and itself causally: exactly SGLang's extend (prefix ``a``) or, for one token,
  its decode.

A unit may be fed into a request of the same forward (``Seq.feeds``): at each layer, once the
unit's state for that layer is captured, its rows are rotated to the request's positions and
written to the request's locations (in ``kv_dtype``, exactly as a separate placement would),
before any request attends at that layer.

A request's extend at scattered positions (EPIC's recompute ranges and the suffix in one pass)
is one tail per maximal run of consecutive positions, all on the request's slots. Each layer
writes every computed token's K/V to the pool *before* any run attends, so a run sees the
tokens recomputed below it in the same forward, as position-causal visibility requires; the
runs of one request share its row of SGLang's request-to-token table.

With ``kernels`` off every sequence runs masked scaled-dot-product attention in portable
torch, on any device. Position ``p`` of a request lives in its KV location ``locs[p]``; the
engine keeps SGLang's request-to-token table equal to ``locs`` so the kernels read the same slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

SeqKind = Literal["unit", "tail"]


@dataclass
class Seq:
    """One sequence of a forward: rows ``start .. start+n`` of the packed batch."""

    kind: SeqKind
    start: int
    positions: list[int]
    req_idx: int = 0  # SGLang request row (its slots); 0 for a unit (no slots)
    locs: torch.Tensor | None = None  # the request's KV locations, position p at locs[p]
    # unit only: where the captured reusable form goes (keys before RoPE, values) and which
    # rows of the sequence are the unit's (a BOS lead is computed, not captured)
    capture: tuple[torch.Tensor, torch.Tensor] | None = None
    capture_from: int = 0
    # unit only, fed into a request of the same forward: (state rows start..end, at position p
    # of the request whose KV locations are ``feed_locs``)
    feeds: list[tuple[int, int, int]] = field(default_factory=list)
    feed_locs: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return len(self.positions)

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def span(self) -> int:
        """Slots a query of this sequence may see: positions ``0 .. max``."""
        return max(self.positions) + 1


@dataclass
class Batch:
    """Every sequence of one forward, and what the kernels need of them, computed once."""

    seqs: list[Seq]
    decode: bool = False  # every sequence is a one-token tail: SGLang's decode kernel
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    write_rows: torch.Tensor | None = None  # rows whose K/V go to the pool (None: every row)
    write_locs: torch.Tensor | None = None
    kernel_meta: dict[str, Any] = field(default_factory=dict)
    # every feed of the forward, placed together at each layer: (unit, state rows start..end),
    # and the positions and KV locations they go to, in that order
    feed_spans: list[tuple[Seq, int, int]] = field(default_factory=list)
    feed_positions: torch.Tensor | None = None
    feed_locs: torch.Tensor | None = None

    @property
    def n_rows(self) -> int:
        return sum(s.n for s in self.seqs)

def runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive positions, as ``(first index, end index)`` into ``positions``."""
    out: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            out.append((first, i))
            first = i
    return out


def prepare(batch: Batch, kernels: bool) -> None:
    """Fill the batch's row indices and kernel metadata (once per forward, not per layer)."""
    dev = batch.device
    positions: list[int] = []
    locs: list[torch.Tensor] = []
    for s in batch.seqs:
        for start, end, position in s.feeds:
            assert s.feed_locs is not None, "a fed unit needs its request's KV locations"
            batch.feed_spans.append((s, start, end))
            positions.extend(range(position, position + end - start))
            locs.append(s.feed_locs[position:position + end - start])
    if locs:
        batch.feed_positions = torch.tensor(positions, dtype=torch.int64, device=dev)
        batch.feed_locs = torch.cat(locs)
    writers = [s for s in batch.seqs if s.kind == "tail"]
    if writers:
        rows = [r for s in writers for r in range(s.start, s.end)]
        batch.write_locs = torch.cat([_locs(s)[s.positions[0]:s.positions[0] + s.n] for s in writers])
        batch.write_rows = None if len(rows) == batch.n_rows else torch.tensor(rows, device=dev)
    if not kernels or not batch.seqs:
        return
    ks = batch.seqs
    lens = [s.n for s in ks]
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    batch.kernel_meta = {
        "req_pool_indices": torch.tensor([s.req_idx for s in ks], dtype=torch.int64, device=dev),
        # a tail's sequence ends at its last position; a unit's at its length (no prefix)
        "seq_lens": torch.tensor([s.span for s in ks], dtype=torch.int64, device=dev),
        "extend_seq_lens": torch.tensor(lens, dtype=torch.int32, device=dev),
        "extend_start_loc": torch.tensor(starts, dtype=torch.int32, device=dev),
        "max_extend_len": max(lens),
    }


def _locs(seq: Seq) -> torch.Tensor:
    assert seq.locs is not None, f"a {seq.kind} sequence needs its request's KV locations"
    return seq.locs


class ComposeAttention:
    """The attention backend the engine publishes for its forwards (SGLang's ``ForwardContext``).

    It owns no state across forwards: :meth:`begin` hands it the batch, and each layer's
    :meth:`forward` writes the requests' K/V to the pool, captures the units' values, and
    computes every sequence's attention.
    """

    def __init__(self, token_to_kv_pool: Any, req_to_token_pool: Any, *, kernels: bool,
                 rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        # SGLang's layers find the pools through the published backend
        self.token_to_kv_pool = token_to_kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.kernels = kernels
        # keys before RoPE [L, n, H, D] and positions [n] -> rotated keys in the pool dtype
        self.rotate = rotate
        self.batch: Batch | None = None
        self._decode_logits: torch.Tensor | None = None

    def begin(self, batch: Batch) -> None:
        prepare(batch, self.kernels)
        self.batch = batch

    def end(self) -> None:
        self.batch = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                save_kv_cache: bool = True, **_: Any) -> torch.Tensor:
        batch = self.batch
        assert batch is not None, "ComposeAttention.forward outside a forward of the engine"
        lid = int(layer.layer_id)
        hq, hk, d = int(layer.tp_q_head_num), int(layer.tp_k_head_num), int(layer.qk_head_dim)
        k = k.view(-1, hk, d)
        v = v.view(-1, hk, d)
        for s in batch.seqs:
            if s.capture is not None:
                s.capture[1][lid].copy_(v[s.start + s.capture_from:s.end])
        if batch.feed_spans:
            self._feed(batch, layer, lid)
        o = torch.empty_like(q.view(-1, hq, d))
        if batch.decode and self.kernels:
            self._decode(q.view(-1, hq, d), k, v, o, layer, batch)
            return o.view(-1, hq * d)
        if batch.write_locs is not None:
            rows = batch.write_rows
            self.token_to_kv_pool.set_kv_buffer(layer, batch.write_locs, k if rows is None else k[rows],
                                                v if rows is None else v[rows])
        k_buf = self.token_to_kv_pool.get_key_buffer(lid)
        v_buf = self.token_to_kv_pool.get_value_buffer(lid)
        qh = q.view(-1, hq, d)
        if self.kernels:
            self._extend(qh, k, v, o, k_buf, v_buf, layer, batch)
        else:
            for s in batch.seqs:
                o[s.start:s.end] = self._torch_seq(qh, k, v, k_buf, v_buf, s, float(layer.scaling))
        return o.view(-1, hq * d)

    def _feed(self, batch: Batch, layer: Any, lid: int) -> None:
        """Place this layer of every fed unit's captured state into the requests they are fed to:
        one rotation and one pool write for all of them (per feed, the calls cost more than the
        arithmetic)."""
        assert batch.feed_positions is not None and batch.feed_locs is not None
        keys, values = [], []
        for s, start, end in batch.feed_spans:
            assert s.capture is not None
            keys.append(s.capture[0][lid:lid + 1, start:end])
            values.append(s.capture[1][lid, start:end])
        rotated = self.rotate(torch.cat(keys, dim=1) if len(keys) > 1 else keys[0], batch.feed_positions)[0]
        flat = torch.cat(values) if len(values) > 1 else values[0]
        self.token_to_kv_pool.set_kv_buffer(layer, batch.feed_locs, rotated, flat.to(rotated.dtype))

    # --- SGLang's kernels -----------------------------------------------------------------

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, k_buf: torch.Tensor,
                v_buf: torch.Tensor, layer: Any, batch: Batch) -> None:
        m = batch.kernel_meta
        torch.ops.sgl_kernel.extend_attention_cpu(
            q, k, v, o, k_buf, v_buf, self.req_to_token_pool.req_to_token, m["req_pool_indices"],
            m["seq_lens"], m["extend_seq_lens"], m["extend_start_loc"], m["max_extend_len"], layer.scaling,
            layer.logit_cap, False, layer.sliding_window_size + 1, None, None, None)

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, layer: Any,
                batch: Batch) -> None:
        m = batch.kernel_meta
        bs, hq, d = len(batch.seqs), q.shape[1], v.shape[-1]
        if self._decode_logits is None or self._decode_logits.shape[0] < bs or self._decode_logits.shape[1] != hq:
            # the kernel's split-K scratch: it writes every element it reads, so it is reused
            self._decode_logits = torch.empty((bs, hq, 8, d + 1), dtype=torch.float32, device=q.device)
        assert batch.write_locs is not None
        torch.ops.sgl_kernel.decode_attention_cpu(
            q, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id), o, k, v, batch.write_locs,
            self._decode_logits[:bs], self.req_to_token_pool.req_to_token, m["req_pool_indices"], m["seq_lens"],
            layer.scaling, layer.logit_cap, False, layer.sliding_window_size + 1, None, None)

    # --- portable torch -------------------------------------------------------------------

    @staticmethod
    def _torch_seq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                   s: Seq, scaling: float) -> torch.Tensor:
        qs = q[s.start:s.end]
        if s.kind == "unit":
            return masked_attention(qs, k[s.start:s.end], v[s.start:s.end], s.positions, scaling)
        span = _locs(s)[:s.span]
        return masked_attention(qs, k_buf[span], v_buf[span], s.positions, scaling)


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: Sequence[int],
                     scaling: float) -> torch.Tensor:
    """Attention of ``q`` ``[n, Hq, D]`` at ``positions`` over ``keys``/``values`` ``[S, Hk, D]``
    where key ``j`` sits at position ``j``: key ``j`` is visible to a query iff ``j <= `` its position."""
    n, hq, _ = q.shape
    s, hk, _ = keys.shape
    qpos = torch.as_tensor(list(positions), device=q.device).view(n, 1)
    visible = torch.arange(s, device=q.device).view(1, s) <= qpos
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=visible, scale=scaling, enable_gqa=hq != hk)
    return out.transpose(0, 1)
