"""The control plane: routing, two-step per-unit plans, and the shared tier's bookkeeping.

Steps as numbered in the paper's Fig. 10 (step 1, retrieval, happens before the plane is
asked): 2. ``route`` picks a generation node; 3. that node answers a snapshot of the units
it holds (and pins); 4. ``finalize`` makes the per-unit plan (:mod:`tessera.control.planner`).
``complete`` ends a request; one never completed expires after ``control.request_ttl_s``.

A *revoked* unit (deleted or replaced) is computed from text and retained nowhere by every
later plan, whatever a node's snapshot says; its shared entry takes no new lease and goes
once its leases drain.

The plane never touches payload bytes or tensors and never waits on the network: every
method is synchronous and cheap enough to run on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from tessera.auth import CapabilityIssuer, ClusterAuth, term_notice
from tessera.config import ClusterConfig
from tessera.control.admission import make_admission
from tessera.control.allocator import BlockAllocator
from tessera.control.directory import Directory
from tessera.control.fleet import Fleet, bits
from tessera.control.local import AdmittedBlocks, LocalTier
from tessera.control.locality import Locality, spread
from tessera.control.membership import GenerationMember, HelloOutcome, Liveness, MemoryNodes
from tessera.control.overload import QueueBound
from tessera.control.pace import PrefillRates
from tessera.control.planner import Planner
from tessera.control.recovery import Reassembly
from tessera.control.requests import RequestTable, RoutedRequest
from tessera.control.router import make_router
from tessera.control.shared import SharedTier
from tessera.control.stats import PlaneStats
from tessera.errors import BadRequest, Unavailable
from tessera.messages.common import Ack
from tessera.messages.control import (
    CancelRequest,
    InvalidateRequest,
    LateLeaseRequest,
    LateLeaseResponse,
    LoadReport,
    PublishRequest,
    ReleaseRequest,
    RenewRequest,
    RenewResponse,
    ResidencyReport,
)
from tessera.messages.kvpool import InventoryResult, MemoryNodeHello, MemoryNodeHelloAck, MemoryNodeInventory
from tessera.messages.plan import RequestPlan
from tessera.metrics import Metric, gauge
from tessera.transport.terms import TERM_SHIFT
from tessera.units import blocks_for
from tessera.wire import WIRE_VERSION

log = logging.getLogger(__name__)

class ControlPlane:
    """Facade over directory, tiers, router and membership. See the module docstring."""

    def __init__(
        self,
        config: ClusterConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        admission: str | None = None,
        routing: str | None = None,
    ) -> None:
        control = config.control
        admission = admission or control.admission
        self.config = config
        self.block_tokens = config.block_tokens
        self.clock = clock
        self.heartbeat_timeout_s = control.heartbeat_timeout_s
        self.allocator = BlockAllocator()
        self.directory = Directory(
            self.allocator,
            lease_ttl_s=control.lease_ttl_s,
            write_timeout_s=control.write_timeout_s,
            # longer than any transfer can still be in flight (transfers time out first)
            reclaim_grace_s=max(10.0, 2 * config.transport.timeout_s),
            clock=clock,
            capabilities=CapabilityIssuer(secret) if (secret := ClusterAuth.from_config(config).secret) else None,
        )
        self.shared = SharedTier(self.directory, make_admission(admission, control))
        self.locality = Locality(len(config.generation))  # which nodes' local views hold each unit
        self.queue_bound = QueueBound(control.max_queue_wait_s)
        # only tcp checks every access's capability; with shm or mooncake the writer touches the arena
        self._terms_enforced = config.transport.name == "tcp" and self.directory.capabilities is not None
        self.fences_lifted = 0  # restart fences ended early by term (hello with term_settled)
        self.suspected = 0  # nodes the serving layer (this replica's or a follower's) could not reach
        self.fleet = Fleet(len(config.generation), control.max_queue_wait_s)
        self.nodes: dict[str, GenerationMember] = {
            g.name: GenerationMember(g.name, i, LocalTier(g.name, g.local_capacity_blocks,
                                                        make_admission(admission, control),
                                                        bit=1 << i, locality=self.locality), self.fleet,
                                     block_tokens=self.block_tokens)
            for i, g in enumerate(config.generation)
        }
        self._members = list(self.nodes.values())  # by index
        self.liveness = Liveness(self.nodes, self.fleet)
        self.router = make_router(routing or control.routing, len(self.nodes))
        self.rates = PrefillRates(self.block_tokens)  # what a block of prefill costs: the router's exchange rate
        self.memory = MemoryNodes({k.name: k.capacity_blocks for k in config.kvpools})
        self.stats = PlaneStats()
        self.invalidated = 0  # shared entries a reader found corrupt
        self.grants_renewed = 0  # write grants extended as their writer started (renew)
        self.grants_reissued = 0  # ... reserved anew: the first one had lapsed
        self.late_leases = 0  # units planned as misses found READY when their node got to them
        self.requests = RequestTable(control.request_ttl_s)
        self.revoked: set[str] = set()  # deleted units: never LOCAL, REMOTE or retained
        self.admitted = AdmittedBlocks()  # block counts of local admissions, for the views' reports
        # assists need a shared tier: the serving node reads a helper's units from the KV pool
        assist = control.assist_min_tokens if config.kvpools and control.mode == "compose" else 0
        self.planner = Planner(self.directory, self.shared, self.requests, self.admitted, self.stats, self.revoked,
                               helper=self._idle_helper, assist_min_tokens=assist)
        self._reassembly = Reassembly(self.block_tokens)  # recovery: reported blocks, not complete yet
        self._draining: set[str] = set()  # revoked units whose shared entry waits for its leases

    # --- the request path ----------------------------------------------------------------

    @property
    def routable(self) -> bool:
        """Whether :meth:`route` has a node to choose now (some generation node is alive)."""
        return self.fleet.alive != 0

    def route(self, request_id: str, units: Sequence[tuple[str, int]], exclude: Collection[str] = (),
              waited_s: float = 0.0) -> str:
        """Step 2: choose the generation node for a request's (unit_id, n_tokens) list.

        ``exclude``: nodes this request already tried (a retry goes elsewhere). ``waited_s``:
        the time since the request arrived (it counts against the queueing bound).
        Raises Overloaded (429) when every node's expected queueing exceeds what is left of
        ``max_queue_wait_s``.
        """
        self.requests.check_new(request_id)
        tokens: dict[str, int] = {}
        for u, n in units:
            if u not in tokens:
                if n <= 0:
                    raise BadRequest(f"unit {u}: n_tokens must be > 0, got {n}")
                tokens[u] = n
        fleet = self.fleet
        eligible = fleet.alive
        if exclude:
            nodes = self.nodes
            for name in exclude:
                if name in nodes:
                    eligible &= ~(1 << nodes[name].index)
        if not eligible:
            tried = f" (tried: {', '.join(sorted(exclude))})" if exclude else ""
            raise Unavailable(f"no generation node is alive{tried}; retry when one reports in")
        eligible = self.queue_bound.admit_mask(fleet, eligible, waited_s)
        b = self.block_tokens
        pairs = tuple([(u, -(-n // b)) for u, n in tokens.items()])
        router = self.router
        node = self._members[router.pick(fleet, eligible, self._holders(pairs) if router.uses_locality else {},
                                         self.rates.block_s)]
        self.requests.add(request_id, RoutedRequest(node, tokens, pairs, self.clock()))
        return node.name

    def _idle_helper(self, node: GenerationMember) -> GenerationMember | None:
        """An alive node other than ``node`` with nothing routed to it and no assist to do."""
        for i in bits(self.fleet.at(0) & ~(1 << node.index)):  # nothing routed there
            m = self._members[i]
            if m.idle:
                return m
        return None

    def _holders(self, pairs: tuple[tuple[str, int], ...]) -> dict[int, int]:
        """Holder masks -> blocks of the request's units that the shared tier does not hold ready
        (all of them for a router that ``counts_shared``): a shared unit is a copy away from
        every node, so holding it locally does not make a node a better place."""
        return self.locality.holders(pairs, None if self.router.counts_shared else self.directory.ready)

    def _local_blocks(self, pairs: tuple[tuple[str, int], ...]) -> list[int]:
        """:meth:`_holders` as blocks per node index (the exhaustive routers' ``local_blocks``)."""
        return spread(self._holders(pairs), len(self._members))

    def started(self, request_id: str) -> None:
        """The request's node sent its first event (the end of its queueing): measures the node."""
        self.requests.started(request_id, self.clock())

    def finalize(self, request_id: str, node: str, held: Collection[str]) -> RequestPlan:
        """Step 4: the per-unit plan against the node's snapshot ``held`` (see :class:`Planner`)."""
        return self.planner.plan(request_id, node, held)

    def complete(self, request_id: str) -> bool:
        """The request finished (or was abandoned); False if it was not outstanding."""
        return self.requests.complete(request_id)

    def suspect(self, name: str) -> None:
        """The serving layer could not reach the node (connect, snapshot, execute, deadline).

        It leaves routing at once, like a node whose heartbeats stopped; its next heartbeat
        brings it back (with its local view re-learned from snapshots).
        """
        node = self.generation_node(name)
        self.suspected += 1
        if node.alive:
            self._declare_dead(node)

    # --- reports from generation nodes ---------------------------------------------------

    def publish(self, msg: PublishRequest) -> Ack:
        """Writer finished all blocks: PENDING -> READY. Raises PublishRejected with the reason."""
        try:
            self.directory.publish(msg.unit_id, msg.epoch, msg.writer, msg.blocks)
        finally:
            self.shared.forget((msg.unit_id,))  # an expired reservation is dropped by the attempt
        return Ack(WIRE_VERSION, True)

    def cancel(self, msg: CancelRequest) -> Ack:
        if self.directory.cancel(msg.unit_id, msg.epoch, msg.writer, msg.settle_s):
            self.shared.forget((msg.unit_id,))
            return Ack(WIRE_VERSION, True)
        return Ack(WIRE_VERSION, False, f"unit {msg.unit_id}: no pending reservation at epoch {msg.epoch} "
                   f"for writer {msg.writer!r} (already published, expired or cancelled)")

    def renew(self, msg: RenewRequest) -> RenewResponse:
        """A writer about to write: its reservation extended, or a new one if it lapsed.

        A lapsed reservation (overdue, expired, or lost with a leader change) is admitted
        again as if planned now, so a unit computed late on a busy node is still kept; a unit
        with another entry (written or being written by someone else) or revoked gets none.
        """
        if msg.n_tokens <= 0 or msg.n_blocks != blocks_for(msg.n_tokens, self.block_tokens):
            return RenewResponse(WIRE_VERSION, None, f"unit {msg.unit_id}: {msg.n_blocks} blocks do not hold "
                                 f"{msg.n_tokens} tokens of {self.block_tokens}")
        grant = self.directory.renew(msg.unit_id, msg.epoch, msg.writer)
        if grant is not None:
            self.grants_renewed += 1
            return RenewResponse(WIRE_VERSION, grant)
        self.shared.forget(self.directory.expire())  # an overdue reservation goes now, not at the next tick
        if msg.unit_id in self.revoked or msg.writer not in self.nodes:
            return RenewResponse(WIRE_VERSION, None, f"unit {msg.unit_id}: revoked, or {msg.writer!r} is not "
                                 "a generation node of this cluster")
        grant = self.shared.admit(msg.unit_id, msg.n_tokens, msg.n_blocks, msg.writer)
        if grant is None:
            return RenewResponse(WIRE_VERSION, None, f"unit {msg.unit_id}: the shared tier has it already "
                                 "or no room for it")
        self.grants_reissued += 1
        return RenewResponse(WIRE_VERSION, grant)

    def late_lease(self, msg: LateLeaseRequest) -> LateLeaseResponse:
        """A read lease on a unit now READY that a plan (made before it was) said to compute."""
        if msg.holder not in self.nodes or msg.unit_id in self.revoked:
            return LateLeaseResponse(WIRE_VERSION, None)
        lease = self.directory.lease(msg.unit_id, msg.holder)
        self.late_leases += lease is not None
        return LateLeaseResponse(WIRE_VERSION, lease)

    def release(self, msg: ReleaseRequest) -> Ack:
        unknown = [lease for lease in msg.lease_ids if not self.directory.release(lease)]
        if self._draining:
            self._forget_drained()
        return Ack(WIRE_VERSION, True, f"already released or expired: {', '.join(unknown)}" if unknown else "")

    def invalidate(self, msg: InvalidateRequest) -> Ack:
        """A reader's checksum failed on a shared entry: never lease it again, quarantine its blocks."""
        if self.directory.invalidate(msg.unit_id, msg.epoch):
            self.shared.forget((msg.unit_id,))
            self.invalidated += 1
            return Ack(WIRE_VERSION, True)
        return Ack(WIRE_VERSION, False, f"unit {msg.unit_id}: no ready entry at epoch {msg.epoch} "
                   "(already dropped or rewritten)")

    def residency(self, msg: ResidencyReport) -> Ack:
        node = self.generation_node(msg.node)
        self.liveness.heard(node, self.clock())
        self.admitted.reported(zip(msg.inserted, msg.blocks, strict=False))  # a resync after this plane restarted
        node.local.drop(msg.evicted)
        node.local.keep(msg.kept)
        revoked = self.revoked
        node.local.confirm([u for u in msg.inserted if u not in revoked] if revoked else msg.inserted,
                           self.admitted)
        return Ack(WIRE_VERSION, True)

    def load(self, msg: LoadReport) -> Ack:
        """Load figures and the generation node's heartbeat."""
        node = self.generation_node(msg.node)
        resync, node.resync = node.resync, False
        now = self.clock()
        self.liveness.heard(node, now)
        self.rates.report(node.prefill_tokens_per_s, msg.prefill_tokens_per_s)
        node.reported(msg.queued_tokens, msg.prefill_tokens_per_s, msg.prompt_batches, now)
        # a view cleared or never filled would re-learn from snapshots only the units asked again
        return Ack(WIRE_VERSION, True, "resync" if resync else "")

    def generation_node(self, name: str) -> GenerationMember:
        node = self.nodes.get(name)
        if node is None:
            raise BadRequest(f"unknown generation node {name!r}; the config declares: {', '.join(self.nodes)}", 404)
        return node

    # --- revocation ----------------------------------------------------------------------

    def revoke(self, unit_ids: Collection[str]) -> None:
        """These units were deleted or replaced: no plan made from now on may use their KV.

        The caller tells the generation nodes to drop their copies (best effort: plans
        ignore a node's copy of a revoked unit anyway).
        """
        fresh = [u for u in unit_ids if u not in self.revoked]
        self.revoked.update(fresh)
        directory = self.directory
        dropped = []
        for u in fresh:
            if directory.revoke(u):
                dropped.append(u)
            elif u in directory:
                self._draining.add(u)
        self.admitted.forget(fresh)
        self.planner.forget(fresh)
        self.shared.forget(dropped)
        for gen in self.nodes.values():
            gen.local.revoke(fresh)

    def reinstate(self, unit_ids: Collection[str]) -> None:
        """These units were ingested again (same scope and tokens): they may be cached again."""
        self.revoked.difference_update(unit_ids)

    def begin_incarnation(self, incarnation: int) -> None:
        """This plane is the ``incarnation``-th start of its data directory (1 = the first).

        Storage epochs start above every epoch an earlier incarnation could have granted, and
        if there was one, every memory node's slots are fenced until no write or read under
        its grants and leases can still be in flight.
        """
        directory = self.directory
        directory.begin_epochs(incarnation << TERM_SHIFT)
        if incarnation > 1:
            until = self.clock() + max(directory.write_timeout_s, directory.lease_ttl_s) + directory.reclaim_grace_s
            for k in self.config.kvpools:
                directory.fence(k.name, until)

    def _forget_drained(self) -> None:
        directory = self.directory
        drained = [u for u in self._draining if u not in directory]
        self._draining.difference_update(drained)
        self.shared.forget(drained)

    # --- memory nodes --------------------------------------------------------------------

    def hello(self, msg: MemoryNodeHello) -> MemoryNodeHelloAck:
        """Register a memory node's arena; a new boot id means it restarted empty.

        The answer carries this plane's term, signed for that node and boot. A node that
        refuses every older term (tcp with a secret) and has none in progress (``term_settled``)
        can no longer see a stale write or read, so its restart fence ends at once.
        """
        directory = self.directory
        outcome = self.memory.hello(msg, self.clock())
        if outcome is HelloOutcome.RESTARTED:
            self.shared.forget(directory.drop_node(msg.name))
        if outcome is not HelloOutcome.HEARTBEAT:
            directory.add_node(msg.name, msg.capacity_blocks)
        term = directory.term
        if (self._terms_enforced and term and msg.term_settled >= term
                and directory.fenced_for(msg.name) > 0):
            released = directory.lift_fence(msg.name)
            if released is not None:
                self.fences_lifted += 1
                log.info("memory node %s refuses every term before %d: its restart fence ends now "
                         "(%d blocks back)", msg.name, term, released)
        issuer = directory.capabilities
        mac = term_notice(issuer.secret, msg.name, msg.boot_id, term) if issuer is not None and term else ""
        return MemoryNodeHelloAck(WIRE_VERSION, True, outcome.value, term, mac)

    def adopt(self, msg: MemoryNodeInventory, units: Mapping[str, tuple[str, int]]) -> InventoryResult:
        """Recovery: rebuild READY entries from the verified blocks a memory node still holds.

        ``units`` maps a unit key (hex digest) to (unit_id, n_tokens) for the units still in
        the store. Blocks of units that are gone, revoked or incomplete are left free.
        """
        if self.memory.boot_id(msg.name) != msg.boot_id:
            raise BadRequest(f"memory node {msg.name!r} (boot {msg.boot_id}) must say hello before its inventory", 409)
        wait = self.directory.fenced_for(msg.name)
        if wait > 0:
            return InventoryResult(WIRE_VERSION, (), wait)
        revoked, directory = self.revoked, self.directory
        found = ((blk, units.get(blk.unit_key)) for blk in msg.blocks)
        self._reassembly.add(msg.name, ((blk, *u) for blk, u in found
                                        if u is not None and u[0] not in revoked and u[0] not in directory))
        adopted: list[str] = []
        for unit_id, epoch, blocks, n in self._reassembly.complete():
            if unit_id not in revoked and self.shared.adopt(unit_id, epoch, blocks, n):
                adopted.append(unit_id)
        return InventoryResult(WIRE_VERSION, tuple(adopted))

    def memory_nodes(self) -> list[MemoryNodeHello]:
        return self.memory.hellos()

    # --- time ----------------------------------------------------------------------------

    def tick(self) -> None:
        """Periodic: expire leases and reservations, declare silent nodes dead."""
        now = self.clock()
        self.shared.forget(self.directory.expire())
        for name in self.memory.silent(now, self.heartbeat_timeout_s):
            self.shared.forget(self.directory.drop_node(name))
        for node in self.liveness.silent(now, self.heartbeat_timeout_s):
            self._declare_dead(node)
        self._expire_requests(now)
        if self._draining:
            self._forget_drained()

    def _expire_requests(self, now: float) -> None:
        """Forget requests never completed within ``request_ttl_s`` (see :mod:`tessera.control.requests`)."""
        expired = self.requests.expire(now)
        if expired:
            for node in self.nodes.values():
                node.local.abandon(expired)

    def _declare_dead(self, node: GenerationMember) -> None:
        self.liveness.down(node)
        self.shared.forget(self.directory.forget_holder(node.name))
        node.local.clear()
        node.resync = True

    def report(self) -> dict[str, object]:
        """Plan counters, shared-tier and per-node occupancy (``GET /control/stats``)."""
        return {
            "plans": self.stats.snapshot(),
            "shared_entries": len(self.directory),
            "shared_free_blocks": self.allocator.free_blocks,
            "shared_capacity_blocks": self.allocator.capacity,
            "shared_evictions": self.shared.evictions,
            "expired_requests": self.requests.expired,
            "invalidated_entries": self.invalidated,
            "grants_renewed": self.grants_renewed,
            "grants_reissued": self.grants_reissued,
            "late_leases": self.late_leases,
            "refused_overload": self.queue_bound.refused,
            "fences_lifted_by_term": self.fences_lifted,
            "nodes_suspected": self.suspected,
            "nodes": {
                n.name: {"alive": n.alive, "inflight": n.inflight, "local_units": len(n.local.policy),
                         "local_used_blocks": n.local.used_blocks, "local_capacity_blocks": n.local.capacity}
                for n in self.nodes.values()
            },
        }

    def metrics(self) -> list[Metric]:
        """The plane's occupancy gauges, read when ``/metrics`` is scraped."""
        nodes = self.nodes.values()
        return [
            gauge("tessera_shared_entries", "Units in the shared KV pool directory", len(self.directory)),
            gauge("tessera_shared_free_blocks", "Free blocks in the shared KV pool", self.allocator.free_blocks),
            gauge("tessera_node_inflight", "In-flight requests per generation node (control plane view)",
                  {n.name: n.inflight for n in nodes}, label="node"),
            gauge("tessera_node_queued_tokens", "Tokens queued on each generation node (from its heartbeat)",
                  {n.name: n.queued_tokens for n in nodes}, label="node"),
        ]

    def check_invariants(self) -> None:
        """Every structural invariant of the plane (used by the property tests)."""
        self.directory.check_invariants()
        self.shared.check_invariants()
        for node in self.nodes.values():
            node.local.check_invariants()
        self.requests.check_invariants(list(self.nodes.values()))
        self.fleet.check_invariants()
