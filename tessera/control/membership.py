"""Cluster membership as the control plane sees it: generation nodes and memory nodes.

A generation node is routable only once heard from, and dead when silent past
``control.heartbeat_timeout_s`` or unreachable: after a restart of the plane, a node that
died meanwhile must not attract traffic. A memory node exists once it said hello; a new
``boot_id`` from a known node means it restarted with an empty arena.

This module records who is there; the plane decides what a departure means.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from tessera.control.fleet import Fleet
from tessera.control.local import LocalTier
from tessera.errors import BadRequest
from tessera.messages.kvpool import MemoryNodeHello

MAX_SLOT_BYTES = 1 << 28  # one block of B tokens of the largest models is far below this
SERVICE_WINDOW = 32  # service-time samples averaged: more than the requests one engine batch starts


@dataclass(slots=True, eq=False)
class GenerationMember:
    """Routing and liveness state of one generation node."""

    name: str
    index: int  # position in the config: round-robin order
    local: LocalTier
    fleet: Fleet  # told of every change of inflight and of the expected wait (the routing index)
    inflight: int = 0  # requests routed here and not completed (the plane's own count)
    alive: bool = False  # routable: heard from, and not silent or unreachable since
    last_seen: float | None = None  # None: never heard from
    resync: bool = True  # the plane's view of its cache is incomplete: the next ack asks for all of it
    queued_tokens: int = 0  # the node's own figures from its last LoadReport (metrics)
    prefill_tokens_per_s: float = 0.0  # the node's measured prefill rate (0: not measured yet)
    prompt_batches: int = 0  # the node's count of batches with prompt work, from its last LoadReport
    progressed_at: float | None = None  # when a heartbeat last showed that count move (None: never)
    waiting: dict[str, float] = field(default_factory=dict)  # routed, no first token yet: id -> when routed
    service_s: float = 0.0  # mean of the last SERVICE_WINDOW samples; 0 until a first request started
    last_start: float = float("-inf")
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SERVICE_WINDOW))
    block_tokens: int = 0  # the plane's block size: prices the blocks queued here (0: count only)
    pending: dict[str, int] = field(default_factory=dict)  # waiting requests -> blocks they compute here
    pending_blocks: int = 0  # their sum
    # blocks of the requests behind the last SERVICE_WINDOW samples, and their mean
    sampled_blocks: deque[int] = field(default_factory=lambda: deque(maxlen=SERVICE_WINDOW))
    sampled_mean: float = 0.0
    # other nodes' requests whose units this node prefills for them (plan assists) -> blocks
    assists: dict[str, int] = field(default_factory=dict)
    assist_blocks: int = 0  # their sum

    @property
    def idle(self) -> bool:
        """Nothing routed here and no other node's units to prefill: free to help another node."""
        return self.inflight == 0 and not self.assists

    def assist(self, request_id: str, blocks: int) -> None:
        """It prefills ``blocks`` blocks of another node's request ``request_id`` (until :meth:`assisted`)."""
        if request_id not in self.assists:
            self.assists[request_id] = blocks
            self.assist_blocks += blocks
            self.fleet.update(self, self.inflight)

    def assisted(self, request_id: str) -> None:
        """The assisted request reached its first token or ended: its units here are done or moot."""
        blocks = self.assists.pop(request_id, None)
        if blocks is not None:
            self.assist_blocks -= blocks
            self.fleet.update(self, self.inflight)

    def routed(self, request_id: str, now: float) -> None:
        """A request was routed here: in flight, and queued until its first event."""
        self.inflight += 1
        self.waiting[request_id] = now
        self.fleet.update(self, self.inflight - 1)

    def computes(self, request_id: str, blocks: int) -> None:
        """Its plan: the request computes ``blocks`` blocks of its units here (queued prefill)."""
        if blocks and request_id in self.waiting and request_id not in self.pending:
            self.pending[request_id] = blocks
            self.pending_blocks += blocks
            self.fleet.update(self, self.inflight)

    def left(self, request_id: str) -> None:
        """A request routed here completed or expired."""
        self.inflight -= 1
        self.waiting.pop(request_id, None)
        self.pending_blocks -= self.pending.pop(request_id, 0)
        self.fleet.update(self, self.inflight + 1)

    def expected_wait_s(self) -> float:
        """Queueing a new request would see here: the requests ahead of it times the measured
        time each takes to reach its first token (0 while nothing was measured yet), corrected
        by the prefill they need beyond what the measured ones needed.

        Requests differ: one whose units are all cached is a step from its first token, one
        that computes its units costs many. A node's queue of the latter is longer than its
        count says, and the node's recent starts (mostly the cheap ones, which go first) do
        not show it; counting only requests leaves such a node draining its backlog while the
        others idle. So the blocks the waiting requests compute, less the mean of the sampled
        ones, are priced at the node's reported prefill rate, and so are the blocks it prefills
        for other nodes' requests (assists).
        """
        wait = len(self.waiting) * self.service_s
        if self.block_tokens and self.prefill_tokens_per_s > 0:
            beyond = self.pending_blocks - len(self.waiting) * self.sampled_mean + self.assist_blocks
            wait += beyond * self.block_tokens / self.prefill_tokens_per_s
        return max(0.0, wait)

    def started(self, request_id: str, now: float) -> None:
        """A request routed here sent its first event: one service-time sample.

        The sample is the time it held the head of the queue, ``start - max(routed, previous
        start)``; batched requests give short samples, so the mean follows the node's real
        throughput as the clients see it. It is a plain mean over a window longer than a
        batch: a batch's starts arrive as one long sample then near-zeros, and an
        order-weighted average would let those zeros drag the estimate down.
        """
        routed = self.waiting.pop(request_id, None)
        if routed is None:
            return
        blocks = self.pending.pop(request_id, 0)
        self.pending_blocks -= blocks
        sample = max(0.0, now - max(routed, self.last_start))
        self.last_start = now
        self.samples.append(sample)
        self.service_s = sum(self.samples) / len(self.samples)
        self.sampled_blocks.append(blocks)
        self.sampled_mean = sum(self.sampled_blocks) / len(self.sampled_blocks)
        self.fleet.update(self, self.inflight)

    def reported(self, queued_tokens: int, prefill_tokens_per_s: float, prompt_batches: int, now: float) -> None:
        """The node's own load figures (a heartbeat): its measured rate prices queued blocks, and
        a count of prompt batches that moved since the last one shows its queue draining."""
        self.queued_tokens = queued_tokens
        self.prefill_tokens_per_s = prefill_tokens_per_s
        if prompt_batches != self.prompt_batches:  # a restarted node counts from 0 again: moved too
            self.prompt_batches = prompt_batches
            self.progressed_at = now
        self.fleet.update(self, self.inflight)


