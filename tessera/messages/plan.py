"""The control plane's per-request plan: how each unit is prepared and where it is retained.

The plane issues it (with the read leases and write grants it names) to the retrieval role,
which forwards it to the chosen generation node inside an execute request; the generation node
presents the leases and grants to the memory nodes. The plan never carries tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tessera.messages.common import BlockRef


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
    # a COMPUTE unit that the generation node ``peer`` prefills for this request at the same
    # time (the plan's ``assists``) and publishes: fetch it once READY, compute it on a timeout
    peer: str = ""

    def __post_init__(self) -> None:
        if (self.preparation is Preparation.REMOTE) != (self.lease is not None):
            raise ValueError(f"unit {self.unit_id}: a remote preparation needs a lease and only it has one")
        if self.retention.shared != (self.grant is not None):
            raise ValueError(f"unit {self.unit_id}: a shared retention needs a write grant and only it has one")
        if self.peer and (self.preparation is not Preparation.COMPUTE or self.grant is not None):
            raise ValueError(f"unit {self.unit_id}: a unit a peer computes is planned as COMPUTE, without a grant "
                             "(the peer's plan holds it)")


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
    # with a cluster secret: the leader's MAC over (node, term, request_id) (tessera.auth.plan_seal);
    # a generation node runs no plan, and adopts no term, without it
    seal: str = ""
    # plans for idle generation nodes that prefill some of this request's units at the same
    # time (each of their units COMPUTE under a write grant of that node); the retrieval role
    # sends each to its node (``PrefillRequest``) beside the execute
    assists: tuple[RequestPlan, ...] = ()
