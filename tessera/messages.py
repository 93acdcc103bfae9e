"""Typed messages between roles (paper §5.1, Fig. 10).

One frozen dataclass per message, encoded with :mod:`tessera.wire`. Every top-level message
carries ``version`` so that a node speaking another protocol version is refused with a clear
error instead of being misread. The same types serve the HTTP API, the tests and the bench.

Time values on the wire are *durations* (seconds from receipt), never absolute clock
readings: roles do not share a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tessera.errors import BadRequest
from tessera.wire import WIRE_VERSION


class Preparation(enum.StrEnum):
    """Where the state of a unit comes from for the current request."""

    LOCAL = "local"  # copy from the node's host-memory unit cache
    REMOTE = "remote"  # fetch from the shared KV Pool under a read lease
    COMPUTE = "compute"  # prefill from text


class Retention(enum.StrEnum):
    """Where the state may be kept for future requests (independent of preparation)."""

    LOCAL = "local"
    SHARED = "shared"
    BOTH = "both"
    NEITHER = "neither"

    @property
    def local(self) -> bool:
        return self in (Retention.LOCAL, Retention.BOTH)

    @property
    def shared(self) -> bool:
        return self in (Retention.SHARED, Retention.BOTH)

    @staticmethod
    def of(local: bool, shared: bool) -> Retention:
        if local and shared:
            return Retention.BOTH
        if local:
            return Retention.LOCAL
        if shared:
            return Retention.SHARED
        return Retention.NEITHER


def check_version(version: int) -> None:
    if version != WIRE_VERSION:
        raise BadRequest(f"protocol version {version} is not supported; this node speaks version {WIRE_VERSION}")


@dataclass(frozen=True, slots=True)
class BlockRef:
    """One storage block: a slot index in a memory node's arena."""

    node: str
    index: int


@dataclass(frozen=True, slots=True)
class NodeToken:
    """Capability for a grant's or lease's blocks on one memory node (:func:`tessera.auth.capability`)."""

    node: str
    expires: int  # unix seconds: the cluster's clocks agree within security.max_clock_skew_s
    mac: str  # hex HMAC over (op, node, holder, the blocks' slots in order, epoch, expires)
    holder: str = ""  # the generation node it was issued to; only that node's data connections may use it


@dataclass(frozen=True, slots=True)
class ReadLease:
    """Permission to read a READY shared entry at one storage epoch; blocks stay until released."""

    lease_id: str
    unit_id: str
    epoch: int
    blocks: tuple[BlockRef, ...]
    ttl_s: float
    tokens: tuple[NodeToken, ...] = ()  # one per memory node of ``blocks`` (a cluster with a secret)


@dataclass(frozen=True, slots=True)
class WriteGrant:
    """Reservation of a PENDING shared entry: only ``writer`` may write these blocks and publish."""

    unit_id: str
    epoch: int
    blocks: tuple[BlockRef, ...]
    writer: str
    n_tokens: int
    # writes must start within this many seconds; afterwards the reservation is cancelled
    deadline_s: float
    tokens: tuple[NodeToken, ...] = ()  # one per memory node of ``blocks`` (a cluster with a secret)


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """Per-unit plan: how to prepare the unit now and whether to retain it."""

    unit_id: str
    n_tokens: int
    preparation: Preparation
    retention: Retention
    lease: ReadLease | None = None  # set iff preparation is REMOTE
    grant: WriteGrant | None = None  # set iff retention is SHARED or BOTH

    def __post_init__(self) -> None:
        if (self.preparation is Preparation.REMOTE) != (self.lease is not None):
            raise ValueError(f"unit {self.unit_id}: a remote preparation needs a lease and only it has one")
        if self.retention.shared != (self.grant is not None):
            raise ValueError(f"unit {self.unit_id}: a shared retention needs a write grant and only it has one")


