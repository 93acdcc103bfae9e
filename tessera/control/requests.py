"""The plane's table of routed requests, between ``route`` and ``complete``, and their in-flight counts.

A request never completed (its caller died) expires after ``control.request_ttl_s``, or it
would pin its node's in-flight count and its plan's admissions forever.

Invariant: a node's ``inflight`` is the number of requests in the table routed to it.
"""

from __future__ import annotations

from tessera.control.membership import GenerationMember
from tessera.errors import BadRequest


class RoutedRequest:
    """A request between route and complete."""

    __slots__ = ("finalized", "helper", "node", "pairs", "routed_at", "tokens")

    def __init__(self, node: GenerationMember, tokens: dict[str, int], pairs: tuple[tuple[str, int], ...],
                 routed_at: float = 0.0) -> None:
        self.node = node
        self.routed_at = routed_at  # clock of the plane at route: a request never completed expires
        self.tokens = tokens  # distinct unit -> n_tokens, in first-occurrence order
        self.pairs = pairs  # (unit, blocks), same order
        self.finalized = False
        self.helper: GenerationMember | None = None  # the node its plan asked to prefill some of its units


class RequestTable:
    """Routed requests by id, in route order; verbs ``check_new / add / claim_plan / complete / expire``."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._requests: dict[str, RoutedRequest] = {}
        self.expired = 0  # routed, never completed, forgotten after ttl_s

    def __contains__(self, request_id: object) -> bool:
        """The request is outstanding: routed, and neither completed nor expired."""
        return request_id in self._requests

    def check_new(self, request_id: str) -> None:
        """Raise 409 if ``request_id`` is already routed (checked before any routing work)."""
        if request_id in self._requests:
            raise BadRequest(f"request {request_id!r} is already routed; use a new request id", 409)

    def add(self, request_id: str, r: RoutedRequest) -> None:
        """The request was routed to ``r.node``: it counts as in flight there until completed or expired."""
        assert request_id not in self._requests, request_id
        r.node.routed(request_id, r.routed_at)
        self._requests[request_id] = r

    def started(self, request_id: str, now: float) -> None:
        """The request's node sent its first event: its queueing is over (a service-time sample)."""
        r = self._requests.get(request_id)
        if r is not None:
            r.node.started(request_id, now)
            if r.helper is not None:
                r.helper.assisted(request_id)

    def claim_plan(self, request_id: str, node: str) -> RoutedRequest:
        """The routed request, for its one plan on ``node``; 404 if not routed, 409 if elsewhere or planned."""
        r = self._requests.get(request_id)
        if r is None:
            raise BadRequest(f"request {request_id!r} is not routed (call route first) or already completed", 404)
        if r.node.name != node:
            raise BadRequest(f"request {request_id!r} was routed to {r.node.name!r}, not {node!r}", 409)
        if r.finalized:
            raise BadRequest(f"request {request_id!r} already has a plan", 409)
        r.finalized = True
        return r

    def complete(self, request_id: str) -> bool:
        """The request finished (or was abandoned); False if it was not outstanding."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return False
        r.node.left(request_id)
        if r.helper is not None:
            r.helper.assisted(request_id)
        return True

    def expire(self, now: float) -> set[str]:
        """Complete and return the requests routed longer than ``ttl_s`` before ``now``."""
        expired: set[str] = set()
        for request_id, r in self._requests.items():  # in route order: stop at the first young one
            if now - r.routed_at <= self.ttl_s:
                break
            expired.add(request_id)
        for request_id in expired:
            self.complete(request_id)
        self.expired += len(expired)
        return expired

    def check_invariants(self, nodes: list[GenerationMember]) -> None:
        """Each node's in-flight count is the number of its requests in the table."""
        for node in nodes:
            assert node.inflight == sum(1 for r in self._requests.values() if r.node is node), node.name
