"""Execution of one planned request on a generation node (paper §5.3, Fig. 11).

    fix the layout; take the request's KV slots and match the exact prefix (the leading
        text, e.g. the system prompt) in one engine call
    take every held or leased unit: local copy | remote fetch
    a request with units to compute waits for its turn (the node's waiting room), then looks
        for them again: local cache | late lease on the shared tier | prefill (coalesced);
        a unit an idle peer prefills for it (an assist) is fetched once the peer publishes it
    final extend: the policy's recomputed tokens + the remaining text, in one batch item;
        the reused states ride on it and are placed at their offsets (RoPE at their real
        positions) right before its forward, then retained in the background
    sample, then decode until a stop token or max_tokens

Each engine call a request awaits queues behind the running forward, so it makes one before
its extend (the scheduler's "Hops").

On an engine that ``fuses_unit_prefills`` a unit no one on this node is computing yet rides
on the final extend (:class:`~tessera.engines.base.UnitFeed`), prefilled independently in the
same forward, bit for bit what a separate prefill and placement give. A request that misses
a unit then reaches its first token in one forward, not two, and does not queue twice under
load. Another request missing the same unit waits for this forward.

A unit the plan says a peer computes (``UnitPlan.peer``, :mod:`tessera.control.planner`,
"Assists") is awaited on the shared tier while this node prefills its own units separately
(not fused: they run while the peer works, and the extend follows once both are there); if
the peer's unit is not published in time, it is computed here.

A remote fetch that fails, times out or fails its checksum, and a local or fetched state that
cannot be copied to the device or placed (:class:`PlacementError`), fall back to computing
the unit from text; the request still succeeds. Nothing here knows about HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tessera.composition.choice import Choices
from tessera.composition.layout import (
    Placement,
    computed_ranges,
    leading_text_tokens,
    placements,
    tokens_to_compute,
)
from tessera.composition.policies import CompositionPolicy
from tessera.engines.base import KVSlots, UnitFeed, UnitState
from tessera.engines.sampling import Sampler
from tessera.errors import ConfigError, ControlPlaneError, Overloaded, TransferError
from tessera.generation.prefills import PrefillCoalescer
from tessera.generation.retention import Retainer
from tessera.generation.scheduler import Scheduler, StartDeadline, UnplacedUnits
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages.generation import DoneEvent, ExecuteRequest, RequestStats, TokenEvent, TopLogprob
from tessera.messages.plan import Preparation, ReadLease, Retention, UnitPlan
from tessera.messages.prompt import PromptLayout
from tessera.wire import WIRE_VERSION

log = logging.getLogger(__name__)
ALLOCATE_WAIT_S = 30.0  # a request waits this long for KV pages before it fails as Overloaded
ALLOCATE_POLL_S = 0.005
# a plan this old may have planned as a miss a unit another node published since: ask again
LATE_PLAN_S = 1.0
# a peer's units are awaited this long beyond PEER_WAIT_FACTOR times their prefill at this
# node's measured rate (the peer runs the same model), then computed here
PEER_WAIT_S = 1.0
PEER_WAIT_FACTOR = 3.0
PEER_UNMEASURED_S = 5.0  # ... or this long in all while this node has no measured rate
PEER_POLL_S = 0.01  # how often the shared tier is asked whether a peer's unit is published


class SharedReader(Protocol):
    async def fetch(self, lease: ReadLease, n_tokens: int, *, release: bool = True,
                    received_at: float | None = None) -> UnitState: ...

    async def late_lease(self, unit_id: str) -> ReadLease | None:
        """A lease on the unit if the shared tier holds it READY now (else None; raises
        ControlPlaneError when the plane cannot be asked)."""
        ...


@dataclass
class Run:
    """One planned request while it executes on this node."""

    req: ExecuteRequest
    slots: KVSlots
    received_at: float  # when the plan arrived: lease TTLs and grant deadlines count from here
    stats: RequestStats
    deadline: StartDeadline  # its work must begin by then (the queueing bound), or it is refused
    alone: bool  # nothing else was running on this node when it arrived (its work is the unloaded kind)
    lead: list[int]  # the tokens the exact prefix cache may cover (Executor._lead)
    matched: int  # of those, the leading tokens it copied into the slots
    # read leases of the plan not yet consumed; whatever is left goes back when the run ends
    unreleased: set[str] = field(default_factory=set)
    peer_deadline: float = 0.0  # monotonic: until then a unit a peer computes is awaited (_late_fetch)
    group: int = 0  # nonzero: the batching group of its own unit prefills (with a peer's units)

    @property
    def layout(self) -> PromptLayout:
        return self.req.layout


@dataclass(frozen=True)
class Reused:
    """A unit state a request reuses, placed by its extend (the scheduler's "Hops")."""

    state: UnitState
    local: bool  # from this node's local cache (else fetched from the KV pool)
    keep_local: bool  # retain it in the local cache once placed
    peer: bool = False  # computed for this request by a peer (an assist), fetched from the KV pool


@dataclass
class FusedUnits:
    """The units one request claimed to prefill inside its own extend (see the module docstring)."""

    prefills: PrefillCoalescer
    claims: list[tuple[UnitPlan, UnitFeed, asyncio.Future[UnitState], bool]] = field(default_factory=list)
    open: bool = True  # False once the request failed: a late preparation must not claim any more

    def claim(self, plan: UnitPlan, token_ids: Sequence[int], spans: Sequence[Placement], local: bool) -> bool:
        """Claim the unit for the extend (False: not open, or someone is computing it already)."""
        claim = self.prefills.claim(plan.unit_id) if self.open else None
        if claim is None:
            return False
        feed = UnitFeed(token_ids, [(p.start, p.end, p.offset + p.start) for p in spans])
        self.claims.append((plan, feed, claim, local))
        return True

    @property
    def feeds(self) -> list[UnitFeed]:
        return [feed for _, feed, _, _ in self.claims]

    def abandon(self) -> None:
        self.open = False
        for plan, _, claim, _ in self.claims:
            self.prefills.abandon(plan.unit_id, claim)
        self.claims.clear()


class Executor:
    """Runs planned requests; every engine call goes through the scheduler."""

    def __init__(
        self,
        scheduler: Scheduler,
        prefills: PrefillCoalescer,
        cache: LocalUnitCache,
        retainer: Retainer,
        reader: SharedReader | None,
        release_lease: Callable[[str], None],
        policy: CompositionPolicy,
        mode: str,
        choices: Choices | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.prefills = prefills
        self.cache = cache
        self.retainer = retainer
        self.reader = reader
        self.release_lease = release_lease
        self.policy = policy
        self.mode = mode
        self.choices = choices  # composition.per_request: the settings a request may name
        self.active = 0  # requests running here now

    async def run(self, req: ExecuteRequest) -> AsyncGenerator[TokenEvent | DoneEvent, None]:
        received_at = time.monotonic()
        deadline = self.scheduler.deadline(req.queue_budget_s)  # from receipt: waiting for KV pages counts
        sp = req.sampling
        sampler = Sampler(sp, self.scheduler.eos_token_ids)
        lead = self._lead(req)
        slots, matched = await self._begin(req.layout.n_tokens + sp.max_tokens, lead, req.tenant)
        alone = self.active == 0
        self.active += 1  # taken back in the finally below
        run = Run(req, slots, received_at, RequestStats(prompt_tokens=req.layout.n_tokens),
                  deadline, alone, lead, matched,
                  {u.lease.lease_id for u in req.plan.units if u.lease is not None})
        try:
            logits = await self._prefill(run)
            position = req.layout.n_tokens
            generated: list[int] = []
            text = ""
            while True:
                token = sampler.pick(logits)
                stop = sampler.is_stop(token)
                run.stats.completion_tokens += 1
                if not stop:
                    generated.append(token)
                    decoded = self.scheduler.detokenize(generated)
                    first = None
                    if len(generated) == 1:
                        first = run.stats
                        self._timed(run)
                    if sp.top_logprobs >= 0:
                        logprob, top = _logprobs(logits, token, sp.top_logprobs)
                        yield TokenEvent(WIRE_VERSION, token, decoded[len(text):], logprob, top, stats=first)
                    else:
                        yield TokenEvent(WIRE_VERSION, token, decoded[len(text):], stats=first)
                    text = decoded
                if stop or len(generated) >= sp.max_tokens:
                    yield DoneEvent(WIRE_VERSION, "stop" if stop else "length", run.stats)
                    return
                logits = await self.scheduler.decode(slots, token, position)
                position += 1
        finally:
            self.active -= 1
            # leases not consumed (e.g. the request was aborted before its fetch) go back now
            for lease_id in run.unreleased:
                self.release_lease(lease_id)
            self.cache.unpin_request(req.request_id)
            await self.scheduler.free(slots)

    def _timed(self, run: Run) -> None:
        """The request's first token: how long it queued on this node and took to get there (the
        scheduler's measure of work under load learns from it)."""
        now = time.monotonic()
        started = now if run.deadline.started_at is None else run.deadline.started_at
        run.stats.node_queued_s = round(started - run.received_at, 4)
        run.stats.node_first_token_s = round(now - run.received_at, 4)
        self.scheduler.work.observe(now - started, run.alone)

    def _exact_only(self, req: ExecuteRequest) -> bool:
        """The whole prompt is plain text: exact prefix caching only, nothing composed."""
        return self.mode == "prefix" or not req.plan.units

    def _lead(self, req: ExecuteRequest) -> list[int]:
        """The tokens the exact prefix cache may cover: the whole prompt in prefix mode and for
        units ordered for it (``exact_into_units``), else its leading text; never the last token
        (its logits are the extend's output)."""
        layout = req.layout
        if self._exact_only(req) or req.exact_into_units:
            return layout.token_ids()[:-1]
        return leading_text_tokens(layout)[: layout.n_tokens - 1]

    async def _begin(self, n_slots: int, lead: Sequence[int], tenant: str) -> tuple[KVSlots, int]:
        """The request's slots and its matched prefix (the prefix cache is per tenant: another
        tenant's prompts never show as a hit); while a paged engine's pool is full
        (Overloaded), wait for pages."""
        deadline = time.monotonic() + ALLOCATE_WAIT_S
        while True:
            try:
                return await self.scheduler.begin(n_slots, lead, tenant)
            except Overloaded:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(ALLOCATE_POLL_S)  # pages come back when a request ends

    async def _prefill(self, run: Run) -> torch.Tensor:
        layout, slots, stats, lead, matched = run.layout, run.slots, run.stats, run.lead, run.matched
        stats.prefix_cached_tokens = matched
        if self._exact_only(run.req):
            return await self._extend_whole(run)
        plans = {u.unit_id: u for u in run.req.plan.units}
        if run.req.exact_into_units and run.req.recurring:  # an order seen before: seed the prefix cache
            return await self._exact_rest(run, plans.values())
        policy = self._policy(run.req)
        if policy.needs_probe:  # it reads the model: on the engine's thread, between its forwards
            ranges = await self.scheduler.worker.call(policy.select, layout)
            stats.computed_ranges = computed_ranges(layout, ranges, matched)  # the receipt cannot select it
        else:
            ranges = policy.select(layout)
        spans: dict[str, list[Placement]] = {}
        for p in placements(layout, ranges, matched):
            spans.setdefault(p.unit_id, []).append(p)
        tokens = {seg.unit_id: seg.token_ids for _, seg in layout.unit_offsets()}
        token_ids, positions = tokens_to_compute(layout, ranges, matched)
        if run.req.exact_into_units and _exact_is_cheaper(layout.n_tokens - matched, len(token_ids), spans, plans,
                                                          tokens):
            return await self._exact_rest(run, plans.values())
        # units the exact prefix covers or the policy recomputes whole need no state: their grants go back now
        self._give_back(plans[uid] for uid in plans if uid not in spans)
        peers = [uid for uid in spans if plans[uid].peer]
        # with a peer computing some units, this node's own prefill them apart, at once, so that
        # both nodes work at the same time (fused, they would wait for the peer's units)
        fused = FusedUnits(self.prefills) if self.scheduler.fuses_unit_prefills and not peers else None
        if peers:
            run.peer_deadline = self._peer_deadline(sum(len(tokens[uid]) for uid in peers))
            run.group = self.scheduler.new_group()  # its own units in one forward
        # what the prefix cache is offered: the lead up to the first placed state (everything
        # before it is matched or computed causally, exactly as full prefill would)
        exact = lead[: min((p.offset + p.start for unit_spans in spans.values() for p in unit_spans),
                           default=len(lead))]
        # held and leased states first: they are the plan's to use whenever the work runs
        fetched = await asyncio.gather(*(self._reuse(run, plans[uid], len(tokens[uid])) for uid in spans))
        states = dict(zip(spans, fetched, strict=True))
        missing = [uid for uid, state in states.items() if state is None]
        # a unit to compute is looked for again when the request's work is next in line, not
        # when its plan came (the waiting room): meanwhile another request here may have
        # computed it, or another node published it
        ticket = (await self.scheduler.turn(len(token_ids) + sum(len(tokens[uid]) for uid in missing
                                                                 if not plans[uid].peer),
                                            run.deadline) if missing else None)
        try:
            # before any claim: a request holds no claim while it waits for these, so its
            # claims and joins of in-flight prefills are still made in one turn (a request that
            # claimed a unit, then waited and joined another request's claim, could wait on a
            # request that joined its own: neither extend would ever run)
            late = await self._late_fetches(run, [plans[uid] for uid in missing], tokens)
            # the preparation paths overlap; units the policy recomputes entirely need no state
            # at all. A reused state is placed by the extend itself, right before its forward.
            ready = await asyncio.gather(*(self._prepare(run, plans[uid], tokens[uid], unit_spans, fused,
                                                         states[uid], late.get(uid))
                                           for uid, unit_spans in spans.items()))
            reused = {uid: r for uid, r in zip(spans, ready, strict=True) if r is not None}
            stats.recomputed_tokens = len(token_ids)
            placing = {uid: (spans[uid], r.state) for uid, r in reused.items()}
            while True:
                try:
                    if ticket is not None:
                        ticket.release()  # its job is queued next, with no await between
                    logits = await self.scheduler.extend(
                        slots, token_ids, positions, run.deadline, fused.feeds if fused is not None else (),
                        insert_prefix=(exact, run.req.tenant) if len(exact) > matched else None,
                        place=placing)
                    break
                except UnplacedUnits as exc:
                    # a state that cannot be copied or placed only costs its prefill; the others
                    # are in place, and the extend (which did not run) goes again without them
                    placing = {}
                    for uid, error in exc.failed.items():
                        log.warning("placing unit %s (%s) failed (%s); computing it instead", uid,
                                    plans[uid].preparation, error)
                        stats.fallbacks += 1
                        del reused[uid]
                        await self._compute(run, plans[uid], tokens[uid], spans[uid])
        except BaseException:
            if fused is not None:
                fused.abandon()  # whoever joined its claims computes those units instead
            raise
        finally:
            if ticket is not None:
                ticket.release()
        for uid, r in reused.items():
            self._reused(run, plans[uid], r)
        for plan, feed, claim, local in fused.claims if fused is not None else ():
            assert feed.state is not None
            # retained before the claim is settled, with no await between: a request arriving
            # next finds the unit in flight (the claim) or in the local cache, never neither;
            # settled whatever the retention does, so no joiner waits on it forever
            try:
                self.retainer.retain(plan.unit_id, feed.state, local, plan.grant, run.req.plan.local_evict,
                                     run.received_at)
            finally:
                self.prefills.finish(plan.unit_id, claim, feed.state)
        return logits

    def _policy(self, req: ExecuteRequest) -> CompositionPolicy:
        """The policy the request names (composition.per_request), else this node's."""
        if not req.setting:
            return self.policy
        choice = self.choices.named(req.setting) if self.choices is not None else None
        if choice is None:
            raise ConfigError(f"request {req.request_id} names the composition setting {req.setting!r}, which this "
                              "node has no calibration record for (or composition.per_request is off here): give "
                              "every role the same [composition] and calibration records")
        return choice.policy

    async def _exact_rest(self, run: Run, plans: Iterable[UnitPlan]) -> torch.Tensor:
        """An order-free request served exactly past its prefix hit (the plan's grants go back:
        no unit state is computed); the receipt reads what was computed from the stats."""
        self._give_back(plans)
        run.stats.served_exactly = True
        run.stats.computed_ranges = ((run.matched, run.layout.n_tokens),)
        return await self._extend_whole(run)

    async def _extend_whole(self, run: Run) -> torch.Tensor:
        """Compute everything past the matched prefix, as prefix caching does, and offer the
        whole prompt to the prefix cache (all of it is exact)."""
        prompt, matched = run.layout.token_ids(), run.matched
        run.stats.recomputed_tokens = len(prompt) - matched
        return await self.scheduler.extend(run.slots, prompt[matched:], range(matched, len(prompt)), run.deadline,
                                           insert_prefix=(prompt, run.req.tenant))

    def _give_back(self, plans: Iterable[UnitPlan]) -> None:
        for plan in plans:
            if plan.grant is not None:
                self.retainer.give_back(plan.grant)

    def _reused(self, run: Run, plan: UnitPlan, r: Reused) -> None:
        """A reused state is in place: count it, and retain it off the critical path."""
        stats, n = run.stats, r.state.n_tokens
        if r.peer:  # a forward pass run for this request, on another node
            stats.computed_unit_tokens += n
            stats.computed_units += 1
            stats.bytes_fetched += r.state.nbytes()
            stats.unit_sources[plan.unit_id] = "peer"
        elif r.local:
            stats.local_tokens += n
            stats.local_units += 1
            stats.unit_sources[plan.unit_id] = "local"
        else:
            stats.remote_tokens += n
            stats.remote_units += 1
            stats.bytes_fetched += r.state.nbytes()
            stats.unit_sources[plan.unit_id] = "remote"
        self.retainer.retain(plan.unit_id, r.state, r.keep_local, plan.grant, run.req.plan.local_evict,
                             run.received_at)

    async def _prepare(self, run: Run, plan: UnitPlan, token_ids: Sequence[int], spans: list[Placement],
                       fused: FusedUnits | None, state: UnitState | None,
                       late: UnitState | None = None) -> Reused | None:
        """A reused state for the extend to place, or None: the unit is computed here (and
        placed) or by the extend's own forward. ``state``: what :meth:`_reuse` got for it."""
        stats = run.stats
        n = len(token_ids)
        if state is not None:
            # a local hit is in the local cache already; a fetched one goes there if planned
            local = plan.preparation is Preparation.LOCAL
            return Reused(state, local, plan.retention.local and not local)
        state = self.cache.lookup(plan.unit_id) if plan.preparation is not Preparation.LOCAL else None
        if state is not None:
            # planned as a miss, but another request on this node computed it after this plan
            # was made (the plane learns of local inserts only afterwards): reuse it
            return Reused(state, True, False)
        if late is not None:  # published since the plan, fetched before any preparation began
            return Reused(late, False, plan.retention.local)
        if plan.peer and self.reader is not None:  # fetched once the peer publishes it
            state = await self._late_fetch(self.reader, run, plan, n, until=run.peer_deadline)
            if state is not None:
                return Reused(state, False, plan.retention.local, peer=True)
            await self._compute(run, plan, token_ids, spans)
            return None
        if fused is not None and fused.claim(plan, token_ids, spans, plan.retention.local):
            # computed and placed by the request's own extend, retained after it (_prefill)
            stats.computed_unit_tokens += n
            stats.computed_units += 1
            stats.unit_sources[plan.unit_id] = "computed"
        else:
            await self._compute(run, plan, token_ids, spans)
        return None

    async def _compute(self, run: Run, plan: UnitPlan, token_ids: Sequence[int], spans: Sequence[Placement]) -> None:
        """Prefill the unit (coalesced with anyone computing it already), retain it and place it."""
        stats = run.stats
        state, coalesced = await self.prefills.state(plan.unit_id, token_ids, run.deadline, run.group)
        # a joined prefill is counted as computed by the request that ran it only, so that the
        # cluster's computed tokens count each forward pass once
        if coalesced:
            stats.coalesced_unit_tokens += len(token_ids)
            stats.coalesced_units += 1
            stats.unit_sources[plan.unit_id] = "coalesced"
        else:
            stats.computed_unit_tokens += len(token_ids)
            stats.computed_units += 1
            stats.unit_sources[plan.unit_id] = "computed"
        # retained before it is placed, in the same step as the prefill's return: a request
        # arriving next finds the unit in flight (coalesced) or in the local cache, never neither
        self.retainer.retain(plan.unit_id, state, plan.retention.local, plan.grant, run.req.plan.local_evict,
                             run.received_at)
        await self.scheduler.place(run.slots, spans, {plan.unit_id: state})

    async def _late_fetches(self, run: Run, plans: Sequence[UnitPlan],
                            tokens: Mapping[str, Sequence[int]]) -> dict[str, UnitState]:
        """Misses planned long ago may be READY in the shared tier by now (another node published
        them while this request queued): each is fetched under a lease taken now instead of
        computed (:meth:`_late_fetch`).

        Only on a node with a KV pool client, for a plan at least :data:`LATE_PLAN_S` old, and
        for units with no write grant of their own (with one, nobody else could have published
        the unit) and no prefill in flight here (joining that is cheaper).
        """
        reader = self.reader
        if reader is None or time.monotonic() - run.received_at < LATE_PLAN_S:
            return {}
        asked = [p for p in plans if p.preparation is Preparation.COMPUTE and p.grant is None and not p.peer
                 and p.unit_id not in self.prefills]
        states = await asyncio.gather(*(self._late_fetch(reader, run, p, len(tokens[p.unit_id])) for p in asked))
        return {p.unit_id: s for p, s in zip(asked, states, strict=True) if s is not None}

    async def _late_fetch(self, reader: SharedReader, run: Run, plan: UnitPlan, n: int,
                          until: float = 0.0) -> UnitState | None:
        """The unit under a late lease, or None (not READY, or the plane or the pool failed).

        ``until`` (monotonic): while the unit is not READY, ask again every PEER_POLL_S until
        then (a unit a peer is prefilling); by default ask once."""
        while True:
            try:
                lease = await reader.late_lease(plan.unit_id)
            except ControlPlaneError as exc:
                log.info("no late lease for unit %s (%s); computing it", plan.unit_id, exc)
                return None
            if lease is not None:
                break
            if time.monotonic() >= until:
                if until:
                    log.info("unit %s: peer %s did not publish it in time; computing it", plan.unit_id, plan.peer)
                return None
            await asyncio.sleep(PEER_POLL_S)
        try:
            return await reader.fetch(lease, n, release=False, received_at=time.monotonic())
        except TransferError as exc:
            log.warning("late fetch of unit %s failed (%s); computing it instead", plan.unit_id, exc)
            run.stats.fallbacks += 1
            return None
        finally:
            self.release_lease(lease.lease_id)

    def _peer_deadline(self, n_tokens: int) -> float:
        """Until when a peer's units of ``n_tokens`` tokens in all are awaited (its prefill at
        this node's measured rate, with a margin: see PEER_WAIT_S)."""
        rate = self.scheduler.prefill_tokens_per_s
        wait = PEER_WAIT_S + PEER_WAIT_FACTOR * n_tokens / rate if rate > 0 else PEER_UNMEASURED_S
        return time.monotonic() + wait

    async def _reuse(self, run: Run, plan: UnitPlan, n: int) -> UnitState | None:
        """The unit's state from the local cache or the KV Pool, or None (compute it)."""
        if plan.preparation is Preparation.LOCAL:
            return self.cache.get(plan.unit_id)  # pinned since the snapshot
        if plan.preparation is not Preparation.REMOTE or plan.lease is None:
            return None
        lease = plan.lease
        try:
            if self.reader is None:
                raise TransferError("this node has no KV pool client")
            # the lease's TTL runs from when the plan arrived, not from when this fetch starts
            return await self.reader.fetch(lease, n, release=False, received_at=run.received_at)
        except TransferError as exc:
            log.warning("fetch of unit %s failed (%s); computing it instead", plan.unit_id, exc)
            run.stats.fallbacks += 1
            return None
        finally:
            run.unreleased.discard(lease.lease_id)
            self.release_lease(lease.lease_id)


def _exact_is_cheaper(exact: int, extend: int, spans: Mapping[str, Sequence[Placement]],
                      plans: Mapping[str, UnitPlan], tokens: Mapping[str, Sequence[int]]) -> bool:
    """Whether computing the ``exact`` tokens past the matched prefix costs no more than
    composing them: the ``extend`` tokens the policy computes plus the units this node must
    prefill first and keeps nowhere (planned as misses, not a peer's, retained neither locally
    nor shared). A prefill that is kept is not counted: later requests reuse it at any position,
    which the prefix cache cannot. A tie is served exactly."""
    prefills = sum(len(tokens[uid]) for uid in spans
                   if plans[uid].preparation is Preparation.COMPUTE and not plans[uid].peer
                   and plans[uid].retention is Retention.NEITHER)
    return exact <= extend + prefills


def _logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, tuple[TopLogprob, ...]]:
    """Log-probability of the chosen token and of the k most likely ones (unscaled logits)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[TopLogprob, ...] = ()
    if k > 0:
        values, ids = lp.topk(k)
        top = tuple(TopLogprob(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
    return float(lp[token]), top
