"""Faults of generation nodes as real processes: no request black-holed, every reply accounted for."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.cluster import StartCluster, cluster_config
from helpers.http import call, chat, metrics_text, wait_for

from tessera.config import ClusterConfig
from tessera.engines.tiny import write_tiny_checkpoint
from tessera.launcher import Child, LocalCluster
from tessera.messages.generation import AbortRequest, AbortResponse, SnapshotRequest
from tessera.wire import WIRE_VERSION, from_wire, to_wire

UNITS = [f"Record {i}: the harbour log lists ship {i} arriving at dawn with {i} crates of tea. " * 2
         for i in range(6)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
        start_module_cluster: StartCluster) -> Iterator[tuple[ClusterConfig, LocalCluster]]:
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5)
    cfg = cluster_config(str(model), nodes=2, max_inflight=2, connect_timeout_s=1.0, first_token_timeout_s=3.0,
                         idle_timeout_s=3.0, heartbeat_timeout_s=4.0)
    c = start_module_cluster(cfg, tmp_path_factory.mktemp("failures"))
    yield c.config, c  # with the secret the launcher made: internal calls are signed with it


def _child(c: LocalCluster, node: str) -> Child:
    return next(ch for ch in c.children if ch.node == node)


def _metric(url: str, name: str, signed: ClusterConfig | None = None, **labels: str) -> float:
    """Sum of a Prometheus series' samples whose labels include ``labels`` (0 if none).

    ``signed``: read as a process of that cluster (a generation node's metrics are internal).
    """
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in metrics_text(url, signed).splitlines():
        if line.startswith(name) and line[len(name)] in " {" and all(w in line for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _node_health(cfg: ClusterConfig, i: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{cfg.generation[i].port}/health", timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def _back_to_normal(c: LocalCluster) -> None:
    c._wait_heard([n.name for n in c.config.generation], timeout=60)


def test_a_killed_generation_node_costs_no_request(cluster: tuple[ClusterConfig, LocalCluster]) -> None:
    """Regression: after kill -9 of a node, routing kept choosing it and requests failed with 503."""
    cfg, c = cluster
    victim = _child(c, "gen0")
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    try:
        for i in range(6):
            status, body = call(cfg.retrieval_url, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"question {i}"}], "context_units": [UNITS[i]],
                "max_tokens": 4, "temperature": 0})
            assert status == 200, body
            assert body["usage"]["tessera"]["node"] == "gen1"
    finally:
        c.restart_child(victim, wait_timeout=120)
        _back_to_normal(c)
    # units neither node holds (gen1 now caches UNITS since first-sight admission): routing by load alone
    fresh = [u.replace("Record", "Fresh record") for u in UNITS]
    assert {chat(cfg.retrieval_url, [fresh[i]], f"after {i}")["usage"]["tessera"]["node"] for i in range(4)} \
        == {"gen0", "gen1"}


def test_a_stopped_node_stops_reporting_in_and_the_request_is_served_elsewhere(
        cluster: tuple[ClusterConfig, LocalCluster]) -> None:
    """Regression: SIGSTOP of a node hung its requests (no read timeout toward generation nodes).

    A stopped node misses its first-token deadline without a heartbeat since: it is gone, not
    slow, so the request waits for the plane to declare it dead and is served elsewhere."""
    cfg, c = cluster
    frozen = _child(c, "gen1")
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        for i in range(3):
            status, body = call(cfg.retrieval_url, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"stopped {i}"}], "max_tokens": 4, "temperature": 0})
            assert status == 200, body
            assert body["usage"]["tessera"]["node"] == "gen0"
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    _back_to_normal(c)
    wait_for(lambda: _node_health(cfg, 1)["inflight"] == 0, what="the stopped node to drop the aborted work")


def test_a_node_at_its_limit_answers_429_and_the_request_goes_to_another_node(
        cluster: tuple[ClusterConfig, LocalCluster]) -> None:
    """Regression: a 429 from a full node reached the client although the other node was idle."""
    cfg, _ = cluster
    gen0 = f"http://127.0.0.1:{cfg.generation[0].port}"
    nodes = set()
    for i in range(4):
        hogs = (f"hog-{i}-a", f"hog-{i}-b")
        for rid in hogs:  # a snapshot admits (and pins) until its execute, an abort or the pin timeout
            status, _ = call(gen0, "/v1/snapshot", {"version": 1, "request_id": rid, "unit_ids": []}, signed=cfg)
            assert status == 200
        status, body = call(cfg.retrieval_url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"busy {i}"}], "max_tokens": 3, "temperature": 0})
        for rid in hogs:
            call(gen0, "/v1/abort", {"version": 1, "request_id": rid}, signed=cfg)
        assert status == 200, body
        nodes.add(body["usage"]["tessera"]["node"])
    assert nodes == {"gen1"}


def test_an_abort_before_execute_drops_the_snapshots_pins_and_admission_at_once(
        cluster: tuple[ClusterConfig, LocalCluster]) -> None:
    """A typed abort of a request that only took a snapshot answers aborted=False and frees its slot."""
    cfg, _ = cluster
    gen0 = f"http://127.0.0.1:{cfg.generation[0].port}"
    before = _node_health(cfg, 0)["inflight"]
    status, _ = call(gen0, "/v1/snapshot", to_wire(SnapshotRequest(WIRE_VERSION, "pinned", ())), signed=cfg)
    assert status == 200
    assert _node_health(cfg, 0)["inflight"] == before + 1
    status, body = call(gen0, "/v1/abort", to_wire(AbortRequest(WIRE_VERSION, "pinned")), signed=cfg)
    assert status == 200, body
    assert from_wire(AbortResponse, body) == AbortResponse(WIRE_VERSION, "pinned", aborted=False)
    assert _node_health(cfg, 0)["inflight"] == before


def test_an_abort_without_its_version_is_refused_naming_the_field(cluster: tuple[ClusterConfig, LocalCluster]) -> None:
    """/v1/abort decodes an AbortRequest like every role RPC: a hand-made body lacking ``version`` is a 400."""
    cfg, _ = cluster
    status, body = call(f"http://127.0.0.1:{cfg.generation[0].port}", "/v1/abort", {"request_id": "x"}, signed=cfg)
    assert status == 400
    assert "version" in str(body)


def test_a_reply_cut_by_a_stop_string_keeps_its_usage_and_metrics(cluster: tuple[ClusterConfig, LocalCluster]) -> None:
    """Regression: a stop string left completion_tokens = 0 and no tier breakdown."""
    cfg, _ = cluster
    url = cfg.retrieval_url
    plain = chat(url, [UNITS[0]], "stop here", max_tokens=8, ignore_eos=True)
    pieces = [t["token"] for t in plain["choices"][0]["logprobs"]["content"]]
    cut = next(i for i in range(2, len(pieces)) if pieces[i].strip() and pieces[i] not in "".join(pieces[:i]))
    before = _metric(url, "tessera_completion_tokens_total")
    cut_reply = chat(url, [UNITS[0]], "stop here", max_tokens=8, ignore_eos=True, stop=[pieces[cut]])
    assert cut_reply["choices"][0]["finish_reason"] == "stop"
    usage = cut_reply["usage"]
    assert usage["completion_tokens"] == cut + 1  # the tokens the node sent, the stopping one included
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    tiers = usage["tessera"]
    assert tiers["local_units"] + tiers["remote_units"] + tiers["computed_units"] == 1
    assert _metric(url, "tessera_completion_tokens_total") == before + cut + 1


def _no_tracebacks(c: LocalCluster) -> None:
    for child in c.children:
        text = child.log_path.read_text(errors="replace")
        assert "Traceback" not in text and " ERROR " not in text, f"{child.role} {child.node}:\n{child.tail()}"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_is_counted_cancelled_and_its_generation_is_aborted(
        cluster: tuple[ClusterConfig, LocalCluster], stream: bool) -> None:
    """Regression: a disconnect logged ERROR tracebacks, counted as 200, and generation ran on."""
    cfg, c = cluster
    url = cfg.retrieval_url
    cancelled = _metric(url, "tessera_requests_total", status="cancelled")
    ok = _metric(url, "tessera_requests_total", status="200")
    aborted = sum(_metric(f"http://127.0.0.1:{g.port}", "tessera_node_requests_total", cfg, outcome=o)
                  for g in cfg.generation for o in ("aborted", "cancelled"))
    body = json.dumps({"messages": [{"role": "user", "content": "go on"}], "max_tokens": 1900,
                       "ignore_eos": True, "temperature": 0, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", cfg.retrieval.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        if stream:
            assert sock.recv(64).startswith(b"HTTP/1.1 200")  # the first token is out
        else:
            wait_for(lambda: any(_node_health(cfg, i)["inflight"] for i in range(2)), what="generation to start")
            time.sleep(0.5)  # well into decoding (1,900 tokens take several seconds)
    wait_for(lambda: _metric(url, "tessera_requests_total", status="cancelled") == cancelled + 1,
             what="the request to be counted as cancelled")
    wait_for(lambda: sum(_metric(f"http://127.0.0.1:{g.port}", "tessera_node_requests_total", cfg, outcome=o)
                         for g in cfg.generation for o in ("aborted", "cancelled")) == aborted + 1,
             what="the node to count the request as aborted")
    wait_for(lambda: all(_node_health(cfg, i)["inflight"] == 0 for i in range(2)), what="generation to stop")
    assert _metric(url, "tessera_requests_total", status="200") == ok
    _no_tracebacks(c)


def test_with_no_node_left_the_client_gets_a_clean_503(cluster: tuple[ClusterConfig, LocalCluster],
                                                       tmp_path: Path) -> None:
    """Every node stopped: a 503 with a JSON error before the deadline, never a hang, and no internal URL or
    exception text in it."""
    cfg, c = cluster
    frozen = [_child(c, n.name) for n in cfg.generation]
    for ch in frozen:
        os.kill(ch.proc.pid, signal.SIGSTOP)
    try:
        status, body = call(cfg.retrieval_url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "anyone?"}], "max_tokens": 3})
        assert status == 503, body
        assert "error" in body and "message" in body["error"]
        message = body["error"]["message"]
        assert not any(leak in message for leak in ("http://", "127.0.0.1", "Error", "Exception")), message
    finally:
        for ch in frozen:
            os.kill(ch.proc.pid, signal.SIGCONT)
    _back_to_normal(c)
