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
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from tessera.composition.layout import Placement, leading_text_tokens, placements, tokens_to_compute
from tessera.composition.policies import CompositionPolicy
from tessera.engines.base import EngineAdapter, KVSlots, UnitState
from tessera.engines.offline import place_units
from tessera.engines.sampling import Sampler
from tessera.errors import TransferError
from tessera.generation.prefills import PrefillCoalescer
from tessera.generation.retention import Retainer
from tessera.generation.scheduler import EngineWorker, Scheduler
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages import ExecuteRequest, Preparation, ReadLease, UnitPlan

log = logging.getLogger(__name__)


class SharedReader(Protocol):
    async def fetch(self, lease: ReadLease, n_tokens: int, *, release: bool = True,
                    received_at: float | None = None) -> UnitState: ...


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    prefix_cached_tokens: int = 0  # served by the exact prefix cache
    local_tokens: int = 0  # unit tokens whose state came from the local cache
    remote_tokens: int = 0  # ... from the shared KV Pool
    computed_unit_tokens: int = 0  # ... prefilled from text on this node
    local_units: int = 0
    remote_units: int = 0
    computed_units: int = 0
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
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


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
        received_at = time.monotonic()
        layout, sp = req.layout, req.sampling
        sampler = Sampler(sp, self.engine.eos_token_ids)
        stats = RequestStats(prompt_tokens=layout.n_tokens)
        unreleased = {u.lease.lease_id for u in req.plan.units if u.lease is not None}
        slots = await self.worker.call(self.engine.allocate, layout.n_tokens + sp.max_tokens)
        try:
            logits = await self._prefill(req, slots, stats, unreleased, received_at)
            position = layout.n_tokens
            generated: list[int] = []
            text = ""
            while True:
                token = sampler.pick(logits)
                stop = sampler.is_stop(token)
                stats.completion_tokens += 1
                if not stop:
                    generated.append(token)
                    decoded = self.engine.decode_tokens(generated)
                    event = TokenEvent(token, decoded[len(text):])
                    if sp.top_logprobs >= 0:
                        event.logprob, event.top = _logprobs(logits, token, sp.top_logprobs)
                    yield event
                    text = decoded
                if stop or len(generated) >= sp.max_tokens:
                    yield Finished("stop" if stop else "length", stats)
                    return
                logits = await self.scheduler.decode(slots, token, position)
                position += 1
        finally:
            # leases not consumed (e.g. the request was aborted before its fetch) go back now
            for lease_id in unreleased:
                self.release_lease(lease_id)
            self.cache.unpin_request(req.request_id)
            await self.worker.call(self.engine.free, slots)

    async def _prefill(self, req: ExecuteRequest, slots: KVSlots, stats: RequestStats,
                       unreleased: set[str], received_at: float) -> torch.Tensor:
        layout = req.layout
        if self.mode == "prefix" or not req.plan.units:
            # exact prefix caching only: the whole prompt is plain text
            prompt = layout.token_ids()
            matched = await self.worker.call(self.engine.match_prefix, slots, prompt[:-1], req.tenant)
            stats.prefix_cached_tokens = matched
            stats.recomputed_tokens = len(prompt) - matched
            logits = await self.scheduler.extend(slots, prompt[matched:], range(matched, len(prompt)))
            await self.worker.call(self.engine.insert_prefix, slots, prompt, req.tenant)
            return logits
        lead = leading_text_tokens(layout)[: layout.n_tokens - 1]
        # the prefix cache is per tenant: another tenant's prompts never show as a hit
        matched = await self.worker.call(self.engine.match_prefix, slots, lead, req.tenant) if lead else 0
        stats.prefix_cached_tokens = matched
        ranges = self.policy.select(layout)
        spans: dict[str, list[Placement]] = {}
        for p in placements(layout, ranges, matched):
            spans.setdefault(p.unit_id, []).append(p)
        plans = {u.unit_id: u for u in req.plan.units}
        tokens = {seg.unit_id: seg.token_ids for _, seg in layout.unit_offsets()}
        # the three preparation paths overlap; each unit is placed as soon as it is ready.
        # units the policy recomputes entirely need no state at all.
        await asyncio.gather(*(
            self._prepare(slots, tokens[uid], plans[uid], unit_spans, req.plan.local_evict, stats, unreleased,
                          received_at)
            for uid, unit_spans in spans.items()
        ))
        token_ids, positions = tokens_to_compute(layout, ranges, matched)
        stats.recomputed_tokens = len(token_ids)
        logits = await self.scheduler.extend(slots, token_ids, positions)
        if lead and matched < len(lead):
            await self.worker.call(self.engine.insert_prefix, slots, lead, req.tenant)
        return logits

    async def _prepare(self, slots: KVSlots, token_ids: Sequence[int], plan: UnitPlan, spans: list[Placement],
                       local_evict: Sequence[str], stats: RequestStats, unreleased: set[str],
                       received_at: float) -> None:
        state: UnitState | None = None
        n = len(token_ids)
        if plan.preparation is Preparation.LOCAL:
            state = self.cache.get(plan.unit_id)  # pinned since the snapshot
            if state is not None:
                stats.local_tokens += n
                stats.local_units += 1
        elif plan.preparation is Preparation.REMOTE and plan.lease is not None:
            lease = plan.lease
            try:
                if self.reader is None:
                    raise TransferError("this node has no KV pool client")
                # the lease's TTL runs from when the plan arrived, not from when this fetch starts
                state = await self.reader.fetch(lease, n, release=False, received_at=received_at)
                stats.remote_tokens += n
                stats.remote_units += 1
                stats.bytes_fetched += state.nbytes()
            except TransferError as exc:
                log.warning("fetch of unit %s failed (%s); computing it instead", plan.unit_id, exc)
                stats.fallbacks += 1
            finally:
                unreleased.discard(lease.lease_id)
                self.release_lease(lease.lease_id)
        if state is None:
            state, coalesced = await self.prefills.state(plan.unit_id, token_ids)
            stats.computed_unit_tokens += n
            stats.computed_units += 1
            stats.coalesced_units += int(coalesced)
        await self.worker.call(place_units, self.engine, slots, spans, {plan.unit_id: state})
        # retention happens off the critical path; a local hit is already retained locally
        self.retainer.retain(plan.unit_id, state,
                             plan.retention.local and plan.preparation is not Preparation.LOCAL,
                             plan.grant, local_evict, received_at)


def _logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of the chosen token and of the k most likely ones (unscaled logits)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = lp.topk(k)
        top = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return float(lp[token]), top
