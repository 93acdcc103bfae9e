"""Failover of the replicated retrieval role: real etcd, PostgreSQL and role processes (tiny Llama).

Two retrieval replicas campaign; the leader holds the control plane, the other serves the
public API through the leader's RPCs. The leader is killed (SIGKILL) under light load, and
later one is paused past its lease (SIGSTOP, SIGCONT): the survivor takes office, serves
chat without reuse while no leader is reachable, loses no unit or delete, and serves the
same replies as before; a resumed leader's term is over everywhere.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.cluster import StartCluster
from helpers.http import call, wait_for
from helpers.replicated import leader_index, leads, replica_child, replicated_cluster

from tessera.config import ClusterConfig
from tessera.ha.replicas import replica_config
from tessera.launcher import LocalCluster
from tessera.messages.control import PlanRequest, RouteRequest, RouteResponse
from tessera.messages.generation import ExecuteRequest, SamplingParams
from tessera.messages.plan import RequestPlan
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
from tessera.wire import WIRE_VERSION, encode, from_wire

V = WIRE_VERSION
DOCS = {
    "reef": "The Great Barrier Reef is the largest coral reef system in the world, off Queensland.",
    "chip": "A transistor is a semiconductor device used to amplify or switch electronic signals.",
    "coffee": "Espresso is coffee brewed by forcing hot water through finely ground coffee beans.",
    "peak": "Mount Everest is the highest mountain above sea level, on the border of Nepal and China.",
}
QUESTIONS = ["Where is the largest reef?", "How is espresso brewed?", "Which mountain is highest?"]


@pytest.fixture(scope="module")
def replicated(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
               start_module_cluster: StartCluster) -> Iterator[tuple[ClusterConfig, LocalCluster]]:
    with replicated_cluster(str(tiny_model), tmp_path_factory, start_module_cluster) as cluster:
        yield cluster.config, cluster


def url(cfg: ClusterConfig, index: int) -> str:
    return replica_config(cfg, index).retrieval_url


def ingest(base: str, scope: str, docs: dict[str, str]) -> dict[str, str]:
    status, out = call(base, "/v1/units", {"version": V, "units": [
        {"scope": scope, "text": text, "metadata": {"name": name}} for name, text in docs.items()]})
    assert status == 200, out
    return {name: u["unit_id"] for name, u in zip(docs, out["units"], strict=True)}


def retrieved(base: str, scope: str, query: str) -> list[str]:
    status, out = call(base, "/v1/retrieve", {"version": V, "scope": scope, "query": query, "top_k": 4})
    assert status == 200, out
    return [u["unit_id"] for u in out["units"]]


def indexed(base: str, scope: str, unit_id: str) -> bool:
    """The replica at ``base`` retrieves ``unit_id`` (its index followed the store that far)."""
    status, out = call(base, "/v1/retrieve", {"version": V, "scope": scope, "query": QUESTIONS[0], "top_k": 4})
    return status == 200 and unit_id in [u["unit_id"] for u in out["units"]]


def rag(base: str, scope: str, question: str) -> tuple[int, dict[str, str], Any]:
    """(status, headers, body) of a chat with retrieval; never raises on an HTTP error."""
    import json
    import urllib.error
    import urllib.request

    body = {"model": "tessera", "messages": [{"role": "user", "content": question}], "max_tokens": 4,
            "temperature": 0, "logprobs": True, "retrieval": {"scope": scope, "query": question, "top_k": 2}}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def tokens_of(reply: dict[str, Any]) -> list[str]:
    return [t["token"] for t in reply["choices"][0]["logprobs"]["content"]]


def replies(base: str, scope: str) -> list[list[str]]:
    out = []
    for q in QUESTIONS:
        status, _, body = rag(base, scope, q)
        assert status == 200, body
        out.append(tokens_of(body))
    return out


class Load(threading.Thread):
    """Chat requests one after another against one replica; every outcome recorded with its time."""

    def __init__(self, base: str, scope: str) -> None:
        super().__init__(daemon=True)
        self.base, self.scope = base, scope
        self.outcomes: list[tuple[float, int, dict[str, str]]] = []  # (time, status, headers)
        self.refusals: list[str] = []  # the error message of every reply but a 200
        self.errors: list[BaseException] = []
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                status, headers, body = rag(self.base, self.scope, QUESTIONS[i % len(QUESTIONS)])
                self.outcomes.append((time.monotonic(), status, headers))
                if status != 200:
                    self.refusals.append(body["error"]["message"])
            except Exception as exc:  # a connection error or a timeout: exactly what must not happen
                self.errors.append(exc)
            i += 1
            time.sleep(0.1)

    def finish(self) -> None:
        self.stop.set()
        self.join(90)


def wait_leader(cfg: ClusterConfig, index: int, timeout: float = 60.0) -> None:
    wait_for(lambda: leads(cfg, index), timeout=timeout, what=f"replica {index} to lead")


def test_the_follower_serves_what_the_leader_ingested_and_forwards_chat(
        replicated: tuple[ClusterConfig, LocalCluster]) -> None:
    """Units ingested through one replica are retrieved through the other; chat on either gives the same tokens."""
    cfg, _ = replicated
    lead = leader_index(cfg)
    other = 1 - lead
    assert not leads(cfg, other), "two replicas answer as leader"
    ids = ingest(url(cfg, lead), "kb", DOCS)
    wait_for(lambda: indexed(url(cfg, other), "kb", ids["reef"]), what="the follower's index")
    assert retrieved(url(cfg, other), "kb", QUESTIONS[0]) == retrieved(url(cfg, lead), "kb", QUESTIONS[0])
    assert replies(url(cfg, other), "kb") == replies(url(cfg, lead), "kb")


def test_killing_the_leader_hands_over_without_connection_errors_or_lost_units(
        replicated: tuple[ClusterConfig, LocalCluster]) -> None:
    """kill -9 the leader under load: the survivor leads, serves every request meanwhile (no 503, no
    connection error), lost nothing."""
    cfg, cluster = replicated
    lead = leader_index(cfg)
    survivor = 1 - lead
    ids = ingest(url(cfg, survivor), "fo", {k: v.replace(".", " (failover).") for k, v in DOCS.items()})
    assert call(url(cfg, survivor), f"/v1/units/{ids['coffee']}", None)[0] == 200
    delete = {"version": V, "scope": "fo", "filter": {"name": "coffee"}}
    status, _ = call(url(cfg, survivor), "/v1/units/delete", delete)
    assert status == 200
    wait_for(lambda: indexed(url(cfg, lead), "fo", ids["reef"]), what="the leader's index")
    before = replies(url(cfg, survivor), "fo")
    ranking = [retrieved(url(cfg, survivor), "fo", q) for q in QUESTIONS]
    other = ingest(url(cfg, survivor), "fo2", {"a": "The morning ferry leaves the harbour at nine.",
                                              "b": "The harbour master keeps the tide tables."})

    load = Load(url(cfg, survivor), "fo")
    load.start()
    wait_for(lambda: len(load.outcomes) >= 3, what="load before the kill")
    killed_at = time.monotonic()
    replica_child(cluster, lead).proc.kill()
    try:
        # writes while no leader is reachable: committed to the store, not lost with the old plane
        late = ingest(url(cfg, survivor), "fo2", {"late": "The night ferry leaves the harbour at eleven."})
        status, _ = call(url(cfg, survivor), "/v1/units/delete",
                         {"version": V, "scope": "fo2", "filter": {"name": "a"}})
        assert status == 200
        wait_leader(cfg, survivor)
        wait_for(lambda: any(t > killed_at and s == 200 for t, s, _ in load.outcomes), timeout=60,
                 what="a 200 through the new leader")
        load.finish()

        assert not load.errors, f"the survivor gave connection errors or hung: {load.errors[:3]}"
        after_kill = [(s, h) for t, s, h in load.outcomes if t > killed_at]
        # no leader for a while, yet every request through the survivor was served (without reuse
        # until its own plane heard the generation node)
        assert {s for s, _ in after_kill} == {200}, (after_kill, load.refusals[:3])
        assert all("Retry-After" in h for s, h in after_kill if s == 503), "a 503 without Retry-After"
        # regression: a 503 of the failover named the dead leader's internal URL and a raw exception
        leaked = [m for m in load.refusals if "http://" in m or "https://" in m or "Error" in m]
        assert not leaked, leaked[:3]
        assert replies(url(cfg, survivor), "fo") == before, "a reply after the failover differs from before"
        assert [retrieved(url(cfg, survivor), "fo", q) for q in QUESTIONS] == ranking
        assert ids["coffee"] not in {u for q in QUESTIONS for u in retrieved(url(cfg, survivor), "fo", q)}
        assert call(url(cfg, survivor), f"/v1/units/{ids['coffee']}", None)[0] == 404, "the delete was lost"
        # what was written while no leader was reachable
        assert call(url(cfg, survivor), f"/v1/units/{late['late']}", None)[0] == 200, \
            "a unit ingested meanwhile was lost"
        assert call(url(cfg, survivor), f"/v1/units/{other['a']}", None)[0] == 404, "a delete made meanwhile was lost"
        assert retrieved(url(cfg, survivor), "fo2", "When does the night ferry leave?") == [late["late"], other["b"]]
    finally:  # the next test needs two replicas, whatever happened here
        load.finish()
        cluster.restart_child(replica_child(cluster, lead), wait_timeout=120)
    assert not leads(cfg, lead), "the restarted replica took office from a live leader"


def test_a_leader_paused_past_its_lease_issues_nothing_after_it_resumes(
        replicated: tuple[ClusterConfig, LocalCluster]) -> None:
    """SIGSTOP the leader past its lease, SIGCONT: its plane refuses, and the generation node refuses its plans."""
    cfg, cluster = replicated
    old = leader_index(cfg)
    new = 1 - old
    wait_for(lambda: call(url(cfg, new), "/health")[0] == 200, what="the other replica")
    ids = ingest(url(cfg, new), "pause", DOCS)
    wait_for(lambda: indexed(url(cfg, old), "pause", ids["reef"]), what="the leader's index")
    before = replies(url(cfg, new), "pause")
    internal_old = replica_config(cfg, old).control_url
    # a plan the old leader issues now, to be sent after its term ended
    route = from_wire(RouteResponse, call(internal_old, "/control/route", {"version": V, "request_id": "stale"},
                                          signed=cfg)[1])
    stale = from_wire(RequestPlan, call(internal_old, "/control/plan",
                                        {"version": V, "request_id": "stale", "node": route.node}, signed=cfg)[1])
    proc = replica_child(cluster, old).proc
    proc.send_signal(signal.SIGSTOP)
    try:
        wait_leader(cfg, new, timeout=30)
    finally:
        proc.send_signal(signal.SIGCONT)
    # the new leader serves (without reuse until the generation node reported in to its plane)
    wait_for(lambda: rag(url(cfg, new), "pause", QUESTIONS[0])[0] == 200, timeout=30, what="the new leader")
    assert replies(url(cfg, new), "pause") == before
    # the resumed replica's plane issues nothing under its old term
    assert call(internal_old, "/control/route", encode_json(RouteRequest(V, "late")), signed=cfg)[0] == 503
    assert call(internal_old, "/control/plan", encode_json(PlanRequest(V, "late", route.node)), signed=cfg)[0] == 503
    # and the generation node, having run plans of the new term, refuses the old one
    gen = cfg.generation[0]
    execute = ExecuteRequest(V, "stale", _empty_layout(), stale, SamplingParams(max_tokens=1))
    status, body = call(f"http://{gen.host}:{gen.port}", "/v1/execute", raw=encode(execute), signed=cfg)
    assert status == 503 and "deposed" in str(body), (status, body)
    assert stale.term < _term_of_new_plan(cfg, new)
    # a plan of a huge term without its leader's seal (a control plane without the secret) runs
    # nothing and raises no term: the chat below is still served under the real leader's
    forged = dataclasses.replace(stale, request_id="forged", term=1 << 40)
    execute = ExecuteRequest(V, "forged", _empty_layout(), forged, SamplingParams(max_tokens=1))
    status, body = call(f"http://{gen.host}:{gen.port}", "/v1/execute", raw=encode(execute), signed=cfg)
    assert status == 503 and "seal" in str(body), (status, body)
    # chat through the resumed replica is served under the new term (through the new leader)
    wait_for(lambda: rag(url(cfg, old), "pause", QUESTIONS[0])[0] == 200, timeout=30, what="the resumed replica")
    assert replies(url(cfg, old), "pause") == before


def encode_json(msg: object) -> Any:
    import json

    return json.loads(encode(msg))


def _empty_layout() -> PromptLayout:
    return PromptLayout((Segment(SegmentKind.TEXT, (1, 2, 3)),))


def _term_of_new_plan(cfg: ClusterConfig, index: int) -> int:
    internal = replica_config(cfg, index).control_url
    routed: list[Any] = []

    def routable() -> bool:  # a new plane routes once a generation node reported in to it
        status, body = call(internal, "/control/route", {"version": V, "request_id": "probe"}, signed=cfg)[:2]
        routed.append(body)
        return status == 200

    wait_for(routable, timeout=30, what="the new plane to hear a generation node")
    route = from_wire(RouteResponse, routed[-1])
    plan = from_wire(RequestPlan, call(internal, "/control/plan",
                                       {"version": V, "request_id": "probe", "node": route.node}, signed=cfg)[1])
    call(internal, "/control/complete", {"version": V, "request_id": "probe"}, signed=cfg)
    return plan.term