@dataclass(frozen=True, slots=True)
class RequestPlan:
    version: int
    request_id: str
    node: str
    units: tuple[UnitPlan, ...]
    # units the node should drop from its local cache to make room for local retention
    local_evict: tuple[str, ...] = ()
    # the leader term (incarnation) that issued the plan: a node that saw a newer one refuses it
    term: int = 0


# --- prompt layout -------------------------------------------------------------------------


class SegmentKind(enum.StrEnum):
    TEXT = "text"  # request-specific tokens (system prompt, separators, question, template)
    UNIT = "unit"  # a context unit whose state may be reused


@dataclass(frozen=True, slots=True)
class Segment:
    kind: SegmentKind
    token_ids: tuple[int, ...]
    unit_id: str = ""  # set iff kind is UNIT


@dataclass(frozen=True, slots=True)
class PromptLayout:
    """The prompt as an ordered list of segments. Position of a token = its index in the prompt.

    The layout is fixed before any preparation starts; unit states are placed at the offsets
    it implies.
    """

    segments: tuple[Segment, ...]

    @property
    def n_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    def token_ids(self) -> list[int]:
        out: list[int] = []
        for s in self.segments:
            out.extend(s.token_ids)
        return out

    def unit_offsets(self) -> list[tuple[int, Segment]]:
        """(offset, segment) of every unit segment, in prompt order."""
        out: list[tuple[int, Segment]] = []
        offset = 0
        for s in self.segments:
            if s.kind is SegmentKind.UNIT:
                out.append((offset, s))
            offset += len(s.token_ids)
        return out


MAX_TEMPERATURE = 2.0  # OpenAI's bound
# the smallest normal float32: sampling compares top_p with float32 probabilities, so a smaller
# top_p (1e-300) became 0 there and once filtered out every token (a 503); the API refuses it
MIN_TOP_P = 1.1754943508222875e-38
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the generation node picks tokens; built from a client's request only by
    :func:`tessera.retrieval.chat_request.parse_chat_request`, which explains bad values to
    the client. The checks here are the message's invariants (a peer that breaks them gets a
    400 from the wire decoder)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # -1: no logprobs; 0: the chosen token's logprob; k > 0: also the k most likely tokens
    top_logprobs: int = -1

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens = {self.max_tokens} is invalid: expected >= 1")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature = {self.temperature} is invalid: expected 0..{MAX_TEMPERATURE} (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p = {self.top_p} is invalid: expected 0 < top_p <= 1")
        if not -1 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs = {self.top_logprobs} is invalid: expected -1..{MAX_TOP_LOGPROBS}")


# --- control RPCs --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    """Step 3 of the plan: the chosen node reports which of these units it holds locally.

    The node pins the units it reports until the request executes or is aborted.
    """

    version: int
    request_id: str
    unit_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SnapshotResponse:
    version: int
    request_id: str
    node: str
    held: tuple[str, ...]
    inflight: int


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """The retrieval role gives up on a request: the node stops running it, or drops its snapshot's pins."""

    version: int
    request_id: str


@dataclass(frozen=True, slots=True)
class AbortResponse:
    version: int
    request_id: str
    aborted: bool  # a run was in flight and is cancelled; False: at most the snapshot's pins were dropped


@dataclass(frozen=True, slots=True)
class ExecuteRequest:
    """Step 4: the finalized plan and the fixed prompt layout, sent to the chosen node."""

    version: int
    request_id: str
    layout: PromptLayout
    plan: RequestPlan
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = ""  # the namespace of the node's exact-prefix cache (no cross-tenant hits)
    # what is left of control.max_queue_wait_s when the plan is sent (None: no bound): the
    # node refuses the request if its first-token step has not begun within it (see
    # tessera.generation.scheduler, "late starts")
    queue_budget_s: float | None = None


