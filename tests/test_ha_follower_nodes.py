"""A follower replica handles generation-node failures as the leader does: real processes.

Two retrieval replicas on real etcd and PostgreSQL, one memory node, two generation nodes (a
random Llama wide enough that requests stay in flight while a node is killed). Every request
goes to the replica that does *not* lead, so its route, plan and completion cross the
leader's ``/control/*`` RPCs, and what it learns of a failed node must reach the leader's
plane (``/control/suspect``) while the leader's heartbeats say which nodes live
(``/control/liveness``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from collections.abc import Iterator

import pytest
from helpers.cluster import StartCluster, signed_get
from helpers.http import call, kill_mid_load, node_inflight, wait_for
from helpers.replicated import leader_index, replicated_cluster

from tessera.config import ClusterConfig
from tessera.engines.tiny import write_tiny_checkpoint
from tessera.ha.replicas import replica_config
from tessera.launcher import Child, LocalCluster


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory,
               start_module_cluster: StartCluster) -> Iterator[tuple[ClusterConfig, LocalCluster]]:
    # wide enough that 80 decoded tokens of 40 requests keep a node busy for seconds on one thread
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("wide") / "llama", "llama", seed=7, hidden_size=512,
                                  n_layers=8, n_heads=8, n_kv_heads=4, intermediate_size=1536)
    with replicated_cluster(str(model), tmp_path_factory, start_module_cluster, nodes=2, max_inflight=200,
                            connect_timeout_s=2.0, first_token_timeout_s=2.0, idle_timeout_s=60.0,
                            heartbeat_timeout_s=4.0, max_queue_wait_s=0.0) as cluster:
        yield cluster.config, cluster


def _follower(cfg: ClusterConfig) -> str:
    return replica_config(cfg, 1 - leader_index(cfg)).retrieval_url


def _leader_stats(cfg: ClusterConfig) -> dict[str, object]:
    url = replica_config(cfg, leader_index(cfg)).control_url + "/control/stats"
    return json.loads(signed_get(cfg, url))  # type: ignore[no-any-return]



def _child(c: LocalCluster, node: str) -> Child:
    return next(ch for ch in c.children if ch.node == node)


def _back(c: LocalCluster, victim: Child) -> None:
    victim.proc.wait()
    c.restart_child(victim, wait_timeout=120)
    c._wait_heard([n.name for n in c.config.generation], timeout=60)


def test_through_a_follower_every_request_that_sent_nothing_survives_a_kill_9_of_its_node(
        replicated: tuple[ClusterConfig, LocalCluster]) -> None:
    """Regression: on a follower, a request whose node was killed was retried under the same request id
    before its first route's completion reached the leader (409 "already routed"), and the leader
    kept routing to the dead node: the follower now completes first and reports the node."""
    cfg, c = replicated
    follower = _follower(cfg)
    victim = _child(c, "gen0")

    try:
        results = asyncio.run(kill_mid_load(follower, cfg, victim.proc.pid))
    finally:
        _back(c, victim)
    # a non-streamed reply sends nothing before its end, and a stream's headers go out with its
    # first token: any status but 200 is a request that had sent nothing and was not retried
    assert Counter(status for status, _ in results) == {200: 40}
    # only a stream that had already sent tokens from gen0 may end with an error event
    assert all(i % 4 == 0 for i, (_, cut) in enumerate(results) if cut)
    assert _leader_stats(cfg)["nodes_suspected"], "the follower never told the leader of the dead node"


def test_through_a_follower_a_stopped_node_is_left_for_the_leader_to_declare_dead_and_the_request_served_elsewhere(
        replicated: tuple[ClusterConfig, LocalCluster]) -> None:
    """Regression: a follower hears no heartbeats and took a node that missed its first-token deadline for
    slow (503, no retry); it now asks the leader's liveness, and a node gone silent is retried elsewhere."""
    cfg, c = replicated
    follower = _follower(cfg)
    frozen = _child(c, "gen1")
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        served = []
        for i in range(3):
            status, body = call(follower, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"stopped {i}"}], "max_tokens": 4, "temperature": 0})
            assert status == 200, body
            served.append(body["usage"]["tessera"]["node"])
        assert served == ["gen0"] * 3
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    c._wait_heard([n.name for n in cfg.generation], timeout=60)
    wait_for(lambda: node_inflight(cfg, 1) == 0, what="the stopped node to drop the aborted work")


def test_a_node_busy_past_the_slack_is_slow_not_dead_through_a_follower(
        replicated: tuple[ClusterConfig, LocalCluster]) -> None:
    """A long prompt whose prefill outlasts first_token_timeout_s is served through the follower and
    neither node leaves routing: the leader's heartbeats, not the follower's clock, say who lives."""
    cfg, _ = replicated
    follower = _follower(cfg)
    for i in range(4):  # each node measures its prefill rate on a few ordinary prompts
        status, body = call(follower, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"warm up {i} " + "the ledger lists crates of tea. " * 40}],
            "max_tokens": 2, "temperature": 0})
        assert status == 200, body
    long_prompt = " ".join(f"line {k}: the harbour ledger lists crates of tea and bolts of silk." for k in range(100))
    status, body = call(follower, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2, "temperature": 0})
    assert status == 200, body
    nodes = _leader_stats(cfg)["nodes"]
    assert isinstance(nodes, dict)
    assert {name: n["alive"] for name, n in nodes.items()} == {"gen0": True, "gen1": True}
