"""Requests the control plane answers: routing and planning a request (from the retrieval role),
settling shared entries and reporting residency and load (from generation nodes), and the
replicas' notes to the leader (units changed, suspects, liveness).

The plane's answers that are plans live in :mod:`tessera.messages.plan`; the memory nodes'
messages in :mod:`tessera.messages.kvpool`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.messages.common import BlockRef
from tessera.messages.plan import ReadLease, WriteGrant


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
class RenewRequest:
    """The writer is about to write: extend its reservation, or reserve anew if it lapsed.

    A grant's deadline counts from the plan; on a loaded node the unit may be computed long
    after. ``n_blocks`` is the grant's block count (checked against ``n_tokens``).
    """

    version: int
    unit_id: str
    epoch: int
    writer: str
    n_tokens: int
    n_blocks: int


@dataclass(frozen=True, slots=True)
class RenewResponse:
    """A grant to write under now (the same epoch and blocks, or a new reservation), or why not."""

    version: int
    grant: WriteGrant | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class LateLeaseRequest:
    """A node about to compute a unit its plan said to compute, long after the plan: is it
    READY in the shared tier by now (another node published it meanwhile)?"""

    version: int
    unit_id: str
    holder: str


@dataclass(frozen=True, slots=True)
class LateLeaseResponse:
    version: int
    lease: ReadLease | None  # None: not READY (absent, pending, revoked)


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
class LoadReport:
    version: int
    node: str
    inflight: int
    queued_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # measured over the node's recent extend batches; 0: not yet
    # batches with prompt work the node ran since it started: a waiter sees its queue move
    prompt_batches: int = 0


@dataclass(frozen=True, slots=True)
class UnitsChanged:
    """A replica that does not lead changed the store: the leader's plane revokes or reinstates."""

    version: int
    revoked: tuple[str, ...] = ()
    reinstated: tuple[str, ...] = ()


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
    # seconds since its heartbeats last showed a batch of prompt work run; -1: never
    progressed_s_ago: float = -1.0


@dataclass(frozen=True, slots=True)
class LivenessReport:
    version: int
    nodes: tuple[NodeLiveness, ...]
