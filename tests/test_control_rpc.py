"""The request path as a remote API: ``/control/route|plan|complete`` over a real, signed listener.

A replica that does not host the control plane routes, plans and completes its requests
through :class:`RequestControl`; the plans it gets must be the ones the in-process plane
would have made, and the listener refuses anyone without the cluster secret.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from helpers.cluster import free_port, with_secret_file
from helpers.plane import Cluster, plane_config

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig
from tessera.control.client import RequestControl
from tessera.control.pace import NodeWatch, RemoteWatch, Watch
from tessera.control.routes import add_control_routes
from tessera.errors import BadRequest, ControlPlaneError, Unavailable
from tessera.http import application
from tessera.messages.plan import Preparation, RequestPlan, UnitPlan
from tessera.retrieval.chat.generation_client import NodeSlow, NodeUnavailable, _watched
from tessera.retrieval.leadership.liveness import LeaderLiveness
from tessera.runtime import BackgroundTasks

# requests sharing units, so the plans hold every preparation (LOCAL, REMOTE, COMPUTE) and
# local and shared retentions; one node per request at most holds a unit (two nodes)
WORKLOAD = [
    [("a", 8), ("b", 4)],
    [("a", 8), ("c", 12)],
    [("b", 4), ("c", 12), ("d", 4)],
    [("a", 8), ("b", 4), ("c", 12), ("d", 4)],
    [("e", 16), ("a", 8)],
    [("d", 4), ("e", 16)],
]


@pytest.fixture
def config(cluster_secret: Path) -> ClusterConfig:
    """A two-node test cluster with the cluster secret (its plane signs capabilities too)."""
    return with_secret_file(plane_config(nodes=2, local_blocks=8, shared_blocks=16), cluster_secret)


@pytest.fixture
async def listener(config: ClusterConfig) -> AsyncIterator[tuple[str, Cluster]]:
    """The control routes of a simulated cluster's plane on a real aiohttp listener, behind the
    cluster-secret middleware (as on the retrieval role's internal plane); yields (url, cluster)."""
    cluster = Cluster(config)
    # a port of its own: other clusters may hold the configured one on this machine
    host, port = config.retrieval.internal_host, free_port()
    auth = ClusterAuth.from_config(config)
    app = application([auth.middleware(host, port, body_timeout_s=config.listener.body_timeout_s)])
    add_control_routes(app, cluster.plane)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    try:
        yield f"http://{host}:{port}", cluster
    finally:
        await runner.cleanup()


@pytest.fixture
async def remote(listener: tuple[str, Cluster], config: ClusterConfig) -> AsyncIterator[RequestControl]:
    """A client of the listener that signs with the cluster secret."""
    client = RequestControl(listener[0], auth=ClusterAuth.from_config(config))
    yield client
    await client.close()


def without_tokens(plan: RequestPlan) -> RequestPlan:
    """The plan with its capability tokens blanked: they carry a wall-clock expiry (unix seconds)."""
    def unit(up: UnitPlan) -> UnitPlan:
        lease = None if up.lease is None else dataclasses.replace(up.lease, tokens=())
        grant = None if up.grant is None else dataclasses.replace(up.grant, tokens=())
        return dataclasses.replace(up, lease=lease, grant=grant)
    return dataclasses.replace(plan, units=tuple(unit(up) for up in plan.units))


async def test_a_request_routed_planned_and_completed_remotely_gets_the_in_process_plans(
        listener: tuple[str, Cluster], remote: RequestControl, config: ClusterConfig) -> None:
    """Every remote route, plan and complete equals what an in-process plane of the same config answers."""
    _, served = listener
    local = Cluster(config)
    seen: set[Preparation] = set()
    for i, units in enumerate(WORKLOAD):
        rid = f"r{i}"
        expected = local.plan(units, rid)
        local.execute(expected, complete=False)
        node = await remote.route(rid, units)
        assert node == expected.node
        plan = await remote.finalize(rid, node, served.snapshot(node, units))
        served.execute(plan, complete=False)  # the node's own traffic goes to the plane directly
        assert without_tokens(plan) == without_tokens(expected)
        assert await remote.complete(rid) is local.plane.complete(rid) is True
        seen |= {up.preparation for up in plan.units}
    assert seen == set(Preparation)
    assert served.plane.report() == local.plane.report()
    served.plane.check_invariants()


async def test_capabilities_travel_with_a_remote_plan(remote: RequestControl) -> None:
    """A grant planned remotely carries the plane's signed tokens (the secret signs them, not the HTTP layer)."""
    node = await remote.route("r1", [("a", 8)])
    plan = await remote.finalize("r1", node, ())
    (up,) = plan.units
    assert up.grant is not None and up.grant.tokens and all(t.mac for t in up.grant.tokens)


async def test_an_unsigned_request_is_refused_with_401_before_the_plane_sees_it(
        listener: tuple[str, Cluster]) -> None:
    """No cluster secret: 401 on route, plan and complete, and nothing is routed."""
    url, served = listener
    async with aiohttp.ClientSession() as session:
        for path in ("/control/route", "/control/plan", "/control/complete"):
            async with session.post(url + path, json={"version": 1, "request_id": "r1", "node": "gen0",
                                                      "units": [{"unit_id": "a", "n_tokens": 8}]}) as resp:
                assert resp.status == 401, (path, await resp.text())
    unsigned = RequestControl(url)
    try:
        with pytest.raises(ControlPlaneError, match="HTTP 401"):
            await unsigned.route("r1", [("a", 8)])
    finally:
        await unsigned.close()
    assert all(n.inflight == 0 for n in served.plane.nodes.values())


async def test_remote_refusals_raise_what_the_in_process_plane_raises(
        listener: tuple[str, Cluster], remote: RequestControl) -> None:
    """A routed id again: BadRequest 409; a plan before route: 404; no node alive: Unavailable (503)."""
    _, served = listener
    node = await remote.route("r1", [("a", 8)])
    with pytest.raises(BadRequest, match="already routed") as again:
        await remote.route("r1", [("a", 8)])
    assert again.value.status == 409
    with pytest.raises(BadRequest, match="not routed") as unrouted:
        await remote.finalize("r2", node, ())
    assert unrouted.value.status == 404
    assert await remote.complete("r1") is True
    assert await remote.complete("r1") is False  # not outstanding any more
    for n in list(served.plane.nodes):
        served.plane.suspect(n)
    with pytest.raises(Unavailable, match="no generation node is alive"):
        await remote.route("r3", [("a", 8)])


async def test_a_remote_route_avoids_excluded_nodes_and_answers_the_first_token_deadline(
        listener: tuple[str, Cluster], remote: RequestControl, config: ClusterConfig) -> None:
    """A retry routed remotely never lands on a node it failed on, and carries the deadline the plane computed."""
    first = await remote.route_request("x1", [("a", 8)], prompt_tokens=100)
    assert first.first_token_s >= config.control.first_token_timeout_s
    retry = await remote.route_request("x2", [("a", 8)], exclude=(first.node,), prompt_tokens=100)
    assert retry.node != first.node
    assert (await remote.route_request("x3", [("a", 8)])).first_token_s == 0.0  # not asked: not computed
    for rid in ("x1", "x2", "x3"):
        assert await remote.complete(rid)


async def test_a_replicas_revocation_reaches_the_leaders_plane(
        listener: tuple[str, Cluster], remote: RequestControl) -> None:
    """POST /control/units: revoked units are planned from text from then on, until they are reinstated."""
    _, served = listener
    await remote.units_changed(["a"], [])
    assert "a" in served.plane.revoked
    await remote.units_changed([], ["a"])
    assert "a" not in served.plane.revoked


async def test_a_node_a_follower_could_not_reach_leaves_the_leaders_routing(
        listener: tuple[str, Cluster], remote: RequestControl) -> None:
    """POST /control/suspect: the plane takes the node out of routing, as its own serving layer's report would."""
    _, served = listener
    await remote.suspect("gen0")
    assert not served.plane.nodes["gen0"].alive
    assert served.plane.report()["nodes_suspected"] == 1
    assert {(await remote.route_request(f"s{i}", [("a", 8)])).node for i in range(4)} == {"gen1"}
    with pytest.raises(BadRequest) as unknown:
        await remote.suspect("gen9")
    assert unknown.value.status == 404


async def test_the_leaders_liveness_answer_says_who_is_alive_and_how_long_ago_each_was_heard(
        listener: tuple[str, Cluster], remote: RequestControl) -> None:
    """POST /control/liveness: alive and seconds since the last heartbeat, on the plane's clock."""
    _, served = listener
    served.heartbeat("gen0", "gen1")
    served.clock.advance(1.5)
    served.heartbeat("gen1")
    served.plane.suspect("gen1")
    report = await remote.liveness(["gen0", "gen1"])
    assert [(n.name, n.alive, n.heard_s_ago) for n in report.nodes] == [("gen0", True, 1.5), ("gen1", False, 0.0)]
    assert [n.progressed_s_ago for n in report.nodes] == [-1.0, -1.0]  # no prompt work reported yet
    served.heartbeat("gen0", prompt_batches=3)
    served.clock.advance(0.5)
    served.heartbeat("gen0", prompt_batches=3)  # heard again, the count unchanged: no progress
    report = await remote.liveness(["gen0"])
    assert [(n.heard_s_ago, n.progressed_s_ago) for n in report.nodes] == [(0.0, 0.5)]


def _heard(remote: RequestControl, tasks: BackgroundTasks) -> LeaderLiveness:
    return LeaderLiveness(remote, ["gen0", "gen1"], stale_s=5.0, tasks=tasks)


async def _wait_on(watch: Watch, deadline_s: float, progress_s: float | None = None) -> None:
    """A step toward the node that never ends, watched like a first token."""
    await _watched(asyncio.Event().wait(), watch, deadline_s, "its first token", "test", progress_s)


async def test_a_followers_wait_calls_a_late_node_the_leader_still_hears_slow(
        listener: tuple[str, Cluster], remote: RequestControl) -> None:
    """Past its deadline, a node the leader heard since the wait began is slow: NodeSlow, no retry."""
    _, served = listener
    tasks = BackgroundTasks("test")
    heard = _heard(remote, tasks)
    served.heartbeat("gen0")
    watch = RemoteWatch("gen0", 0.1, heard)
    stalled = asyncio.Event()
    stalled.set()  # it reports in, and runs no prompt work
    beating = asyncio.ensure_future(_beating(served, stalled))
    try:
        with pytest.raises(NodeSlow):
            await _wait_on(watch, 0.1)
    finally:
        beating.cancel()
        await tasks.drain(timeout=1.0)


async def test_a_followers_wait_ends_as_gone_once_the_leader_declares_the_node_dead(
        listener: tuple[str, Cluster], remote: RequestControl) -> None:
    """Regression: a follower took every late node for slow (503); one the leader no longer hears is gone."""
    _, served = listener
    tasks = BackgroundTasks("test")
    heard = _heard(remote, tasks)
    served.heartbeat("gen0")
    served.clock.advance(3.0)  # silent since: not heard during the wait below
    watch = RemoteWatch("gen0", 0.1, heard)

    async def declare_dead() -> None:
        await asyncio.sleep(0.6)  # past the deadline: the wait looks on, neither slow nor gone yet
        served.plane.suspect("gen0")

    dying = asyncio.ensure_future(declare_dead())
    try:
        with pytest.raises(NodeUnavailable, match="stopped reporting in"):
            await _wait_on(watch, 0.1)
        assert dying.done()
    finally:
        await tasks.drain(timeout=1.0)


async def test_without_an_answer_from_the_leader_a_late_node_counts_as_slow(config: ClusterConfig) -> None:
    """No leader to ask (a failover under way): nobody can tell, and a late node is not retried on a guess."""
    tasks = BackgroundTasks("test")
    nobody = RequestControl(f"http://127.0.0.1:{free_port()}", timeout_s=0.5, auth=ClusterAuth.from_config(config))
    try:
        with pytest.raises(NodeSlow):
            await _wait_on(RemoteWatch("gen0", 0.1, _heard(nobody, tasks)), 0.1)
    finally:
        await tasks.drain(timeout=1.0)
        await nobody.close()


async def _beating(served: Cluster, progress_until: asyncio.Event) -> None:
    """gen0 reports in every 0.05 s, showing one more prompt batch run each time until ``progress_until``
    (the plane's clock follows the loop's)."""
    batches = 0
    while True:
        await asyncio.sleep(0.05)
        served.clock.advance(0.05)
        if not progress_until.is_set():
            batches += 1
        served.heartbeat("gen0", prompt_batches=batches)


def _watches(served: Cluster, remote: RequestControl, tasks: BackgroundTasks) -> list[Watch]:
    """The same node watched on the leader's own plane and, through the liveness API, by a follower."""
    return [NodeWatch(served.plane.nodes["gen0"], served.clock, 0.1), RemoteWatch("gen0", 0.1, _heard(remote, tasks))]


async def test_a_late_node_that_keeps_running_prompt_work_is_waited_on_until_its_first_token(
        listener: tuple[str, Cluster], remote: RequestControl) -> None:
    """Regression: a burst of retries after a node died missed the deadline priced for one request
    on a node busy with its own decodes, and failed as slow (503) while the node drained them.
    A late node whose heartbeats show prompt work run is draining its queue: the wait goes on."""
    _, served = listener
    tasks = BackgroundTasks("test")
    stop_progress = asyncio.Event()
    beating = asyncio.ensure_future(_beating(served, stop_progress))
    try:
        for watch in _watches(served, remote, tasks):
            first_token = asyncio.Event()
            asyncio.get_running_loop().call_later(1.0, first_token.set)  # ten deadlines late
            await _watched(first_token.wait(), watch, 0.1, "its first token", "test", progress_s=0.3)
            assert first_token.is_set()
    finally:
        beating.cancel()
        await tasks.drain(timeout=1.0)


async def test_a_late_node_whose_prompt_work_stalls_is_slow_after_one_more_span(
        listener: tuple[str, Cluster], remote: RequestControl) -> None:
    """The wait goes on only while each span of ``progress_s`` shows work run: once the node
    reports in without running any, it is slow, and the error says it stalled."""
    _, served = listener
    tasks = BackgroundTasks("test")
    for watch in _watches(served, remote, tasks):
        stop_progress = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop_progress.set)
        beating = asyncio.ensure_future(_beating(served, stop_progress))
        try:
            with pytest.raises(NodeSlow, match="nor run any prompt work in its last"):
                await _wait_on(watch, 0.1, progress_s=0.3)
            assert stop_progress.is_set()  # not before its work stalled
        finally:
            beating.cancel()
    await tasks.drain(timeout=1.0)


async def test_without_progress_a_late_node_is_slow_at_its_deadline(
        listener: tuple[str, Cluster], remote: RequestControl) -> None:
    """A node heard but running no prompt work is slow at the deadline, the wait not extended."""
    _, served = listener
    tasks = BackgroundTasks("test")
    stalled = asyncio.Event()
    stalled.set()
    beating = asyncio.ensure_future(_beating(served, stalled))
    try:
        for watch in _watches(served, remote, tasks):
            with pytest.raises(NodeSlow) as slow:
                await _wait_on(watch, 0.1, progress_s=0.3)
            assert "prompt work" not in str(slow.value)
    finally:
        beating.cancel()
        await tasks.drain(timeout=1.0)
