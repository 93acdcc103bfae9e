"""The overload bound held on the node: a request whose work cannot start within what is left
of ``control.max_queue_wait_s`` is refused with 429 instead of reaching its first token late.

A real tiny-model cluster; the plane's admission is blind on purpose (its service-time
estimate is 0 until a first request has started), so a burst is admitted whole and only the
node's late-start check (tessera/generation/scheduler.py) can hold the bound.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path
from typing import Any

from helpers.cluster import StartCluster, cluster_config
from helpers.http import call, metrics_text


def test_a_burst_the_plane_admitted_blind_is_refused_on_the_node_once_its_bound_is_spent(
        tiny_model: Path, tmp_path: Path, start_cluster: StartCluster) -> None:
    """Regression: the plane admitted a whole burst to a fresh node (no service time
    measured yet) and every request was served, the last ones far past the bound. The node now
    refuses the requests still queued behind other work when their bound runs out: a clean 429
    naming the bound, the node stays routed, and a request after the burst is served."""
    cfg = cluster_config(str(tiny_model), nodes=1, local_blocks=0, max_queue_wait_s=0.02)
    cfg = dataclasses.replace(cfg, generation=tuple(dataclasses.replace(g, max_batch_tokens=32)
                                                    for g in cfg.generation))
    start_cluster(cfg, tmp_path)
    url = cfg.retrieval_url

    def ask(i: int) -> tuple[int, Any]:
        unit = f"Record {i}: " + " ".join(f"entry {i}.{k} holds value {k * i}." for k in range(40))
        return call(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"What does record {i} hold?"}],
            "context_units": [unit], "max_tokens": 2, "temperature": 0})

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(ask, range(12)))
    statuses = [s for s, _ in replies]
    assert set(statuses) <= {200, 429}, replies
    refused = [body for s, body in replies if s == 429]
    assert refused, "every request of the burst was served: nothing held the queueing bound"
    assert all("queueing bound" in body["error"]["message"] for body in refused), refused
    assert statuses.count(200) >= 1
    for status, body in replies:  # the usage says where a served request's time went on its node
        if status == 200:
            usage = body["usage"]["tessera"]
            assert 0 <= usage["node_queued_s"] <= usage["node_first_token_s"], usage
            assert usage["node_first_token_s"] * 1000 <= usage["ttft_ms"] + 1, usage
    node = cfg.generation[0]
    assert 'outcome="refused"' in metrics_text(f"http://127.0.0.1:{node.port}", cfg)
    status, body = ask(99)  # the node was busy, not failed: it is still routed
    assert status == 200, body
