"""A preallocated, paged KV pool on the engine's device (one per paged engine).

Post-RoPE keys and values of every request live in two tensors allocated once,
``[L, n_pages * P, H_kv, D]`` each in the compute dtype: a *page* is P consecutive rows. A
request owns a block table (its pages, in order); position p of a request lives in physical
slot ``table[p // P] * P + p % P``. :class:`PagedSlots` keeps that mapping for all its
positions as one device tensor (``slot_of``), so a forward gathers and scatters a request's
KV with one ``index_select`` / ``index_copy_`` per layer, as vLLM's and SGLang's block tables do.

Verbs: ``allocate`` / ``free`` (pages), ``write`` / ``read`` (rows of one request, for the
exact-prefix cache). Allocation never blocks: a request that does not fit now is refused
with :class:`Overloaded` (retry later), one that can never fit with :class:`BadRequest`.
This module knows nothing about attention, models or units.
"""

from __future__ import annotations

import torch

from tessera.engines.base import KVSlots
from tessera.errors import BadRequest, Overloaded


class PagedSlots(KVSlots):
    """One request's block table and the physical slot of each of its positions."""

    def __init__(self, pages: list[int], slot_of: torch.Tensor, n_slots: int) -> None:
        self.pages = pages
        self.slot_of = slot_of  # [n_slots] int64 on the pool's device
        self.n_slots = n_slots
        self.freed = False


class PagedKVPool:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, n_pages: int, page_tokens: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        assert n_pages > 0 and page_tokens > 0, (n_pages, page_tokens)
        self.page_tokens = page_tokens
        self.n_pages = n_pages
        self.device = device
        shape = (n_layers, n_pages * page_tokens, n_kv_heads, head_dim)
        # uninitialised on purpose: a request's rows are filled before any query can see them
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.device = self.keys.device  # concrete (cuda:N), as the tensors it receives report theirs
        self._free = list(range(n_pages - 1, -1, -1))  # a stack: recently freed pages are reused first
        self._offsets = torch.arange(page_tokens, device=device)

    @classmethod
    def sized(cls, n_layers: int, n_kv_heads: int, head_dim: int, *, tokens: int, page_tokens: int,
              dtype: torch.dtype, device: torch.device) -> PagedKVPool:
        return cls(n_layers, n_kv_heads, head_dim, n_pages=max(1, -(-tokens // page_tokens)),
                   page_tokens=page_tokens, dtype=dtype, device=device)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.n_pages * self.page_tokens

    def allocate(self, n_slots: int) -> PagedSlots:
        need = -(-n_slots // self.page_tokens)
        if need > self.n_pages:
            raise BadRequest(f"a request of {n_slots} positions needs {need} KV pages; the pool has "
                             f"{self.n_pages} of {self.page_tokens} tokens (raise model.kv_pool_tokens)")
        if need > len(self._free):
            raise Overloaded(f"the KV pool has {len(self._free)} free pages and a request needs {need}; retry later")
        pages = [self._free.pop() for _ in range(need)]
        table = torch.tensor(pages, device=self.device)
        slot_of = (table[:, None] * self.page_tokens + self._offsets[None, :]).flatten()[:n_slots]
        return PagedSlots(pages, slot_of, n_slots)

    def free(self, slots: PagedSlots) -> None:
        assert not slots.freed, "slots freed twice"
        self._free.extend(reversed(slots.pages))
        slots.freed = True
        assert len(self._free) <= self.n_pages, (len(self._free), self.n_pages)

    def write(self, slots: PagedSlots, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rows ``start .. start+T`` of a request from ``[L, T, H_kv, D]`` tensors (post-RoPE)."""
        where = slots.slot_of[start:start + keys.shape[1]]
        self.keys.index_copy_(1, where, keys.to(self.keys.dtype))
        self.values.index_copy_(1, where, values.to(self.values.dtype))

    def read(self, slots: PagedSlots, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of rows ``start .. end`` of a request, ``[L, end-start, H_kv, D]`` each."""
        where = slots.slot_of[start:end]
        return self.keys.index_select(1, where), self.values.index_select(1, where)
