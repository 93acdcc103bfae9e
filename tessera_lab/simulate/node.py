"""A simulated generation node: the executor's steps on a simulated engine (paper Fig. 11).

    snapshot: the units it holds, pinned (the real :class:`LocalUnitCache`)
    match the exact prefix (the real radix :class:`PrefixCache`, capacity in tokens)
    prepare every planned unit: local copy | fetch over the link | prefill (coalesced)
        -> place it (an engine call); retain it as the plan authorizes, reporting to the plane
    final extend: the policy's recomputed tokens + the remaining text; then decode

On an engine that fuses unit prefills (``fuse_units``, as the real node on the reference
engine) a miss that no one here is computing rides its request's final extend instead of a
prefill of its own, and others missing it wait for that extend's first chunk.

The caches hold zero-size tensors: their capacity accounting, pins, victims and LRU are the
real code's, no state is ever computed. Prompt layouts, the policy's ranges and the tokens
to compute come from the real composition functions. Every report goes to the control plane
through ``plane`` (the cluster times those calls).

This module knows nothing about HTTP, arrivals or reports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tessera.composition.layout import leading_text_tokens, placements, tokens_to_compute
from tessera.composition.policies import CompositionPolicy
from tessera.config import GenerationNodeConfig, TransportConfig
from tessera.engines.base import UnitState
from tessera.engines.prefix_cache import PrefixCache
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages.generation import RequestStats
from tessera.messages.plan import Preparation, RequestPlan, UnitPlan, WriteGrant
from tessera.messages.prompt import PromptLayout
from tessera_lab.simulate.costs import CostModel
from tessera_lab.simulate.engine import Host, SimEngine
from tessera_lab.simulate.events import EventLoop


class NodeReports(Protocol):
    """What a node tells the control plane (the cluster forwards each to the real plane, timed)."""

    def residency(self, node: str, inserted: Sequence[str], evicted: Sequence[str], kept: Sequence[str]) -> None: ...
    def publish(self, grant: WriteGrant) -> None: ...
    def give_up(self, grant: WriteGrant) -> None: ...
    def release(self, lease_ids: Sequence[str]) -> None: ...


def _empty(n_tokens: int) -> UnitState:
    """A unit state of ``n_tokens`` positions and no bytes: the caches count it, nothing is stored."""
    t = torch.empty((0, n_tokens, 0, 0))
    return UnitState(t, t)


@dataclass
class Execution:
    """One request on the node; ``first_token`` / ``done`` are called at those simulated times."""

    request_id: str
    layout: PromptLayout
    tenant: str
    max_tokens: int
    plan: RequestPlan | None
    first_token: Callable[[RequestStats], None]
    done: Callable[[RequestStats], None]


class SimNode:
    def __init__(self, cfg: GenerationNodeConfig, transport: TransportConfig, block_tokens: int, loop: EventLoop,
                 costs: CostModel, policy: CompositionPolicy, mode: str, reports: NodeReports,
                 host: Host | None = None, fuse_units: bool = False) -> None:
        self.name = cfg.name
        self.loop = loop
        self.costs = costs
        self.policy = policy
        self.mode = mode
        self.reports = reports
        self.engine = SimEngine(loop, costs, cfg.max_batch_tokens, host, cfg.max_batch_prompts)
        self.cache = LocalUnitCache(cfg.local_capacity_blocks, block_tokens)
        self.prefix = PrefixCache(cfg.prefix_cache_tokens)
        self._prefilling: dict[str, list[Callable[[], None]]] = {}  # unit -> waiters of its in-flight prefill
        self._writes = 0
        self._write_bound = transport.writeback_outstanding
        self.inflight = 0
        self.served = 0
        self.published = 0
        self.coalesced = 0
        self.fuse_units = fuse_units

    # --- the request path ----------------------------------------------------------------

    def snapshot(self, request_id: str, unit_ids: Sequence[str]) -> list[str]:
        self.inflight += 1
        return self.cache.held(request_id, unit_ids)

    def execute(self, ex: Execution) -> None:
        layout = ex.layout
        stats = RequestStats(prompt_tokens=layout.n_tokens)
        if self.mode == "prefix" or ex.plan is None or not ex.plan.units:
            prompt = layout.token_ids()
            matched = self._match(prompt[:-1], ex.tenant)
            stats.prefix_cached_tokens = matched
            stats.recomputed_tokens = len(prompt) - matched
            self.engine.extend(len(prompt) - matched, matched,
                               lambda: self._first(ex, stats, lambda: self._insert_prefix(prompt, ex.tenant)))
            return
        plan = ex.plan
        lead = leading_text_tokens(layout)[: layout.n_tokens - 1]
        matched = self._match(lead, ex.tenant) if lead else 0
        stats.prefix_cached_tokens = matched
        ranges = self.policy.select(layout)
        needed = list(dict.fromkeys(p.unit_id for p in placements(layout, ranges, matched)))  # prompt order
        token_ids, _ = tokens_to_compute(layout, ranges, matched)
        start = layout.n_tokens - len(token_ids)
        plans = {u.unit_id: u for u in plan.units}
        left = [len(needed)]
        fused: list[UnitPlan] = []  # misses this request's extend computes (fuse_units)

        def prepared() -> None:
            left[0] -= 1
            if left[0] == 0:
                final()

        def final() -> None:
            stats.recomputed_tokens = len(token_ids)
            after = (lambda: self._insert_prefix(lead, ex.tenant)) if lead and matched < len(lead) else None
            def first() -> None:
                # as the real executor: the fused units are retained and their waiters woken
                # once the whole extend has run, then the first token
                self._fed(ex, fused)
                self._first(ex, stats, after)

            self.engine.extend(len(token_ids), start, first, tuple(up.n_tokens for up in fused))

        if not needed:
            final()
        for uid in needed:
            self._prepare(ex, plans[uid], stats, prepared, fused)

    def _first(self, ex: Execution, stats: RequestStats, after: Callable[[], None] | None) -> None:
        if after is not None:
            after()
        stats.completion_tokens = 1
        ex.first_token(stats)
        self._decode(ex, stats, ex.layout.n_tokens)

    def _decode(self, ex: Execution, stats: RequestStats, position: int) -> None:
        if stats.completion_tokens >= ex.max_tokens:
            self._finish(ex, stats)
            return

        def token() -> None:
            stats.completion_tokens += 1
            self._decode(ex, stats, position + 1)

        self.engine.decode(position, token)

    def _finish(self, ex: Execution, stats: RequestStats) -> None:
        self.cache.unpin_request(ex.request_id)
        self.inflight -= 1
        self.served += 1
        ex.done(stats)

    # --- preparation of one unit ---------------------------------------------------------

    def _fed(self, ex: Execution, fused: list[UnitPlan]) -> None:
        """The extend that computed ``fused`` ran: retain them, then wake whoever waited for them."""
        assert ex.plan is not None
        for up in fused:
            self._retain(up, up.retention.local, ex.plan.local_evict)
            self._prefilled(up.unit_id)

    def _prepare(self, ex: Execution, up: UnitPlan, stats: RequestStats, ready: Callable[[], None],
                 fused: list[UnitPlan]) -> None:
        n = up.n_tokens
        assert ex.plan is not None
        evict = ex.plan.local_evict
        if up.preparation is Preparation.LOCAL and up.unit_id in self.cache:
            stats.local_tokens += n
            stats.local_units += 1
            self._retain(up, False, evict)  # already local; a grant may still ask for the shared tier
            self.engine.call(self.costs.place_s(n), ready)
            return
        if up.preparation is Preparation.REMOTE and up.lease is not None:
            lease = up.lease

            def fetched() -> None:
                self.reports.release([lease.lease_id])
                stats.remote_tokens += n
                stats.remote_units += 1
                stats.bytes_fetched += n * self.costs.kv_bytes_per_token
                self._retain(up, up.retention.local, evict)
                self.engine.call(self.costs.place_s(n), ready)

            self.loop.after(self.costs.transfer_s(n), fetched)
            return
        if self.cache.lookup(up.unit_id) is not None:
            # planned as a miss, but another request here computed it since: reuse it
            stats.local_tokens += n
            stats.local_units += 1
            self._retain(up, False, evict)
            self.engine.call(self.costs.place_s(n), ready)
            return

        def computed() -> None:
            stats.computed_unit_tokens += n
            stats.computed_units += 1
            self._retain(up, up.retention.local, evict)
            self.engine.call(self.costs.place_s(n), ready)

        def joined() -> None:
            # the request that ran the prefill counts it computed, a joiner coalesced (as the executor does)
            stats.coalesced_unit_tokens += n
            stats.coalesced_units += 1
            self._retain(up, up.retention.local, evict)
            self.engine.call(self.costs.place_s(n), ready)

        waiters = self._prefilling.get(up.unit_id)
        if waiters is not None:
            self.coalesced += 1
            waiters.append(joined)
            return
        if self.fuse_units:
            # computed by this request's own extend (placed in its forward, no engine call)
            stats.computed_unit_tokens += n
            stats.computed_units += 1
            self._prefilling[up.unit_id] = []
            fused.append(up)
            ready()
            return
        self._prefilling[up.unit_id] = [computed]
        self.engine.prefill_unit(n, lambda: self._prefilled(up.unit_id))

    def _prefilled(self, unit_id: str) -> None:
        for waiter in self._prefilling.pop(unit_id):
            waiter()

    def _retain(self, up: UnitPlan, local: bool, evict: Sequence[str]) -> None:
        """The retainer's rules: local insert of the plan's victims only, bounded writebacks."""
        u = up.unit_id
        if local:
            inserted, _ = self.cache.insert(u, _empty(up.n_tokens), evict)
            held = inserted or self.cache.lookup(u) is not None
            victims = [v for v in dict.fromkeys(evict) if v != u]
            kept = [v for v in victims if v in self.cache]
            gone = [v for v in victims if v not in self.cache]
            self.reports.residency(self.name, [u] if held else [], gone if held else [*gone, u], kept)
        grant = up.grant
        if grant is None:
            return
        if self._writes >= self._write_bound:
            self.reports.give_up(grant)
            return
        self._writes += 1

        def written() -> None:
            self._writes -= 1
            self.published += 1
            self.reports.publish(grant)

        self.loop.after(self.costs.transfer_s(grant.n_tokens), written)

    # --- the exact prefix cache ----------------------------------------------------------

    def _match(self, tokens: Sequence[int], tenant: str) -> int:
        return self.prefix.match(tokens, tenant).length

    def _insert_prefix(self, tokens: Sequence[int], tenant: str) -> None:
        self.prefix.insert(tokens, lambda a, b: (torch.empty((0, b - a, 0, 0)),) * 2, tenant)
