"""Fencing by leader term: a memory node refuses capabilities of a term older than one it has seen.

A storage epoch is ``term << TERM_SHIFT | counter`` (``ControlPlane.begin_incarnation``): the
term is the retrieval role's incarnation, which with ``[ha]`` is the elected leader's etcd term
(its election key's creation revision; it only grows). Once a memory node has seen a valid
capability of term T, no capability of a term < T is served: a deposed leader that still runs
(paused past its lease, partitioned) cannot get a write into a slot that the new leader may
have handed to another unit, nor have a stale lease read.

Generation nodes apply the same rule to plans (``RequestPlan.term``): a plan of an older term
than one a node has executed is refused (HTTP 503), so a stale plan never runs; a plan's term
counts only with its leader's seal (:mod:`tessera.generation.terms`).

What this cannot cover: a node that has not yet seen the new term (the new leader has not
talked to it). The control plane keeps its time fence for exactly those nodes.

This module knows nothing about sockets, leases or the election.
"""

from __future__ import annotations

TERM_SHIFT = 32


def term_of(epoch: int) -> int:
    """The leader term (incarnation) an epoch was issued under."""
    return epoch >> TERM_SHIFT


class TermFence:
    """``refusal(epoch) -> reason | None`` before serving; ``observe(epoch)`` after a valid capability."""

    def __init__(self) -> None:
        self.newest = 0  # the newest term this node has seen under a valid capability

    def refusal(self, epoch: int) -> str | None:
        refused = self.term_refusal(term_of(epoch))
        return None if refused is None else f"epoch {epoch} is of {refused}"

    def observe(self, epoch: int) -> None:
        self.observe_term(term_of(epoch))

    def term_refusal(self, term: int) -> str | None:
        """The same rule for a message that carries its term itself (a generation node's plan)."""
        if term < self.newest:
            return f"leader term {term}, older than term {self.newest} seen here: a deposed control plane issued it"
        return None

    def observe_term(self, term: int) -> None:
        self.newest = max(self.newest, term)
