"""Leader terms a generation node can check, seen from the attacker's side.

A control plane elected on an etcd it should not have reached (it does not hold the cluster
secret) issues plans of a huge term; followers relay them and generation nodes used to run
them and adopt their term, then refuse every plan of the real leader as older until they
were restarted. Plans now carry the leader's seal (:func:`tessera.auth.plan_seal`): a node
refuses an unsealed or missealed plan without touching its term, and takes back the elected
leader's term from a newer one that went silent (:mod:`tessera.generation.terms`).

The node's own ``/v1/execute`` handler runs here over a fake engine (no model, no control
plane): the refusal is the node's, before any of the plan runs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from helpers.cluster import with_secret_file
from helpers.engines import FakeEngine
from helpers.executor import QuietControl
from helpers.plane import Cluster, plane_config

from tessera.auth import plan_seal
from tessera.composition.policies import policy_from_config
from tessera.config import CompositionConfig
from tessera.errors import Unavailable
from tessera.generation.executor import Executor
from tessera.generation.node import GenerationNode
from tessera.generation.prefills import PrefillCoalescer
from tessera.generation.retention import Retainer
from tessera.generation.scheduler import Scheduler
from tessera.generation.terms import PlanTerms
from tessera.generation.unit_cache import LocalUnitCache
from tessera.http import application
from tessera.messages.generation import ExecuteRequest, SamplingParams
from tessera.messages.plan import Preparation, RequestPlan, Retention, UnitPlan
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
from tessera.wire import WIRE_VERSION, encode

SECRET = b"0123456789abcdef0123456789abcdef"
LEADER = 57  # the real leader's term (an etcd revision)
BOGUS = 1 << 40  # the term the fake control plane claimed
LAYOUT = PromptLayout((Segment(SegmentKind.TEXT, (1, 2)), Segment(SegmentKind.UNIT, (3, 4, 5, 6), "u1"),
                       Segment(SegmentKind.TEXT, (7, 8))))


def plan(request_id: str, term: int, *, secret: bytes | None = SECRET, node: str = "gen0",
         seal_for: tuple[str, str] | None = None) -> RequestPlan:
    """A plan of ``term`` for ``node``, sealed as its leader would (``secret``; None: unsealed);
    ``seal_for``: the (node, request id) the seal was really made for."""
    sealed_node, sealed_id = seal_for or (node, request_id)
    seal = "" if secret is None else plan_seal(secret, sealed_node, term, sealed_id)
    unit = UnitPlan("u1", 4, Preparation.COMPUTE, Retention.NEITHER)
    return RequestPlan(WIRE_VERSION, request_id, node, (unit,), term=term, seal=seal)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[GenerationNode, TestClient]]:
    """gen0 of a cluster whose secret is ``SECRET``: its execute handler over a fake engine."""
    secret_file = tmp_path / "cluster.secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    gen = GenerationNode(with_secret_file(plane_config(nodes=1), secret_file), "gen0")
    gen.scheduler = Scheduler(FakeEngine(), max_batch_tokens=64)
    gen.cache = LocalUnitCache(capacity_blocks=16, block_tokens=4, pin_memory=False)
    gen.retainer = Retainer(gen.cache, None, QuietControl(), staging_bytes=1 << 20, outstanding=2)
    policy = policy_from_config(CompositionConfig(policy="epic", recompute_tokens=1, unit_lead=""))
    gen.executor = Executor(gen.scheduler, PrefillCoalescer(gen.scheduler), gen.cache, gen.retainer, None,
                            lambda lease_id: None, policy, "compose")
    app = application()
    app.router.add_post("/v1/execute", gen.execute)
    gen.scheduler.start()
    try:
        async with TestClient(TestServer(app)) as client:
            yield gen, client
    finally:
        await gen.retainer.drain(timeout=1.0)
        await gen.scheduler.stop()


async def execute(client: TestClient, p: RequestPlan) -> tuple[int, str]:
    msg = ExecuteRequest(WIRE_VERSION, p.request_id, LAYOUT, p, SamplingParams(max_tokens=2))
    resp = await client.post("/v1/execute", data=encode(msg), headers={"Content-Type": "application/json"})
    return resp.status, await resp.text()


def ran(status: int, text: str) -> bool:
    """The node ran the plan to its end (a stream of events ending in ``done``)."""
    return status == 200 and json.loads(text.splitlines()[-1])["kind"] == "done"


async def test_a_higher_term_without_a_valid_seal_is_refused_and_the_real_leaders_next_plan_runs(
        node: tuple[GenerationNode, TestClient]) -> None:
    """Regression: a plan of term 2**40 from a control plane without the secret ran and raised the
    node's term, and every later plan of the real leader was refused as older (503) for good."""
    gen, client = node
    assert ran(*await execute(client, plan("real-1", LEADER)))
    forged = [
        plan("fake-1", BOGUS, secret=None),  # no seal at all
        plan("fake-2", BOGUS, secret=b"not-the-cluster-secret-0123456789"),  # sealed without the secret
        plan("fake-3", BOGUS, seal_for=("gen1", "fake-3")),  # a real seal, made for another node
        plan("fake-4", BOGUS, seal_for=("gen0", "real-1")),  # ... for another request
        dataclasses.replace(plan("fake-5", LEADER), term=BOGUS),  # the real leader's seal, term raised
    ]
    for p in forged:
        status, text = await execute(client, p)
        assert status == 503 and "without a valid seal" in text, (p.request_id, status, text)
    assert gen.terms.newest == LEADER
    assert gen.terms.unsealed == len(forged)
    assert ran(*await execute(client, plan("real-2", LEADER)))
    assert not gen.inflight