@dataclass(frozen=True, slots=True)
class PublishRequest:
    version: int
    unit_id: str
    epoch: int
    writer: str
    blocks: tuple[BlockRef, ...]


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """The writer gives up a reservation; ``settle_s`` covers transfers that may still land."""

    version: int
    unit_id: str
    epoch: int
    writer: str
    settle_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    version: int
    lease_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class InvalidateRequest:
    """A reader found a shared entry corrupt (checksum mismatch): it must not be leased again."""

    version: int
    unit_id: str
    epoch: int
    reader: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ResidencyReport:
    """A generation node's local cache changed (insertions it made, evictions, declines)."""

    version: int
    node: str
    inserted: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()
    # victims the plan allowed it to evict that it kept (evicting fewer was enough)
    kept: tuple[str, ...] = ()
    # blocks of each inserted unit (parallel to ``inserted``): sent when the node re-reports its
    # whole cache to a control plane that restarted and does not know the units' sizes
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RevokeRequest:
    """Retrieval role -> generation node: these units were deleted; drop their cached states."""

    version: int
    unit_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LoadReport:
    version: int
    node: str
    inflight: int
    queued_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # measured over the node's recent extend batches; 0: not yet


@dataclass(frozen=True, slots=True)
class MemoryNodeHello:
    """A memory node announces itself; a new ``boot_id`` means it restarted empty."""

    version: int
    name: str
    boot_id: str
    capacity_blocks: int
    block_bytes: int
    shm_name: str
    data_host: str
    data_port: int
    # the newest leader term the data port has seen, once no request of an older term is still
    # in progress there (0: none yet); lets the plane end its restart fence early (term_settled)
    term_settled: int = 0


@dataclass(frozen=True, slots=True)
class MemoryNodeHelloAck:
    """The plane's answer to a hello: ``ok``/``reason`` as an :class:`Ack`, plus its term.

    ``term_mac`` is an HMAC of the cluster secret over (memory node, boot id, term)
    (:func:`tessera.auth.term_notice`): a node accepts the term only with a valid one, so a
    forged answer cannot raise its term and fence out the real leader. Empty without a secret.
    """

    version: int
    ok: bool
    reason: str = ""
    term: int = 0
    term_mac: str = ""


@dataclass(frozen=True, slots=True)
class InventoryBlock:
    """One verified block a memory node holds, as its header names it (see transport/blocks.py)."""

    slot: int
    unit_key: str  # hex of the 16-byte unit digest
    epoch: int
    block_index: int
    tokens: int
    unit_tokens: int


@dataclass(frozen=True, slots=True)
class MemoryNodeInventory:
    """A memory node that (re)joined a new control plane reports the blocks it still holds.

    Only blocks whose header and payload checksums verify are listed.
    """

    version: int
    name: str
    boot_id: str
    blocks: tuple[InventoryBlock, ...]


@dataclass(frozen=True, slots=True)
class InventoryResult:
    version: int
    adopted: tuple[str, ...]  # unit ids whose entries are READY again
    # > 0: the node's slots are still fenced (writes of an earlier incarnation may land):
    # scan again and resend after this many seconds
    retry_after_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Ack:
    version: int
    ok: bool
    reason: str = ""


# --- control plane RPCs (route, plan, complete, memory nodes) --------------------------------


@dataclass(frozen=True, slots=True)
class RouteUnit:
    unit_id: str
    n_tokens: int


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """Step 2 (paper Fig. 10): route; the request's units in prompt order (empty in prefix mode)."""

    version: int
    request_id: str
    units: tuple[RouteUnit, ...] = ()
    # nodes this request already failed on (a retry): routed elsewhere
    exclude: tuple[str, ...] = ()
    # the prompt's tokens: the plane answers the first-token deadline on the chosen node
    prompt_tokens: int = 0
    # seconds the request spent before routing (retrieval, tokenizing): counts against the queueing bound
    waited_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RouteResponse:
    version: int
    request_id: str
    node: str
    # seconds the chosen node may take to the first token (tessera.control.pace); 0: not asked
    first_token_s: float = 0.0


