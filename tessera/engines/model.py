"""Compact forward pass (Llama family, Qwen2, Qwen3) over ragged batches with explicit positions.

One forward runs any mix of :class:`Item` s (sequences of a ragged batch). The tokens of all items are concatenated
so every projection and the MLP run as one matmul per weight per layer; attention runs per
item with 4-D tensors (``[1, heads, tokens, D]``) through ``scaled_dot_product_attention``.

Two kinds of item:

* *fresh* (``kv is None``): tokens at positions ``0..n-1`` attending only to each other
  (causal). Used for independent unit prefill; ``capture`` receives the keys *before* RoPE and
  the values of rows ``capture_from..n`` for every layer, ``[L, T, H_kv, D]`` each.
* *slotted* (``kv`` given): tokens at arbitrary ``positions`` of a request whose post-RoPE K/V
  live in ``kv`` (``[L, S, H_kv, D]``, position p in slot p). Their K/V are written to their
  slots first, then each token attends to every slot whose position is <= its own. Slots
  below a computed token's position must already be filled by the caller, or by a fresh
  item's ``feeds``: at every layer, right after a fresh item's capture and before any item
  attends, each :class:`Feed` rotates captured rows into a slotted item's KV at that layer.
  A layer's captured K/V depend only on the fresh item's own tokens, so feeding them within
  the forward places exactly what a separate prefill and placement would.

This module knows nothing about units, requests or prefix caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tessera.engines.rope import RopeTable
from tessera.engines.weights import LayerWeights, ModelSpec, Weights, checkpoint_weights
from tessera.kernels.rope import rope_place_span, rotate_into

_PROBE_ROWS = 256  # query rows per block of first_layer_attention (bounds its memory on long prompts)


@dataclass(frozen=True)
class Feed:
    """Captured rows ``start..end`` of a fresh item, placed at ``position..`` of slot tensors ``kv``."""

    kv: tuple[torch.Tensor, torch.Tensor]  # the receiving item's slots [L, S, H_kv, D], compute dtype
    start: int
    end: int
    position: int


@dataclass
class Item:
    """One sequence of a ragged batch."""

    token_ids: Sequence[int]
    positions: Sequence[int] | None = None  # None: 0..n-1 (fresh item)
    kv: tuple[torch.Tensor, torch.Tensor] | None = None  # slot tensors [L, S, H_kv, D], compute dtype
    capture: tuple[torch.Tensor, torch.Tensor] | None = None  # [L, T, H_kv, D] pre-RoPE K and V
    capture_from: int = 0  # rows before this are not captured (e.g. a BOS sink)
    logits: bool = False  # return logits of the token at the highest position
    tail: int = 0  # also return logits of the item's last ``tail`` rows (slotted items)
    feeds: Sequence[Feed] = ()  # capture items only: rows placed into other items' slots per layer


@dataclass
class _Plan:
    """Per-item attention plan, computed once per forward (not per layer)."""

    start: int
    end: int
    kv: tuple[torch.Tensor, torch.Tensor] | None
    write: slice | torch.Tensor  # slot index of each row (slotted items)
    n_keys: int  # slots 0..n_keys-1 are attended to
    causal: bool  # use SDPA's is_causal (queries and keys are the same 0..n-1)
    mask: torch.Tensor | None  # [n, n_keys] bool, True = visible


class Model:
    def __init__(self, spec: ModelSpec, weights: Weights, dtype: torch.dtype, device: torch.device,
                 max_positions: int = 0) -> None:
        self.spec = spec
        self.w = weights
        self.dtype = dtype
        self.device = device
        self.max_positions = max_positions or spec.max_positions
        self.rope = RopeTable(spec.rope, self.max_positions, dtype, device)
        self._scale = spec.head_dim ** -0.5
        self._gqa = spec.n_heads != spec.n_kv_heads

    @classmethod
    def load(cls, path: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
             max_positions: int = 0) -> Model:
        return cls(spec, checkpoint_weights(path, spec, dtype, device), dtype, device, max_positions)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.spec.rms_eps)
        # half precision: normalise in float32, round, then scale (as transformers does)
        return weight * F.rms_norm(x.float(), weight.shape, None, self.spec.rms_eps).to(x.dtype)

    def _plan(self, items: Sequence[Item]) -> tuple[list[_Plan], list[int], list[int]]:
        plans, positions, logit_rows = [], [], []
        row = 0
        for it in items:
            n = len(it.token_ids)
            assert n > 0, "an item must compute at least one token"
            assert it.kv is not None or it.positions is None, "a fresh item always sits at positions 0..n-1"
            assert not it.feeds or it.capture is not None, "only a capturing item feeds other items"
            pos = list(range(n)) if it.positions is None else list(it.positions)
            assert len(pos) == n, (len(pos), n)
            top = max(pos)
            assert min(pos) >= 0, f"negative position in {pos[:8]}..."
            positions.extend(pos)
            if it.logits:
                logit_rows.append(row + pos.index(top))
            assert 0 <= it.tail <= n, (it.tail, n)
            logit_rows.extend(range(row + n - it.tail, row + n))
            plan = _Plan(row, row + n, it.kv, slice(0, n), n, True, None)
            if it.kv is not None:
                assert top < it.kv[0].shape[1], f"position {top} is beyond the {it.kv[0].shape[1]} slots"
                first = pos[0]
                ordered = pos == list(range(first, first + n))
                where = torch.tensor(pos, device=self.device)
                plan.write = slice(first, first + n) if ordered else where
                plan.n_keys = top + 1
                plan.causal = ordered and first == 0
                if not plan.causal and n > 1:  # one query alone sees every slot up to itself: no mask
                    plan.mask = torch.arange(top + 1, device=self.device)[None, :] <= where[:, None]
            plans.append(plan)
            row += n
        return plans, positions, logit_rows

    @torch.no_grad()
    def forward(self, items: Sequence[Item]) -> torch.Tensor:
        """Run one batched forward; returns float32 logits ``[rows, vocab]`` in item order: per item,
        its highest position's row (``logits``), then its last ``tail`` rows."""
        plans, positions, logit_rows = self._plan(items)
        self.rope.ensure(max([*positions, *(f.position + f.end - f.start for it in items for f in it.feeds)]) + 1)
        pos = torch.tensor(positions, device=self.device)
        cos, sin = self.rope.lookup(pos)  # [N, 1, D]: shared by every layer
        ids = torch.tensor([t for it in items for t in it.token_ids], device=self.device)
        x = F.embedding(ids, self.w.embed)
        for layer, lw in enumerate(self.w.layers):
            x = self._layer(layer, lw, x, cos, sin, items, plans)
        if not logit_rows:
            return torch.empty((0, self.spec.vocab_size), dtype=torch.float32, device=self.device)
        return self.logits(x[logit_rows])

    def _layer(self, layer: int, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               items: Sequence[Item], plans: list[_Plan]) -> torch.Tensor:
        h = self.spec.n_heads
        raw, qk, v = self.attention_inputs(lw, x, cos, sin)
        for it, p in zip(items, plans, strict=True):
            if it.capture is not None:  # the reusable form: keys before RoPE, values
                it.capture[0][layer].copy_(raw[p.start + it.capture_from:p.end, h:])
                it.capture[1][layer].copy_(v[p.start + it.capture_from:p.end])
                # placed from the captured (storage-dtype) rows, as a later placement of the
                # state would be: the receiving request sees the bits a cached state gives it
                keys, values = it.capture[0][layer:layer + 1], it.capture[1][layer]
                for f in it.feeds:
                    rope_place_span(keys[:, f.start:f.end], f.position, self.rope.cos, self.rope.sin,
                                    f.kv[0][layer:layer + 1])
                    f.kv[1][layer, f.position:f.position + f.end - f.start].copy_(values[f.start:f.end])
        q, k = qk[:, :h], qk[:, h:]
        attn = torch.empty((x.shape[0], h, self.spec.head_dim), dtype=x.dtype, device=x.device)
        for p in plans:
            attn[p.start:p.end] = self._attend(layer, q, k, v, p)
        return self.attention_output(lw, x, attn)

    def attention_inputs(self, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q|k before RoPE ``[N, H + H_kv, D]`` (q/k-normed), the same rotated, and v ``[N, H_kv, D]``."""
        s = self.spec
        n_tok, d, h, hk = x.shape[0], s.head_dim, s.n_heads, s.n_kv_heads
        qkv = F.linear(self._norm(x, lw.attn_norm), lw.wqkv, lw.bqkv)  # [N, (H + 2 H_kv) * D]
        qk = qkv[:, :(h + hk) * d].view(n_tok, h + hk, d)  # q and k side by side: one RoPE pass
        v = qkv[:, (h + hk) * d:].view(n_tok, hk, d)
        if lw.q_norm is not None and lw.k_norm is not None:
            qk = torch.cat((self._norm(qk[:, :h], lw.q_norm), self._norm(qk[:, h:], lw.k_norm)), dim=1)
        rotated = rotate_into(qk, cos, sin, torch.empty_like(qk, memory_format=torch.contiguous_format))
        return qk, rotated, v

    def attention_output(self, lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection and MLP, both residual: the rest of the layer after attention ``[N, H, D]``."""
        s = self.spec
        x = torch.addmm(x, attn.view(x.shape[0], -1), lw.wo.t())
        if lw.bo is not None:
            x += lw.bo
        gate_up = F.linear(self._norm(x, lw.mlp_norm), lw.w_gate_up, lw.b_gate_up)
        act = F.silu(gate_up[:, :s.intermediate_size])
        act *= gate_up[:, s.intermediate_size:]
        x = torch.addmm(x, act, lw.w_down.t())
        if lw.b_down is not None:
            x += lw.b_down
        return x

    @torch.no_grad()
    def first_layer_attention(self, token_ids: Sequence[int], query_from: int) -> list[float]:
        """Attention paid to each position by the tokens at ``query_from..`` in the first layer,
        summed over heads and those tokens (causal), in float32. The first layer's inputs are
        the embeddings, so this needs no cache: it is full prefill's first-layer attention."""
        s, n = self.spec, len(token_ids)
        assert 0 <= query_from < n, (query_from, n)
        self.rope.ensure(n)
        cos, sin = self.rope.lookup(torch.arange(n, device=self.device))
        x = F.embedding(torch.tensor(list(token_ids), device=self.device), self.w.embed)
        _, qk, _ = self.attention_inputs(self.w.layers[0], x, cos, sin)
        keys = qk[:, s.n_heads:].float().repeat_interleave(s.n_heads // s.n_kv_heads, dim=1)  # [n, H, D]
        paid = torch.zeros(n, dtype=torch.float32, device=self.device)
        for a in range(query_from, n, _PROBE_ROWS):  # a bounded [H, rows, n] score block at a time
            b = min(n, a + _PROBE_ROWS)
            scores = torch.einsum("qhd,khd->hqk", qk[a:b, :s.n_heads].float(), keys) * self._scale
            hidden = torch.arange(n, device=self.device)[None, :] > torch.arange(a, b, device=self.device)[:, None]
            paid += scores.masked_fill_(hidden, float("-inf")).softmax(dim=-1).sum(dim=(0, 1))
        return paid.tolist()

    @torch.no_grad()
    def second_layer_deviation(self, token_ids: Sequence[int], units: Sequence[tuple[int, int]],
                               bos: int | None = None) -> list[float]:
        """Per position: how far the second layer's keys and values (before RoPE) of a unit token
        prefilled alone (behind ``bos`` if given, as unit states are) are from full prefill's of
        the whole prompt, as a squared distance summed over heads (0 outside ``units``). The
        first layer is the only one between them, so this is what a cached state gets wrong
        first, computed from the tokens alone."""
        n = len(token_ids)
        deviation = torch.zeros(n, dtype=torch.float32, device=self.device)
        if self.spec.n_layers < 2 or not units:
            return deviation.tolist()
        whole = self._second_layer_kv(list(token_ids))
        lead = [] if bos is None else [bos]
        for a, b in units:
            alone = self._second_layer_kv([*lead, *token_ids[a:b]])[len(lead):]
            deviation[a:b] = (whole[a:b] - alone).float().pow(2).sum(dim=(1, 2))
        return deviation.tolist()

    def _second_layer_kv(self, token_ids: list[int]) -> torch.Tensor:
        """The second layer's keys (before RoPE) and values of ``token_ids`` prefilled from
        position 0, side by side: ``[n, 2 H_kv, D]``."""
        items = [Item(token_ids)]
        plans, positions, _ = self._plan(items)
        self.rope.ensure(len(token_ids))
        cos, sin = self.rope.lookup(torch.tensor(positions, device=self.device))
        x = F.embedding(torch.tensor(token_ids, device=self.device), self.w.embed)
        x = self._layer(0, self.w.layers[0], x, cos, sin, items, plans)
        raw, _, v = self.attention_inputs(self.w.layers[1], x, cos, sin)
        return torch.cat((raw[:, self.spec.n_heads:], v), dim=1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[R, vocab]`` of hidden rows ``[R, hidden]``."""
        return F.linear(self._norm(x, self.w.norm), self.w.lm_head).float()

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: _Plan) -> torch.Tensor:
        qi = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.kv is None:
            ki, vi = k[p.start:p.end], v[p.start:p.end]
        else:
            keys, values = p.kv[0][layer], p.kv[1][layer]  # [S, H_kv, D]
            keys[p.write] = k[p.start:p.end]
            values[p.write] = v[p.start:p.end]
            ki, vi = keys[:p.n_keys], values[:p.n_keys]
        out = F.scaled_dot_product_attention(
            qi, ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask, is_causal=p.causal and p.end - p.start > 1, scale=self._scale, enable_gqa=self._gqa,
        )
        return out[0].transpose(0, 1)  # [n, H, D]