async def test_a_sealed_plan_of_a_newer_term_runs_and_fences_out_the_deposed_leader(
        node: tuple[GenerationNode, TestClient]) -> None:
    """The fence still works for real leaders: the successor's sealed plan runs, the deposed one's is refused."""
    gen, client = node
    assert ran(*await execute(client, plan("old-1", LEADER)))
    assert ran(*await execute(client, plan("new-1", LEADER + 9)))
    status, text = await execute(client, plan("old-2", LEADER))
    assert status == 503 and "deposed" in text, (status, text)
    assert gen.terms.newest == LEADER + 9


def test_the_plane_seals_each_plan_for_its_node_request_and_term(cluster_secret: Path) -> None:
    """The one place plans are made (the planner) seals them; a node verifies exactly its own."""
    c = Cluster(with_secret_file(plane_config(nodes=2), cluster_secret))
    c.plane.begin_incarnation(LEADER)
    p = c.plan([("u1", 8), ("u2", 4)])
    assert p.term == LEADER and p.seal
    secret = c.plane.directory.capabilities.secret  # type: ignore[union-attr]
    PlanTerms(p.node, secret, 10.0).admit(p)
    other = "gen1" if p.node == "gen0" else "gen0"
    with pytest.raises(Unavailable, match="without a valid seal"):
        PlanTerms(other, secret, 10.0).admit(dataclasses.replace(p, node=other))
    rid = c.rid()
    ref = c.plane.planner.plan_reference(rid, c.plane.route(rid, [("u3", 4)]), ())
    PlanTerms(ref.node, secret, 10.0).admit(ref)
    # without a secret there is nothing to seal with (and nodes check nothing)
    assert Cluster(plane_config(nodes=1)).plan([("u1", 4)]).seal == ""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_secret_holders_bogus_term_gives_way_to_the_elected_leader_once_it_went_silent() -> None:
    """Recovery: a term above the elected leader's that nobody uses any more stops fencing it out.

    Only a secret holder can raise a node's term now; if one issues a term that is no real
    successor (or etcd and the store were reset by hand), the elected leader's sealed plans
    run again ``recover_after_s`` after the bogus term was last seen, instead of never."""
    clock = Clock()
    terms = PlanTerms("gen0", SECRET, 15.0, clock)
    terms.elected(LEADER)
    terms.admit(plan("real-1", LEADER))
    terms.admit(plan("bogus-1", BOGUS))  # sealed: a secret holder issued it
    clock.now += 10.0
    with pytest.raises(Unavailable, match="older than term"):
        terms.admit(plan("real-2", LEADER))  # the bogus term was seen too recently to give way
    clock.now += 6.0
    terms.admit(plan("real-3", LEADER))  # 16 s of silence: the elected leader's term is back
    assert (terms.newest, terms.recovered) == (LEADER, 1)
    terms.admit(plan("real-4", LEADER))
    # a deposed leader's plan is no elected leader's: still refused, however long the silence
    clock.now += 100.0
    with pytest.raises(Unavailable, match="deposed"):
        terms.admit(plan("deposed", LEADER - 3))
    # and a missealed plan of the elected term recovers nothing
    clock.now += 100.0
    terms.admit(plan("bogus-2", LEADER + 2))
    clock.now += 100.0
    with pytest.raises(Unavailable, match="without a valid seal"):
        terms.admit(plan("fake", LEADER, secret=None))
    assert terms.newest == LEADER + 2


def test_without_the_election_nothing_lowers_a_term() -> None:
    """Without ``[ha]`` (or before the watch told the node who leads) a term only grows."""
    clock = Clock()
    terms = PlanTerms("gen0", SECRET, 15.0, clock)
    terms.admit(plan("bogus", BOGUS))
    clock.now += 1000.0
    with pytest.raises(Unavailable, match="older than term"):
        terms.admit(plan("real", LEADER))
    terms.elected(BOGUS)  # the election names the newer term itself: it is no bogus term
    with pytest.raises(Unavailable, match="older than term"):
        terms.admit(plan("real", LEADER))


def test_without_a_secret_terms_are_taken_as_they_come_and_the_election_recovers_them() -> None:
    """Security off: nothing proves a term (any process on the internal plane can do anything there),
    so a fake control plane's term is adopted; the recovery still bounds the outage."""
    clock = Clock()
    terms = PlanTerms("gen0", None, 15.0, clock)
    terms.elected(LEADER)
    terms.admit(plan("fake", BOGUS, secret=None))
    assert terms.newest == BOGUS
    with pytest.raises(Unavailable):
        terms.admit(plan("real-1", LEADER, secret=None))
    clock.now += 16.0
    terms.admit(plan("real-2", LEADER, secret=None))
    assert terms.newest == LEADER
