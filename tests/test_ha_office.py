"""Which plane a retrieval replica may use (Office): pure logic, no etcd (the failover tests run the real thing)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from helpers.cluster import cluster_config

from tessera.config import ClusterConfig, HAConfig
from tessera.control.plane import ControlPlane
from tessera.errors import NotLeader
from tessera.ha.election import Leader
from tessera.messages.control import LoadReport
from tessera.retrieval.leadership.office import Office
from tessera.retrieval.leadership.path import LeaderlessPath, LocalPath, RemotePath
from tessera.wire import WIRE_VERSION


class FakeLeadership:
    """A term that is valid until ``end()``, as Leadership.valid turns false when the lease may have run out."""

    def __init__(self) -> None:
        self.valid = True
        self.term = 7

    def end(self) -> None:
        self.valid = False


def replicated() -> ClusterConfig:
    cfg = cluster_config(nodes=1)
    return dataclasses.replace(cfg, retrieval=dataclasses.replace(cfg.retrieval, store="postgres",
                                                                  postgres_dsn="host=127.0.0.1"),
                               ha=HAConfig(etcd="127.0.0.1:2379", replicas=2, retry_after_s=2))


def test_without_ha_the_one_process_always_holds_its_plane() -> None:
    """The default: held() is the plane and chat uses it in process."""
    plane = ControlPlane(cluster_config(nodes=1))
    office = Office(plane.config, plane)
    assert office.held() is plane and isinstance(office.path(), LocalPath)


def test_a_replica_without_a_known_leader_refuses_with_retry_after() -> None:
    """No leader elected yet: NotLeader (503) carrying ha.retry_after_s, both for the plane and for chat."""
    cfg = replicated()
    office = Office(cfg, ControlPlane(cfg))
    for ask in (office.held, office.path):
        with pytest.raises(NotLeader) as refused:
            ask()
        assert refused.value.retry_after_s == 2


def test_a_follower_sends_chat_to_the_leader_it_saw_and_never_issues_itself() -> None:
    """A leader elsewhere: chat through its RPCs at the URL the election key holds; /control/* refuses here."""
    cfg = replicated()
    office = Office(cfg, ControlPlane(cfg))
    office._saw(Leader(b"http://127.0.0.1:9999", 5))
    assert isinstance(office.path(), RemotePath) and office.remote.base_url == "http://127.0.0.1:9999"
    with pytest.raises(NotLeader, match="another replica leads") as refused:
        office.held()
    assert "http" not in str(refused.value)  # a follower's client may be shown this refusal


def test_a_leader_stops_issuing_the_moment_its_term_is_no_longer_valid() -> None:
    """Regression guard for the paused leader: once valid is false, held() and path() refuse, even if the
    election key still names this replica."""
    cfg = replicated()
    office = Office(cfg, ControlPlane(cfg))
    term = FakeLeadership()
    office.leadership = term  # type: ignore[assignment]
    office._saw(Leader(office.url.encode(), term.term))
    # before any generation node reported in to the new plane, chat goes on without reuse
    assert isinstance(office.path(), LeaderlessPath) and office.path().term == term.term  # type: ignore[union-attr]
    office.plane.load(LoadReport(WIRE_VERSION, "gen0", 0))
    assert office.held() is office.plane and isinstance(office.path(), LocalPath)
    term.end()
    with pytest.raises(NotLeader):
        office.held()
    # chat goes on without reuse under the last term; nothing of this replica's plane is used
    assert isinstance(office.path(), LeaderlessPath)


def test_readiness_waits_for_a_generation_node_and_on_a_follower_for_a_leader() -> None:
    """Regression: /health was 200 seconds before chat could be served (503 "no generation node is alive").

    Without [ha] (or on the leader) a chat is servable once a node reported in; a follower needs a
    leader elsewhere; a replica whose term ended is not ready until a new leader is seen."""
    plane = ControlPlane(cluster_config(nodes=1))
    office = Office(plane.config, plane)
    assert "no generation node is alive" in (office.unready() or "")
    plane.load(LoadReport(WIRE_VERSION, "gen0", 0))
    assert office.unready() is None
    follower = Office(replicated(), ControlPlane(replicated()))
    assert "failover" in (follower.unready() or "")
    follower._saw(Leader(b"http://127.0.0.1:9999", 5))
    assert follower.unready() is None
    follower._saw(Leader(follower.url.encode(), 6))  # the key names this replica, whose term is not valid
    assert follower.unready() is None  # a failover: chat is served without reuse meanwhile
    follower._saw(None)
    assert follower.unready() is None and isinstance(follower.path(), LeaderlessPath)


async def test_without_a_reachable_leader_chat_is_planned_compute_only_under_the_last_term() -> None:
    """The leaderless plan touches no state a plane owns: every unit COMPUTE, nothing retained or
    evicted, no lease or grant; sealed under the last leader's term, which the node checks."""
    from tessera.auth import plan_seal
    from tessera.messages.plan import Preparation, Retention

    cfg = replicated()
    office = Office(cfg, ControlPlane(cfg))
    office.secret = b"s" * 32  # the cluster secret the replica read
    office._saw(Leader(b"http://127.0.0.1:9999", 41))
    office._saw(None)  # its key expired: no leader known
    path = office.path()
    assert isinstance(path, LeaderlessPath)
    node, watch = await path.route("r1", [("u1", 20), ("u2", 7)], (), 40)
    assert node == "gen0" and watch.alive()
    plan = await path.finalize("r1", node, held={"u1"})
    assert [(u.unit_id, u.n_tokens, u.preparation, u.retention, u.lease, u.grant) for u in plan.units] == [
        ("u1", 20, Preparation.COMPUTE, Retention.NEITHER, None, None),
        ("u2", 7, Preparation.COMPUTE, Retention.NEITHER, None, None)]
    assert plan.local_evict == () and plan.term == 41 and plan.seal == plan_seal(office.secret, "gen0", 41, "r1")
    with pytest.raises(NotLeader):
        await path.route("r2", [("u1", 20)], {"gen0"}, 40)  # every node tried


async def test_a_follower_whose_leader_cannot_be_reached_serves_leaderless_instead_of_a_503() -> None:
    """The leader at a port nobody listens on: the route falls back to the leaderless plan."""
    import socket

    from tessera.messages.plan import Preparation

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed again before use: connection refused
    office = Office(replicated(), ControlPlane(replicated()))
    office._saw(Leader(f"http://127.0.0.1:{dead}".encode(), 9))
    path = office.path()
    assert isinstance(path, RemotePath)
    try:
        node, _ = await path.route("r1", [("u1", 5)], (), 10)
        plan = await path.finalize("r1", node, held=())
        assert plan.term == 9 and [u.preparation for u in plan.units] == [Preparation.COMPUTE]
        path.complete("r1")
    finally:
        await office.remote.close()



async def _peer(handlers: dict[str, Any]) -> tuple[Any, int]:
    """Another replica's internal listener, answering ``/control/<path>`` with ``handlers``."""
    from aiohttp import web

    from tessera.http import errors

    app = web.Application(middlewares=[errors])
    for path, handler in handlers.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def _refuse(exc: Exception) -> Any:
    async def handler(request: Any) -> Any:
        raise exc
    return handler


NOT_LEADING = "this retrieval replica does not lead the control plane (another replica leads); retry"


@pytest.mark.parametrize("route_ok", [False, True], ids=["at-route", "between-route-and-plan"])
async def test_a_follower_whose_leader_stopped_leading_serves_leaderless_instead_of_a_503(route_ok: bool) -> None:
    """The URL the election named answers "not the leader" (it has just lost office, or won it
    and is still taking it): the request is served without reuse, on the node it was routed to."""
    from tessera.http import reply
    from tessera.messages.control import RouteResponse
    from tessera.messages.plan import Preparation, Retention

    async def route(request: Any) -> Any:
        return reply(RouteResponse(WIRE_VERSION, "r1", "gen1", 5.0))

    runner, port = await _peer({"/control/route": route if route_ok else _refuse(NotLeader(NOT_LEADING)),
                                "/control/plan": _refuse(NotLeader(NOT_LEADING))})
    office = Office(replicated(), ControlPlane(replicated()))
    office._saw(Leader(f"http://127.0.0.1:{port}".encode(), 12))
    path = office.path()
    assert isinstance(path, RemotePath)
    try:
        node, _ = await path.route("r1", [("u1", 5), ("u2", 3)], (), 10)
        if route_ok:
            assert node == "gen1"  # the remote plane's choice stands
        plan = await path.finalize("r1", node, held=("u1",))
        assert plan.term == 12 and plan.node == node
        assert [(u.unit_id, u.preparation, u.retention) for u in plan.units] == [
            ("u1", Preparation.COMPUTE, Retention.NEITHER), ("u2", Preparation.COMPUTE, Retention.NEITHER)]
        path.complete("r1")
    finally:
        await office.remote.close()
        await runner.cleanup()


async def test_a_peer_refusing_for_want_of_nodes_is_not_taken_for_a_lost_leader() -> None:
    """Only NotLeader diverts: a leader with no node to serve still answers 503 through the follower."""
    from tessera.errors import Unavailable

    runner, port = await _peer({"/control/route": _refuse(Unavailable("no generation node is alive"))})
    office = Office(replicated(), ControlPlane(replicated()))
    office._saw(Leader(f"http://127.0.0.1:{port}".encode(), 12))
    path = office.path()
    try:
        with pytest.raises(Unavailable) as refused:
            await path.route("r1", [("u1", 5)], (), 10)
        assert not isinstance(refused.value, NotLeader)
    finally:
        await office.remote.close()
        await runner.cleanup()
