"""Which control plane a retrieval replica may use now: its own, the elected leader's, or none.

Without ``[ha]`` there is one retrieval process and it always holds its plane (``held()``
never refuses). With ``[ha]`` every replica campaigns (:mod:`tessera.ha.election`) with the
URL of its internal plane as its value, and watches who leads (:mod:`tessera.ha.discovery`):

* the **leader** holds a fresh :class:`~tessera.control.plane.ControlPlane`, built when it took
  office (``take_office(term)``: the store's revocations, the term as the incarnation of every
  storage epoch and plan) and rebuilt from node reports as after a restart (inventories,
  residency resync). It holds it only while its lease is certainly alive
  (:attr:`Leadership.valid`): ``held()`` checks at every call, so a leader paused past its
  lease issues nothing once it runs again, and steps down;
* a **follower** sends chat through the leader's ``/control/*`` (:class:`RemotePath`);
* while **no leader** is known or the known one cannot be reached, chat is served without
  reuse under the last leader's term (:class:`LeaderlessPath`); before any leader was ever
  seen, ``path()`` raises :class:`~tessera.errors.NotLeader` (503 with ``Retry-After``).

A replica that lost its term starts a new campaign with a fresh plane next time: soft state
is never carried from one term to the next.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig
from tessera.control.client import RequestControl
from tessera.control.plane import ControlPlane
from tessera.errors import NotLeader, TesseraError
from tessera.retrieval.leadership.liveness import LeaderLiveness
from tessera.retrieval.leadership.path import LeaderlessPath, LocalPath, RemotePath, RequestPath
from tessera.runtime import BackgroundTasks

if TYPE_CHECKING:
    from tessera.ha.election import Leader, Leadership

log = logging.getLogger(__name__)
TakeOffice = Callable[[int], Awaitable[ControlPlane | None]]  # term -> the new plane, or None: refused


class Office:
    """``held()`` (the plane to issue under) and ``path()`` (the chat driver's way to a plane)."""

    def __init__(self, config: ClusterConfig, plane: ControlPlane) -> None:
        self.config = config
        self.ha = config.ha
        self.plane = plane  # without [ha]: the one plane; with it: the current term's (idle on a follower)
        self.url = config.control_url  # this replica's internal plane: its election value
        self.leadership: Leadership | None = None
        self.leader: Leader | None = None  # who leads, as the election key says
        self.terms = 0  # terms this replica took office in
        self.tasks = BackgroundTasks("office")
        auth = ClusterAuth.from_config(config)
        self.secret = auth.secret
        self.last_term: int | None = None  # the term of the last leader seen: leaderless plans carry it
        self._turn = [0]  # leaderless routing's turn over the generation nodes
        # request-path RPCs fail fast: a dead leader must cost a 503, not a hung request
        self.remote = RequestControl(config.control_url, timeout_s=config.control.connect_timeout_s, auth=auth)
        # a follower's waits on generation nodes judge by the leader's heartbeats (pace.RemoteWatch)
        self.heard = LeaderLiveness(self.remote, [g.name for g in config.generation],
                                    config.control.heartbeat_timeout_s, self.tasks)

    @property
    def leads(self) -> bool:
        return not self.ha.enabled or (self.leadership is not None and self.leadership.valid)

    def held(self) -> ControlPlane:
        """The plane to issue under now; NotLeader if this replica does not lead (any more)."""
        if self.leads:
            return self.plane
        # no URL in the message: a follower's chat passes the leader's refusal on to its client
        known = "another replica leads" if self.leader else "no leader is elected yet"
        raise NotLeader(f"this retrieval replica does not lead the control plane ({known}); retry",
                        self.ha.retry_after_s)

    def unready(self) -> str | None:
        """Why a chat cannot be routed through this replica now, or None when it can (no I/O).

        A leader (or the one process without ``[ha]``) needs a generation node alive in its
        plane; a follower needs a leader elsewhere, whose nodes it takes on trust (it hears
        their heartbeats only through the leader, and only while a request waits).
        """
        if self.leads:
            if self.plane.routable or self.ha.enabled:  # with [ha], a new term serves without reuse
                return None
            return "no generation node is alive (none is reporting in)"
        if (self.leader is None or self.leader.value.decode() == self.url) and self.last_term is None:
            return "no retrieval replica leads the control plane right now (a failover is under way)"
        return None  # during a failover chat is served without reuse (LeaderlessPath)

    def path(self) -> RequestPath:
        if self.leads:
            if self.ha.enabled and not self.plane.routable and self.leadership is not None:
                # a new term, before any generation node reported in to this plane: chat goes
                # on without reuse, sealed under this term (which the nodes then take)
                return self._leaderless(self.leadership.term) or LocalPath(self.held)
            return LocalPath(self.held)
        leaderless = self._leaderless()
        if self.leader is None or self.leader.value.decode() == self.url:
            if leaderless is not None:
                return leaderless
            raise NotLeader("no retrieval replica leads the control plane right now (a failover is under way); "
                            "retry", self.ha.retry_after_s)
        return RemotePath(self.remote, self.tasks, self.ha.retry_after_s, self.heard, leaderless)

    def _leaderless(self, term: int | None = None) -> LeaderlessPath | None:
        """Chat without reuse while no leader can be reached (under the last leader's term, or
        ``term``); None until a leader's term is known."""
        term = self.last_term if term is None else term
        if term is None:
            return None
        return LeaderlessPath([g.name for g in self.config.generation], term, self.secret,
                              self.config.control.first_token_timeout_s, self._turn)

    async def units_changed(self, revoked: list[str], reinstated: list[str]) -> None:
        """The store changed here: the leader's plane revokes / reinstates (this one's, if it leads)."""
        if self.leads:
            self.plane.revoke(revoked)
            self.plane.reinstate(reinstated)
            return
        try:
            await self.remote.units_changed(revoked, reinstated)
        except TesseraError as exc:  # the next leader reads the revocations from the store
            log.warning("the leader did not hear of %d revoked / %d re-ingested units: %s",
                        len(revoked), len(reinstated), exc)

    # --- the election --------------------------------------------------------------------

    def start(self, take_office: TakeOffice) -> None:
        if not self.ha.enabled:
            return
        # imported here: without [ha] the retrieval role needs neither aetcd nor etcd
        from tessera.ha.campaign import hold_office
        from tessera.ha.discovery import follow_leader

        self.tasks.spawn(follow_leader(self.ha, self._saw), name="leader-watch")
        self.tasks.spawn(hold_office(self.ha, self.url.encode(), lambda ld: self._take(ld, take_office), self._left),
                         name="campaign")

    async def stop(self) -> None:
        # the campaign resigns as it is cancelled: a successor need not wait for the lease to run out
        self.leadership = None
        await self.tasks.drain(timeout=0.0)
        await self.remote.close()

    def _saw(self, leader: Leader | None) -> None:
        if leader != self.leader:
            log.info("leader: %s", "none" if leader is None else f"{leader.value.decode()} (term {leader.term})")
        self.leader = leader
        if leader is not None:
            self.remote.base_url = leader.value.decode()
            self.last_term = leader.term if self.last_term is None else max(self.last_term, leader.term)

    async def _take(self, leadership: Leadership, take_office: TakeOffice) -> bool:
        plane = await take_office(leadership.term)
        if plane is None:
            return False
        self.plane, self.leadership = plane, leadership
        self.terms += 1
        return True

    def _left(self) -> None:
        self.leadership = None