@dataclass(frozen=True, slots=True)
class UnitsChanged:
    """A replica that does not lead changed the store: the leader's plane revokes or reinstates."""

    version: int
    revoked: tuple[str, ...] = ()
    reinstated: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """Step 4: finalize against the chosen node's snapshot (the units it holds locally)."""

    version: int
    request_id: str
    node: str
    held: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CompleteRequest:
    """The request finished or was abandoned: its node's in-flight count drops."""

    version: int
    request_id: str


@dataclass(frozen=True, slots=True)
class SuspectRequest:
    """A replica that does not lead could not reach ``node`` (connect, snapshot, execute, silence)."""

    version: int
    node: str


@dataclass(frozen=True, slots=True)
class LivenessRequest:
    """What the leader's heartbeats say of these generation nodes (a follower's deadlines ask)."""

    version: int
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NodeLiveness:
    name: str
    alive: bool  # routable on the leader's plane
    # seconds between the node's last heartbeat and this answer, on the leader's clock; -1: never heard
    heard_s_ago: float


@dataclass(frozen=True, slots=True)
class LivenessReport:
    version: int
    nodes: tuple[NodeLiveness, ...]


@dataclass(frozen=True, slots=True)
class MemoryNodeList:
    version: int
    nodes: tuple[MemoryNodeHello, ...]


# --- the execute stream (generation node -> retrieval role, one NDJSON line per event) ------


@dataclass(slots=True)
class RequestStats:
    """Where one request's prompt tokens came from, and what it generated.

    Mutable on purpose: the executor's concurrent unit preparations add to it while the
    request runs; it crosses the wire once, inside the :class:`DoneEvent`.
    """

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
    # on the node, from the plan's arrival: until the request's first engine step began (its
    # queueing there) and until its first token was sampled (0: not reached)
    node_queued_s: float = 0.0
    node_first_token_s: float = 0.0
    # unit id -> where its state came from: local, remote or computed (prefilled here; also a
    # failed fetch); a unit the final extend recomputes whole is not prepared and not listed
    unit_sources: dict[str, str] = field(default_factory=dict)

    def tokens_by_source(self) -> tuple[tuple[str, int], ...]:
        """Prompt tokens by where their state came from: the ``source`` label of the token metrics."""
        return (("prefix", self.prefix_cached_tokens), ("local", self.local_tokens), ("remote", self.remote_tokens),
                ("computed", self.computed_unit_tokens), ("recomputed", self.recomputed_tokens))

    def units_by_preparation(self) -> tuple[tuple[str, int], ...]:
        return (("local", self.local_units), ("remote", self.remote_units), ("computed", self.computed_units))

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose state was reused (OpenAI's ``usage.prompt_tokens_details.cached_tokens``)."""
        return self.prefix_cached_tokens + self.local_tokens + self.remote_tokens


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token; ``text`` is the text it adds (tokens may end mid-character)."""

    version: int
    token_id: int
    text: str
    logprob: float | None = None  # set iff the request asked for logprobs
    top: tuple[TopLogprob, ...] = ()
    # on the first token only: the prompt's preparation figures, so a reply the caller cuts
    # short (stop string, disconnect) still has its usage
    stats: RequestStats | None = None
    kind: str = "token"


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """The last event of a request that finished: why it stopped and its statistics."""

    version: int
    finish_reason: str  # "stop" or "length"
    stats: RequestStats
    kind: str = "done"


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The last event of a request that failed after its stream started."""

    version: int
    message: str
    kind: str = "error"
    # the node refused the request before any of its work reached the client (its queueing
    # bound ran out): the caller treats it as a 429 (another node may still take it), not as a
    # failed node
    refused: bool = False


ExecuteEvent = TokenEvent | DoneEvent | ErrorEvent
EXECUTE_EVENTS: dict[str, type[ExecuteEvent]] = {"token": TokenEvent, "done": DoneEvent, "error": ErrorEvent}