class Liveness:
    """Which generation nodes are routable: heard from, and not silent or unreachable since.

    Verbs: ``heard`` (any report), ``down`` (silent or unreachable), ``silent``. The plane
    decides what a departure means for the directory and the node's local view. Routing
    reads the alive nodes from ``fleet`` (bitmasks); ``live`` lists them for everything else.
    """

    def __init__(self, nodes: Mapping[str, GenerationMember], fleet: Fleet) -> None:
        self._nodes = nodes
        self.fleet = fleet
        self.live: list[GenerationMember] = []  # alive nodes in config order, rebuilt on each change

    def heard(self, node: GenerationMember, now: float) -> None:
        node.last_seen = now
        if not node.alive:
            node.alive = True
            self.live = [n for n in self._nodes.values() if n.alive]
            self.fleet.join(node)

    def down(self, node: GenerationMember) -> None:
        if node.alive:
            self.fleet.leave(node)
        node.alive = False
        self.live = [n for n in self._nodes.values() if n.alive]

    def silent(self, now: float, timeout_s: float) -> list[GenerationMember]:
        """The alive nodes last heard more than ``timeout_s`` before ``now``."""
        return [n for n in self._nodes.values()
                if n.alive and n.last_seen is not None and now - n.last_seen > timeout_s]


class HelloOutcome(enum.Enum):
    JOINED = "joined"  # first hello (or first since it was declared dead)
    RESTARTED = "restarted"  # known node, new boot id: its arena is empty now
    HEARTBEAT = "heartbeat"


@dataclass(slots=True)
class MemoryMember:
    hello: MemoryNodeHello
    last_seen: float


class MemoryNodes:
    """Registered memory nodes and their last heartbeat. Verbs: ``hello``, ``silent``."""

    def __init__(self, configured: set[str] | dict[str, int]) -> None:
        # name -> capacity_blocks from the config (a bare set: capacities are not checked)
        self.capacities = configured if isinstance(configured, dict) else dict.fromkeys(configured, 0)
        self.configured = set(self.capacities)
        self._nodes: dict[str, MemoryMember] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def boot_id(self, name: str) -> str | None:
        node = self._nodes.get(name)
        return None if node is None else node.hello.boot_id

    def hellos(self) -> list[MemoryNodeHello]:
        return [n.hello for n in self._nodes.values()]

    def hello(self, msg: MemoryNodeHello, now: float) -> HelloOutcome:
        """Record a hello; raises BadRequest for an unknown name or a capacity change without restart."""
        if msg.name not in self.configured:
            known = ", ".join(sorted(self.configured)) or "none"
            raise BadRequest(f"unknown memory node {msg.name!r}; the config declares: {known}", 404)
        if msg.capacity_blocks <= 0 or msg.block_bytes <= 0:
            raise BadRequest(f"memory node {msg.name!r}: capacity_blocks and block_bytes must be > 0")
        # a hello's claims size the allocator: only what the config gives the node is believed
        configured = self.capacities[msg.name]
        if configured and msg.capacity_blocks != configured:
            raise BadRequest(f"memory node {msg.name!r} claims {msg.capacity_blocks} blocks; the config gives it "
                             f"{configured} (kvpools.{msg.name}.capacity_blocks)")
        if msg.block_bytes > MAX_SLOT_BYTES:
            raise BadRequest(f"memory node {msg.name!r} claims {msg.block_bytes}-byte slots; at most "
                             f"{MAX_SLOT_BYTES} are plausible")
        known_node = self._nodes.get(msg.name)
        if known_node is None:
            self._nodes[msg.name] = MemoryMember(msg, now)
            return HelloOutcome.JOINED
        if known_node.hello.boot_id != msg.boot_id:
            self._nodes[msg.name] = MemoryMember(msg, now)
            return HelloOutcome.RESTARTED
        # the arena is fixed for a boot; term_settled is news, not layout
        if dataclasses.replace(known_node.hello, term_settled=msg.term_settled) != msg:
            raise BadRequest(
                f"memory node {msg.name!r} changed its arena (capacity, block size or address) "
                "without a new boot_id; restart it to change its layout", 409
            )
        known_node.last_seen = now
        return HelloOutcome.HEARTBEAT

    def silent(self, now: float, timeout_s: float) -> list[str]:
        """Remove and return the nodes whose last hello is older than ``timeout_s``."""
        gone = [name for name, n in self._nodes.items() if now - n.last_seen > timeout_s]
        for name in gone:
            del self._nodes[name]
        return gone
