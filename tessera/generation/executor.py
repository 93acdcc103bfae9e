"""Execution of one planned request on a generation node (paper §5.3, Fig. 11).

    fix the layout and allocate the request's KV slots
    match the exact prefix (the leading text, e.g. the system prompt)
    prepare every needed unit concurrently: local copy | remote fetch | prefill (coalesced)
        -> place it at its offset (RoPE at its real positions); retain it in the background
    final extend: the policy's recomputed tokens + the remaining text, in one batch item
    sample, then decode until a stop token or max_tokens

A remote fetch that fails, times out or fails its checksum falls back to computing the unit
from text; the request still succeeds. Nothing here knows about HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from tessera.engines.base import EngineAdapter, KVSlots, UnitState
from tessera.engines.compose import tokens_to_compute
from tessera.engines.composition import CompositionPolicy
from tessera.engines.sampling import Sampler
from tessera.errors import TransferError
from tessera.generation.prefills import PrefillCoalescer
from tessera.generation.retention import Retainer
from tessera.generation.scheduler import EngineWorker, Scheduler
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages import ExecuteRequest, Preparation, PromptLayout, ReadLease, SegmentKind, UnitPlan

log = logging.getLogger(__name__)


class SharedReader(Protocol):
    async def fetch(self, lease: ReadLease, n_tokens: int) -> UnitState: ...


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    prefix_cached_tokens: int = 0  # served by the exact prefix cache
    local_tokens: int = 0  # unit tokens whose state came from the local cache
    remote_tokens: int = 0  # ... from the shared KV Pool
    computed_unit_tokens: int = 0  # ... prefilled from text on this node
    coalesced_units: int = 0  # misses that joined another request's in-flight prefill
    fallbacks: int = 0  # remote fetches that failed and were computed instead
    recomputed_tokens: int = 0  # tokens computed in the final extend pass
    bytes_fetched: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class TokenEvent:
    token_id: int
    text: str


@dataclass
class Finished:
    finish_reason: str
    stats: RequestStats


class Executor:
    def __init__(
        self,
        engine: EngineAdapter,
        worker: EngineWorker,
        scheduler: Scheduler,
        prefills: PrefillCoalescer,
        cache: LocalUnitCache,
        retainer: Retainer,
        reader: SharedReader | None,
        release_lease: Callable[[str], None],
        policy: CompositionPolicy,
        mode: str,
    ) -> None:
        self.engine = engine
        self.worker = worker
        self.scheduler = scheduler
        self.prefills = prefills
        self.cache = cache
        self.retainer = retainer
        self.reader = reader
        self.release_lease = release_lease
        self.policy = policy
        self.mode = mode

    async def run(self, req: ExecuteRequest) -> AsyncIterator[TokenEvent | Finished]:
        layout, sp = req.layout, req.sampling
        stats = RequestStats(prompt_tokens=layout.n_tokens)
        leases = [u.lease for u in req.plan.units if u.lease is not None]
        slots = await self.worker.call(self.engine.allocate, layout.n_tokens + sp.max_tokens)
        try:
            logits = await self._prefill(req, slots, stats)
            sampler = Sampler(sp, self.engine.eos_token_ids)
            position = layout.n_tokens
            generated: list[int] = []
            text_so_far = ""
            while True:
                token = sampler.sample(logits)
                generated.append(token)
                stats.completion_tokens += 1
                finish = sampler.finish_reason(token, len(generated))
                if finish is None or finish == "length":
                    text = self.engine.decode_tokens(generated)
                    delta, text_so_far = text[len(text_so_far):], text
                    yield TokenEvent(token, delta)
                if finish is not None:
                    yield Finished(finish, stats)
                    return
                logits = await self.scheduler.decode(slots, token, position)
                position += 1
        finally:
            # leases not yet released (e.g. the request was aborted mid-fetch) go back now
            for lease in leases:
                self.release_lease(lease.lease_id)
            self.cache.unpin_request(req.request_id)
            await self.worker.call(self.engine.free, slots)

    async def _prefill(self, req: ExecuteRequest, slots: KVSlots, stats: RequestStats) -> torch.Tensor:
        layout = req.layout
        plans = {u.unit_id: u for u in req.plan.units}
        if self.mode == "prefix" or not plans:
            # exact prefix caching only: the whole prompt is plain text
            prompt = layout.token_ids()
            matched = await self.worker.call(self.engine.match_prefix, slots, prompt)
            matched = min(matched, len(prompt) - 1)  # the last token must run to give logits
            stats.prefix_cached_tokens = matched
            stats.recomputed_tokens = len(prompt) - matched
            logits = await self.scheduler.extend(slots, prompt[matched:], range(matched, len(prompt)))
            await self.worker.call(self.engine.insert_prefix, slots, prompt)
            return logits
        lead = _leading_text(layout)
        matched = await self.worker.call(self.engine.match_prefix, slots, lead) if lead else 0
        stats.prefix_cached_tokens = matched
        recompute = self.policy.select(layout)
        fully_recomputed = _fully_recomputed_units(layout, recompute)
        jobs = []
        seen: set[str] = set()
        for offset, seg in layout.unit_offsets():
            if seg.unit_id in fully_recomputed:
                continue
            plan = plans.get(seg.unit_id)
            assert plan is not None, f"unit {seg.unit_id} is in the layout but not in the plan"
            jobs.append(self._prepare(slots, offset, seg.token_ids, plan, first=seg.unit_id not in seen, stats=stats))
            seen.add(seg.unit_id)
        # all three preparation paths overlap; each unit is placed as soon as it is ready
        await asyncio.gather(*jobs)
        token_ids, positions = tokens_to_compute(layout, recompute, matched)
        stats.recomputed_tokens = len(token_ids)
        logits = await self.scheduler.extend(slots, token_ids, positions)
        if lead and matched < len(lead):
            await self.worker.call(self.engine.insert_prefix, slots, lead)
        return logits

    async def _prepare(self, slots: KVSlots, offset: int, token_ids: Sequence[int], plan: UnitPlan,
                       first: bool, stats: RequestStats) -> None:
        state: UnitState | None = None
        n = len(token_ids)
        if plan.preparation is Preparation.LOCAL:
            state = self.cache.get(plan.unit_id)  # pinned since the snapshot
            if state is not None:
                stats.local_tokens += n
        elif plan.preparation is Preparation.REMOTE and self.reader is not None:
            assert plan.lease is not None
            try:
                state = await self.reader.fetch(plan.lease, n)
                stats.remote_tokens += n
                stats.bytes_fetched += state.nbytes()
            except TransferError as exc:
                log.warning("fetch of unit %s failed (%s); computing it instead", plan.unit_id, exc)
                stats.fallbacks += 1
            finally:
                self.release_lease(plan.lease.lease_id)
        if state is None:
            state, coalesced = await self.prefills.state(plan.unit_id, token_ids)
            stats.computed_unit_tokens += n
            stats.coalesced_units += int(coalesced)
        await self.worker.call(self.engine.place, slots, offset, state)
        if first:
            self.retainer.retain(
                plan.unit_id, state, plan.retention.local and plan.preparation is not Preparation.LOCAL,
                plan.grant, ()
            )


def _leading_text(layout: PromptLayout) -> list[int]:
    first = layout.segments[0] if layout.segments else None
    return list(first.token_ids) if first is not None and first.kind is SegmentKind.TEXT else []


def _fully_recomputed_units(layout: PromptLayout, recompute: Any) -> set[str]:
    covered: set[str] = set()
    for offset, seg in layout.unit_offsets():
        n = len(seg.token_ids)
        if all(any(a <= p < b for a, b in recompute) for p in (offset, offset + n - 1)) and \
                sum(max(0, min(b, offset + n) - max(a, offset)) for a, b in recompute) >= n:
            covered.add(seg.unit_id)
    return covered
