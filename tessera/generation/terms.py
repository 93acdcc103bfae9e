"""Which plans a generation node runs, by their leader term: a term is taken only with its proof.

A plan carries the term of the leader that issued it and, in a cluster with a secret, that
leader's seal (:func:`tessera.auth.plan_seal`, a MAC over node, term and request id). The
node

* refuses (503) a plan whose seal does not verify: its issuer does not hold the cluster
  secret (a control plane elected on an etcd it should not have reached), or the seal was
  made for another node, request or term. Nothing of it runs and its term moves nothing, so
  the next plan of the real leader runs;
* refuses (503) a plan of an older term than the newest it ran (:class:`TermFence`): a
  deposed leader's plan, whose grants and leases may have been reused already;
* takes the elected leader's term back from a newer term that went silent. Terms only
  grow in a healthy cluster (the store refuses to let a leader take office under a term
  older than one recorded), so a term above the elected leader's that has not been seen for
  ``recover_after_s`` was no successor: a bogus term issued by a secret holder, or etcd and
  the store reset by hand. With ``[ha]`` the node follows the election key, and a sealed
  plan of exactly the term the election says leads now then runs and becomes the node's
  term again, instead of the node refusing its leader until it is restarted. A deposed
  leader's plan never matches the elected term (the election names its successor), so the
  fence still holds for it.

Without a secret nothing can prove a term: every plan's term is taken as it comes (any
process that reaches the internal plane can do anything there), and only the recovery above
bounds how long a bogus term keeps the real leader out.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections.abc import Callable

from tessera.auth import plan_seal
from tessera.errors import Unavailable
from tessera.messages.plan import RequestPlan
from tessera.transport.terms import TermFence

log = logging.getLogger(__name__)


class PlanTerms:
    """``admit(plan)`` before a plan runs; ``elected(term)`` whenever the election's leader changes."""

    def __init__(self, node: str, secret: bytes | None, recover_after_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.secret = secret
        self.recover_after_s = recover_after_s
        self.clock = clock
        self.fence = TermFence()  # the newest leader term of a plan this node ran
        self.leading: int | None = None  # the term the election says leads now (``[ha]`` only)
        self._newest_at = -math.inf  # when a plan of the newest term last ran here
        self.unsealed = 0  # plans refused for a seal that does not verify
        self.stale = 0  # plans refused as older than the newest term
        self.recovered = 0  # times the elected leader's term replaced a newer, silent one

    @property
    def newest(self) -> int:
        return self.fence.newest

    def elected(self, term: int | None) -> None:
        """The election's leader now has ``term`` (None: no leader, or its term is not known)."""
        self.leading = term

    def admit(self, plan: RequestPlan) -> None:
        """Raise Unavailable unless ``plan`` may run now; if it may, its term is this node's newest."""
        if self.secret is not None and not hmac.compare_digest(
                plan_seal(self.secret, self.node, plan.term, plan.request_id), plan.seal):
            self.unsealed += 1
            raise Unavailable(f"plan {plan.request_id} claims leader term {plan.term} without a valid seal: the "
                              "control plane that issued it does not hold the cluster secret, or sealed it for "
                              "another node or request; nothing of it runs, ask the elected leader")
        now = self.clock()
        refused = self.fence.term_refusal(plan.term)
        if refused is not None:
            if not self._recovers(plan.term, now):
                self.stale += 1
                raise Unavailable(f"plan {plan.request_id} is of {refused}; ask the current leader")
            log.warning("%s: leader term %d was last seen %.0fs ago and the election says term %d leads: taking "
                        "term %d back (the newer term was no successor)", self.node, self.newest,
                        now - self._newest_at, plan.term, plan.term)
            self.recovered += 1
            self.fence.newest = plan.term  # the one place a fence goes down: see the module docstring
        else:
            self.fence.observe_term(plan.term)
        self._newest_at = now

    def _recovers(self, term: int, now: float) -> bool:
        """An older term runs only as the elected leader's, once the newer term went silent here."""
        return self.leading == term and now - self._newest_at > self.recover_after_s
