"""The retrieval role as a real process on a free loopback port, exercised over HTTP."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from helpers.cluster import free_port, with_secret_file, write_config
from helpers.processes import RoleProcess

from tessera.auth import ClusterAuth
from tessera.config import (
    ClusterConfig,
    ControlConfig,
    GenerationNodeConfig,
    KVPoolNodeConfig,
    RetrievalConfig,
)
from tessera.messages.plan import RequestPlan
from tessera.wire import WIRE_VERSION, from_wire

V = WIRE_VERSION


@dataclass(frozen=True)
class Service:
    url: str  # the public API
    control_url: str  # the internal plane
    auth: ClusterAuth  # what the cluster's own processes hold


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, cluster_secret: Path) -> Iterator[Service]:
    """A retrieval process for the whole module; it must drain and exit 0 on SIGTERM."""
    directory: Path = tmp_path_factory.mktemp("retrieval")
    port = free_port()
    config = ClusterConfig(
        block_tokens=4,
        control=ControlConfig(heartbeat_timeout_s=60.0),
        retrieval=RetrievalConfig(port=port, max_unit_tokens=64),
        kvpools=(KVPoolNodeConfig("kv0", port=free_port(), data_port=free_port(), capacity_blocks=64),),
        generation=tuple(GenerationNodeConfig(f"gen{i}", port=free_port()) for i in range(2)),
    )
    config = with_secret_file(config, cluster_secret)
    proc = RoleProcess("retrieval", write_config(directory, config))
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_healthy(url, timeout=120)
        yield Service(url, config.control_url, ClusterAuth.from_config(config))
    finally:
        code = proc.stop()
    assert code == 0, proc.log()
    assert "retrieval stopped" in proc.log()


async def call(service: Service, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    """A client call to the public API, or (``/control/*``) a signed call as a cluster process."""
    data = raw if raw is not None else (None if body is None else orjson.dumps(body))
    url = (service.control_url if path.startswith("/control/") else service.url) + path
    headers = service.auth.headers(method, url, data or b"") if path.startswith("/control/") else {}
    payload = None if data is None else io.BytesIO(data)  # a 20 MB body as bytes would warn (aiohttp)
    async with aiohttp.ClientSession() as session, session.request(method, url, data=payload, headers=headers) as resp:
        assert resp.content_type == "application/json", await resp.text()
        return resp.status, await resp.json()


async def test_health_is_live_but_not_ready_while_no_generation_node_reported_in(service: Service) -> None:
    """Regression: /health answered 200 while every chat got 503 "no generation node is alive", so a load
    balancer sent traffic too early. Now /health (= /health/ready) is 503 with the reason; /health/live is 200."""
    assert await call(service, "GET", "/health/live") == (200, {"version": V, "status": "live", "role": "retrieval",
                                                                  "reason": ""})
    for path in ("/health", "/health/ready"):
        status, out = await call(service, "GET", path)
        assert (status, out["status"]) == (503, "unready") and "no generation node is alive" in out["reason"]
    status, out = await call(service, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}]})
    assert status == 503 and "no generation node is alive" in out["error"]["message"]


async def test_ingest_then_retrieve_the_paraphrased_passage(service: Service) -> None:
    """Ingested units come back ranked by meaning, with ids, token counts and metadata."""
    units = [
        {"scope": "kb", "text": "The Great Barrier Reef is the world's largest coral reef system, off Queensland.",
         "metadata": {"source": "reef"}},
        {"scope": "kb", "text": "A transistor is a semiconductor device used to amplify or switch signals."},
        {"scope": "kb", "text": "Espresso is coffee brewed by forcing hot water through finely ground beans."},
    ]
    status, out = await call(service, "POST", "/v1/units", {"version": V, "units": units})
    assert status == 200 and [u["new"] for u in out["units"]] == [True, True, True]
    assert all(u["n_tokens"] > 0 and len(u["unit_id"]) == 32 for u in out["units"])
    status, again = await call(service, "POST", "/v1/units", {"version": V, "units": units[:1]})
    assert again["units"][0] == {**out["units"][0], "new": False}
    status, hits = await call(service, "POST", "/v1/retrieve",
                              {"version": V, "scope": "kb", "query": "Where is the biggest coral reef?", "top_k": 2})
    assert status == 200 and len(hits["units"]) == 2
    top = hits["units"][0]
    assert top["unit_id"] == out["units"][0]["unit_id"] and top["metadata"] == {"source": "reef"}
    assert top["text"] == units[0]["text"] and top["score"] > hits["units"][1]["score"]


async def test_a_misspelt_field_of_a_retrieval_api_body_is_refused_naming_the_known_one(service: Service) -> None:
    """Regression: "topk" and "externalid" were dropped: a default top_k, a unit without its key, and a 200."""
    for path, body, needle in (
            ("/v1/retrieve", {"scope": "kb", "query": "x", "topk": 1}, "unknown field 'topk' (did you mean 'top_k'?)"),
            ("/v1/units", {"units": [{"scope": "kb", "text": "x", "externalid": "doc-1"}]},
             "units[0]: unknown field 'externalid' (did you mean 'external_id'?)"),
            ("/v1/units/delete", {"scope": "kb", "filters": {"name": "x"}},
             "unknown field 'filters' (did you mean 'filter'?)")):
        assert await call(service, "POST", path, body) == (400, {"error": needle}), path


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/units", b"{not json", 400, "not valid JSON"),
        ("/v1/units", {"version": V, "units": [{"scope": "kb", "text": 7}]}, 400, "units[0].text: expected a string"),
        ("/v1/units", {"version": V}, 400, "field units is required"),
        ("/v1/units", {"version": 99, "units": []}, 400, "protocol version 99"),
        ("/v1/units", {"version": V, "units": []}, 400, "units is empty"),
        ("/v1/units", {"version": V, "units": [{"scope": "kb", "text": ""}]}, 400, "units[0].text is empty"),
        ("/v1/units", {"version": V, "units": [{"scope": "kb", "text": "many words " * 80}]}, 413,
         "max_unit_tokens = 64"),
        ("/v1/units", {"version": V, "units": [{"scope": "no spaces", "text": "x"}]}, 400, "not a valid scope"),
        ("/v1/retrieve", {"version": V, "scope": "nowhere", "query": "x"}, 404, "unknown scope 'nowhere'"),
        ("/v1/retrieve", {"version": V, "scope": "kb"}, 400, "exactly one of query"),
        ("/v1/retrieve", {"version": V, "scope": "kb", "embedding": [1.0, 2.0]}, 400, "2 dimensions"),
        ("/control/route", {"version": V, "request_id": "", "units": []}, 400, "request_id is empty"),
        ("/control/route", {"version": V, "request_id": "q", "units": [{"unit_id": "a", "n_tokens": 0}]}, 400,
         "n_tokens must be > 0"),
        ("/control/plan", {"version": V, "request_id": "q", "node": "gen9"}, 404, "unknown generation node 'gen9'"),
        ("/control/plan", {"version": V, "request_id": "never-routed", "node": "gen0"}, 404, "not routed"),
        ("/control/residency", {"version": V, "node": "gen9"}, 404, "unknown generation node 'gen9'"),
        ("/control/load", {"version": V, "node": "ghost", "inflight": 0}, 404, "unknown generation node 'ghost'"),
        ("/control/kvpool/hello", {"version": V, "name": "kv9", "boot_id": "b", "capacity_blocks": 4,
                                   "block_bytes": 64, "shm_name": "s", "data_host": "h", "data_port": 1}, 404,
         "unknown memory node 'kv9'"),
        ("/no/such/path", {}, 404, "Not Found"),
    ],
)
async def test_bad_requests_get_a_4xx_that_says_what_to_fix(service: Service, path: str, body: Any, status: int,
                                                            needle: str) -> None:
    """Malformed JSON, wrong types, bad values, unknown scopes and nodes: 4xx with a message."""
    raw = body if isinstance(body, bytes) else None
    got, out = await call(service, "POST", path, None if raw else body, raw)
    assert got == status and needle in out["error"], out


async def test_the_control_rpcs_run_a_request_through_plan_publish_and_release(service: Service) -> None:
    """route -> plan -> publish -> a remote hit elsewhere under a lease -> release -> complete."""
    hello = {"version": V, "name": "kv0", "boot_id": "boot-a", "capacity_blocks": 64, "block_bytes": 4096,
             "shm_name": "tessera-kv0", "data_host": "127.0.0.1", "data_port": 9999}
    assert (await call(service, "POST", "/control/kvpool/hello", hello))[1]["ok"] is True
    status, pools = await call(service, "GET", "/control/kvpool")
    assert status == 200 and pools["nodes"] == [{**hello, "term_settled": 0}]  # the optional field, defaulted
    for node in ("gen0", "gen1"):
        assert (await call(service, "POST", "/control/load", {"version": V, "node": node, "inflight": 0}))[0] == 200

    units = [{"unit_id": "u" * 32, "n_tokens": 10}]

    async def plan(rid: str, held: list[str] | None = None) -> RequestPlan:
        status, routed = await call(service, "POST", "/control/route",
                                    {"version": V, "request_id": rid, "units": units})
        assert status == 200 and routed["request_id"] == rid
        status, body = await call(service, "POST", "/control/plan",
                                  {"version": V, "request_id": rid, "node": routed["node"], "held": held or []})
        assert status == 200, body
        return from_wire(RequestPlan, body)

    # free shared space: the unit's first sight is computed and granted a writeback
    first = await plan("h1")
    grant = first.units[0].grant
    assert first.units[0].preparation.value == "compute"
    assert grant is not None and grant.writer == first.node and len(grant.blocks) == 3
    publish = {"version": V, "unit_id": grant.unit_id, "epoch": grant.epoch, "writer": "gen-impostor",
               "blocks": [{"node": b.node, "index": b.index} for b in grant.blocks]}
    status, ack = await call(service, "POST", "/control/publish", publish)
    assert status == 409 and ack["ok"] is False and "not the authorized writer" in ack["reason"]
    status, ack = await call(service, "POST", "/control/publish", {**publish, "writer": grant.writer})
    assert status == 200 and ack["ok"] is True
    assert (await call(service, "POST", "/control/complete", {"version": V, "request_id": "h1"}))[1]["ok"]

    third = await plan("h3")  # the node's snapshot does not hold it: read from the shared tier
    assert third.units[0].preparation.value == "remote"
    lease = third.units[0].lease
    assert lease is not None and lease.epoch == grant.epoch
    status, ack = await call(service, "POST", "/control/release", {"version": V, "lease_ids": [lease.lease_id]})
    assert status == 200 and ack == {"version": V, "ok": True, "reason": ""}
    status, ack = await call(service, "POST", "/control/cancel", {"version": V, "unit_id": grant.unit_id,
                                                                  "epoch": grant.epoch, "writer": grant.writer})
    assert status == 200 and ack["ok"] is False  # already published: nothing to cancel
    status, ack = await call(service, "POST", "/control/residency",
                             {"version": V, "node": third.node, "inserted": [], "evicted": []})
    assert status == 200 and ack["ok"]
    status, stats = await call(service, "GET", "/control/stats")
    assert stats["plans"]["plans"] == 2 and stats["shared_entries"] == 1
    assert stats["nodes"][third.node]["inflight"] == 1


async def test_deeply_nested_metadata_is_refused_at_ingest_and_retrieval_keeps_working(service: str) -> None:
    """Regression: metadata nested 255+ levels was stored, and every later /v1/retrieve that hit it was a 500."""
    deep: Any = "leaf"
    for _ in range(260):
        deep = {"k": deep}
    unit = {"scope": "deep", "text": "The lighthouse keeper writes every passing ship in a blue notebook.",
            "metadata": deep}
    # orjson refuses to write it (254 levels at most): a client on another JSON library may not
    raw = json.dumps({"version": V, "units": [unit]}).encode()
    status, out = await call(service, "POST", "/v1/units", raw=raw)
    assert status == 400 and "nested more than" in out["error"]
    status, out = await call(service, "POST", "/v1/units", {"version": V, "units": [{**unit, "metadata": {"a": 1}}]})
    assert status == 200
    status, hits = await call(service, "POST", "/v1/retrieve", {"version": V, "scope": "deep", "query": "ships"})
    assert status == 200 and hits["units"][0]["metadata"] == {"a": 1}


async def test_a_batch_with_an_oversized_unit_is_refused_whole_before_any_work(service: Service) -> None:
    """Regression: a 20 MB unit was tokenized (every chat waiting) before its 413,
    after the batch's first chunk had been committed."""
    units = [{"scope": "big", "text": f"Unit number {i} of a batch that carries one huge text."} for i in range(65)]
    units.append({"scope": "big", "text": "word " * 4_000_000})  # 20 MB, the 66th unit: past the first chunk
    status, out = await call(service, "POST", "/v1/units", {"version": V, "units": units})
    assert status == 413 and out["error"].startswith("units[65].text has 20000000 characters, more than "
                                                     "retrieval.max_unit_tokens = 64 tokens can hold"), out
    status, out = await call(service, "POST", "/v1/retrieve", {"version": V, "scope": "big", "query": "unit"})
    assert status == 404, out  # none of the batch was written


async def test_query_and_unit_vectors_are_bounded_before_they_are_decoded(service: Service) -> None:
    """Regression: a 20 MB query vector was decoded element by element, stalling the loop."""
    huge = [0.5] * 4_000_000  # ~20 MB of JSON
    status, out = await call(service, "POST", "/v1/retrieve", {"version": V, "scope": "kb", "embedding": huge})
    assert status == 413 and "at most 1048576 are accepted (send one query text or one embedding)" in out["error"]
    status, out = await call(service, "POST", "/v1/units", {"version": V, "units": [
        {"scope": "kb", "text": "A vector from some other model.", "embedding": huge}]})
    assert status == 400 and out["error"].startswith(
        "units[0].embedding has 4000000 dimensions; the embedder's have 384: send a 384-dimensional vector"), out
    status, out = await call(service, "POST", "/v1/retrieve", {"version": V, "scope": "kb", "embedding": [0.1] * 1000})
    assert status == 400 and "send a 384-dimensional vector" in out["error"], out
