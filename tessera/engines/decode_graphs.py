"""CUDA graphs for the paged engine's batched decode (``model.cuda_graphs = true``, CUDA only).

A decode step of B requests is the same kernel sequence every time; only the token ids,
positions, the slots written and the slots gathered change. Each (batch bucket, key bucket)
is captured once into a graph over static buffers:

    ids [B], positions [B], write_slots [B], gather [B, K], mask [B, 1, 1, K] -> logits [B, vocab]

and replayed after the buffers are filled. Buckets are powers of two (B up to
``MAX_BATCH``, K from ``MIN_KEYS`` up to the model's context). Padding rows write to and read
from page 0 of the pool, which the graphs reserve at start-up and no request ever gets. The
RoPE table is grown to the whole context first, so no captured pointer moves afterwards.

``run`` returns False (the caller runs the eager step) for work it does not cover: anything
but single-token extends, or more than ``MAX_BATCH`` of them. The graphs are built from the
paged engine's model and pool and attend through :func:`decode_attention`, as its eager step
does; this module knows nothing about the engine itself, plans or units.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tessera.engines.attention import decode_attention
from tessera.engines.base import Extend, UnitPrefill
from tessera.engines.kv_pages import PagedKVPool, PagedSlots
from tessera.engines.model import Model

MAX_BATCH = 64
MIN_KEYS = 256


def _bucket(n: int, least: int) -> int:
    size = least
    while size < n:
        size *= 2
    return size


class _Graph:
    def __init__(self, model: Model, pool: PagedKVPool, batch: int, keys: int) -> None:
        dev = model.device
        self.batch, self.keys = batch, keys
        self.ids = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.write_slots = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.gather = torch.zeros((batch, keys), dtype=torch.int64, device=dev)
        self.mask = torch.zeros((batch, 1, 1, keys), dtype=torch.bool, device=dev)
        self.mask[..., 0] = True  # a padding row sees one (scratch) key: no all-masked softmax
        self.model, self.pool = model, pool
        # warm up on a side stream (lazy inits, autotuning), then capture
        side = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.logits = self._forward()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        m = self.model
        h = m.spec.n_heads
        cos, sin = m.rope.lookup(self.positions)
        x = F.embedding(self.ids, m.w.embed)
        for layer, lw in enumerate(m.w.layers):
            _, qk, v = m.attention_inputs(lw, x, cos, sin)
            keys, values = self.pool.keys[layer], self.pool.values[layer]
            keys.index_copy_(0, self.write_slots, qk[:, h:])
            values.index_copy_(0, self.write_slots, v)
            attn = decode_attention(qk[:, :h], keys, values, self.gather, self.mask)
            x = m.attention_output(lw, x, attn)
        return m.logits(x)

    def replay(self, work: Sequence[Extend]) -> None:
        self.ids.zero_()
        self.positions.zero_()
        self.write_slots.zero_()
        self.gather.zero_()
        self.mask.zero_()
        self.mask[..., 0] = True
        n = len(work)
        dev = self.ids.device
        self.ids[:n] = torch.tensor([w.token_ids[0] for w in work], device=dev)
        pos = [int(w.positions[0]) for w in work]
        self.positions[:n] = torch.tensor(pos, device=dev)
        for i, (w, p) in enumerate(zip(work, pos, strict=True)):
            assert isinstance(w.slots, PagedSlots) and not w.slots.freed
            self.write_slots[i] = w.slots.slot_of[p]
            self.gather[i, :p + 1] = w.slots.slot_of[:p + 1]
            self.mask[i, 0, 0, :p + 1] = True
        self.graph.replay()
        for i, w in enumerate(work):
            w.logits = self.logits[i].clone()


class DecodeGraphs:
    def __init__(self, model: Model, pool: PagedKVPool) -> None:
        self.model, self.pool = model, pool
        model.rope.ensure(model.max_positions)  # the table never moves after capture
        scratch = pool.allocate(pool.page_tokens)
        assert scratch.pages == [0], f"the scratch page must be page 0, got {scratch.pages}"
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0

    def run(self, work: Sequence[UnitPrefill | Extend]) -> bool:
        """Run ``work`` from a graph if it is 1..MAX_BATCH single-token extends; else False (run it eagerly)."""
        decodes = [w for w in work if isinstance(w, Extend) and len(w.token_ids) == 1]
        if not work or len(decodes) != len(work) or len(work) > MAX_BATCH:
            return False
        work = decodes
        longest = max(int(w.positions[0]) for w in work) + 1
        key = (_bucket(len(work), 1), min(_bucket(longest, MIN_KEYS), _bucket(self.model.max_positions, 1)))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _Graph(self.model, self.pool, *key)
        graph.replay(work)
        self.replays += 1
        return True
