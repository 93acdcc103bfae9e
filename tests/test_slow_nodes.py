"""Slow is not dead: real generation nodes that are slow, or killed under load."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.cluster import StartCluster, cluster_config, signed_get
from helpers.http import call, kill_mid_load

from tessera.config import ClusterConfig
from tessera.engines.tiny import write_tiny_checkpoint
from tessera.launcher import LocalCluster

FLOOR_S = 1.0  # control.first_token_timeout_s: the slack above a prompt's measured work


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            start_module_cluster: StartCluster) -> Iterator[tuple[ClusterConfig, LocalCluster]]:
    # a random Llama big enough that a ~1,800-token prompt takes several times FLOOR_S to prefill
    # on one CPU thread (the tiny 64-wide model would take milliseconds)
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("wide") / "llama", "llama", seed=7, hidden_size=512,
                                  n_layers=8, n_heads=8, n_kv_heads=4, intermediate_size=1536)
    cfg = cluster_config(str(model), nodes=2, max_inflight=200, connect_timeout_s=2.0,
                         first_token_timeout_s=FLOOR_S, idle_timeout_s=60.0, heartbeat_timeout_s=5.0,
                         max_queue_wait_s=0.0)
    c = start_module_cluster(cfg, tmp_path_factory.mktemp("slow"))
    yield c.config, c


def _alive(cfg: ClusterConfig) -> dict[str, bool]:
    stats = json.loads(signed_get(cfg, cfg.control_url + "/control/stats"))
    return {name: node["alive"] for name, node in stats["nodes"].items()}



def _ask(cfg: ClusterConfig, content: str, **extra: Any) -> tuple[int, Any]:
    return call(cfg.retrieval_url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0, **extra})


def test_a_prompt_slower_than_the_first_token_timeout_is_served_and_its_node_stays_routed(
        cluster: tuple[ClusterConfig, LocalCluster]) -> None:
    """Regression: a valid long prompt that needs more than first_token_timeout_s to its first token
    missed the fixed deadline on one node, was retried on the other, missed again: 503, and both
    nodes left routing. Now the deadline follows its tokens at the node's measured prefill rate."""
    cfg, _ = cluster
    for i in range(4):  # each node measures its prefill rate on a few ordinary prompts
        status, body = _ask(cfg, f"warm up {i} " + "the ledger lists crates of tea. " * 40)
        assert status == 200, body
    long_prompt = " ".join(f"line {k}: the harbour ledger lists crates of tea and bolts of silk." for k in range(100))
    status, body = _ask(cfg, long_prompt)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > 1500
    assert _alive(cfg) == {"gen0": True, "gen1": True}


def test_every_request_that_sent_nothing_to_its_client_survives_a_kill_9_of_its_node(
        cluster: tuple[ClusterConfig, LocalCluster]) -> None:
    """Regression: after kill -9 of a node, requests in flight on it that had sent nothing to their
    clients failed with 503 (a non-streamed reply whose node had already sent tokens was not retried)."""
    cfg, c = cluster
    victim = next(ch for ch in c.children if ch.node == "gen0")

    try:
        results = asyncio.run(kill_mid_load(cfg.retrieval_url, cfg, victim.proc.pid))
    finally:
        victim.proc.wait()
        c.restart_child(victim, wait_timeout=120)
        c._wait_heard([n.name for n in cfg.generation], timeout=60)
    # a non-streamed reply sends nothing before its end, and a stream's headers go out with its
    # first token: any status but 200 is a request that had sent nothing and was not retried
    assert Counter(status for status, _ in results) == {200: 40}
    # only a stream that had already sent tokens from gen0 may end with an error event
    assert all(i % 4 == 0 for i, (_, cut) in enumerate(results) if cut)
