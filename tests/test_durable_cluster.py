"""Durability and revocation end to end: real retrieval, kvpool and generation processes (tiny Llama).

One cluster for the module, with a data directory: units are revoked while requests stream,
and the retrieval role is killed (SIGKILL) and restarted under the same data directory.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers.cluster import StartCluster, cluster_config, signed_get
from helpers.http import call, chat, node_metric, wait_for

from tessera.config import ClusterConfig
from tessera.config_file import load_config
from tessera.engines.checkpoint import Checkpoint
from tessera.engines.tokenizer import Tokenizer, load_tokenizer
from tessera.launcher import LocalCluster
from tessera.wire import WIRE_VERSION

V = WIRE_VERSION
DOCS = {
    "reef": "The Great Barrier Reef is the largest coral reef system in the world, off Queensland.",
    "chip": "A transistor is a semiconductor device used to amplify or switch electronic signals.",
    "coffee": "Espresso is coffee brewed by forcing hot water through finely ground coffee beans.",
    "peak": "Mount Everest is the highest mountain above sea level, on the border of Nepal and China.",
    "ship": "The lighthouse keeper logs every passing ship in a blue notebook by the window.",
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return load_tokenizer(Checkpoint(tiny_model, "tiny", "x"))


@pytest.fixture(scope="module")
def durable(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, start_module_cluster: StartCluster) -> Any:
    """One generation node with a one-block local cache (units are reused from the shared pool),
    one memory node, admission on first sight, a data directory."""
    cfg = cluster_config(str(tiny_model), nodes=1, local_blocks=1, admission="lru", write_timeout_s=4.0,
                         lease_ttl_s=4.0)
    # k = 4: the test documents are one sentence each; with the default k they would be recomputed
    # nearly whole and so sent as plain text (composition.inline_share), never cached
    cfg = dataclasses.replace(cfg, retrieval=dataclasses.replace(
        cfg.retrieval, data_dir=str(tmp_path_factory.mktemp("data")), max_unit_tokens=256),
        composition=dataclasses.replace(cfg.composition, recompute_tokens=4))
    cluster = start_module_cluster(cfg, tmp_path_factory.mktemp("durable"))
    yield cluster.config, cluster  # the cluster's config carries the secret it created


def send(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def ingest(url: str, scope: str, docs: dict[str, str], **extra: Any) -> dict[str, str]:
    status, out = send(url, "POST", "/v1/units", {"version": V, "units": [
        {"scope": scope, "text": text, "metadata": {"name": name}, **extra} for name, text in docs.items()]})
    assert status == 200, out
    return {name: u["unit_id"] for name, u in zip(docs, out["units"], strict=True)}


def unit_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    lead = load_config().composition.unit_lead
    return (tokenizer.encode(lead) if lead else []) + tokenizer.encode(text)


def layout_units(reply: dict[str, Any]) -> list[list[int]]:
    """The token ids of every unit the reply's layout placed."""
    trace = reply["tessera_layout"]
    return [trace["tokens"][start:end] for start, end in trace["units"]]


def rag(url: str, scope: str, query: str, top_k: int = 3) -> dict[str, Any]:
    body = {"model": "tessera", "messages": [{"role": "user", "content": query}], "max_tokens": 3,
            "temperature": 0, "return_layout": True, "retrieval": {"scope": scope, "query": query, "top_k": top_k}}
    status, payload = call(url, "/v1/chat/completions", body)
    assert status == 200, payload
    return payload  # type: ignore[no-any-return]


def test_deletes_over_http_are_idempotent_and_unknown_ids_are_404(durable: tuple[ClusterConfig, LocalCluster]) -> None:
    """DELETE: 200 with the id, 200 again as 'already', 404 for an id never stored; filters delete by metadata."""
    url = durable[0].retrieval_url
    ids = ingest(url, "http", {"a": "Apples grow on trees.", "b": "Bananas grow in bunches."})
    assert send(url, "GET", f"/v1/units/{ids['a']}")[1]["text"] == "Apples grow on trees."
    assert send(url, "DELETE", f"/v1/units/{ids['a']}") == (200, {"version": V, "deleted": [ids["a"]], "already": []})
    assert send(url, "DELETE", f"/v1/units/{ids['a']}") == (200, {"version": V, "deleted": [], "already": [ids["a"]]})
    assert send(url, "GET", f"/v1/units/{ids['a']}")[0] == 404
    status, body = send(url, "DELETE", "/v1/units/" + "f" * 32)
    assert status == 404 and "was ever stored" in body["error"]
    assert send(url, "POST", "/v1/units/delete", {"version": V, "scope": "http", "filter": {"name": "b"}})[1][
        "deleted"] == [ids["b"]]


def test_replies_started_after_a_delete_is_acknowledged_never_use_the_unit(
        durable: tuple[ClusterConfig, LocalCluster], tokenizer: Tokenizer) -> None:
    """Revocation under load: after the ack, no layout holds the unit and no reply reuses its KV."""
    cfg, _ = durable
    url = cfg.retrieval_url
    ids = ingest(url, "kb", DOCS)
    target = unit_tokens(tokenizer, DOCS["reef"])
    # warm: the unit is computed once, then kept in the shared pool
    for _ in range(3):
        chat(url, [DOCS["reef"]], "What is off Queensland?", scope="kb")
    node_url = f"http://127.0.0.1:{cfg.generation[0].port}"
    wait_for(lambda: node_metric(node_url, "tessera_node_writebacks_published_total", cfg) >= 1, what="writeback")
    warm = chat(url, [DOCS["reef"]], "What is off Queensland?", scope="kb")["usage"]["tessera"]
    assert warm["remote_units"] == 1, warm

    results: list[tuple[float, str, dict[str, Any]]] = []
    stop = threading.Event()

    def stream(kind: str) -> None:
        while not stop.is_set():
            started = time.monotonic()
            if kind == "rag":
                reply = rag(url, "kb", "Which coral reef is the largest in the world?")
            else:
                reply = chat(url, [DOCS["reef"]], "What is off Queensland?", scope="kb")
            results.append((started, kind, reply))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, kind) for kind in ("rag", "rag", "brought", "brought")]
        wait_for(lambda: len(results) >= 8, timeout=120, what="requests before the delete")
        assert send(url, "DELETE", f"/v1/units/{ids['reef']}")[0] == 200
        acked = time.monotonic()
        wait_for(lambda: sum(1 for t, _, _ in results if t > acked) >= 12, timeout=120, what="requests after")
        stop.set()
        for f in streams:
            f.result()

    before = [(kind, r) for t, kind, r in results if t < acked]
    after = [(kind, r) for t, kind, r in results if t > acked]
    assert any(target in layout_units(r) for kind, r in before if kind == "rag"), "the unit was retrieved before"
    assert any(r["usage"]["tessera"]["local_units"] + r["usage"]["tessera"]["remote_units"] for _, r in before)
    for kind, reply in after:
        stats = reply["usage"]["tessera"]
        if kind == "rag":
            assert target not in layout_units(reply), "a reply started after the ack retrieved the deleted unit"
        else:  # the caller brings the text itself: it may be computed (or join a concurrent
            # request's prefill of it), never served from a cache
            assert (stats["local_units"], stats["remote_units"]) == (0, 0), stats
            assert stats["computed_units"] + stats["coalesced_units"] == 1, stats


def test_units_and_cached_states_survive_a_kill_9_of_the_retrieval_role(
        durable: tuple[ClusterConfig, LocalCluster]) -> None:
    """Ingest, kill -9 the retrieval role, restart it: same retrieval results, and a remote hit, not a recompute.

    The memory node keeps its arena; once the new incarnation's fence is over it reports its
    verified blocks and the plane makes the unit's entry READY again.
    """
    cfg, cluster = durable
    url = cfg.retrieval_url
    docs = {name: text.replace(".", " (archive).") for name, text in DOCS.items()}
    ids = ingest(url, "archive", docs)
    node_url = f"http://127.0.0.1:{cfg.generation[0].port}"
    before_writes = node_metric(node_url, "tessera_node_writebacks_published_total", cfg)
    chat(url, [docs["ship"]], "Who logs the ships?", scope="archive")
    wait_for(lambda: node_metric(node_url, "tessera_node_writebacks_published_total", cfg) > before_writes,
             what="writeback")
    published = node_metric(node_url, "tessera_node_writebacks_published_total", cfg)
    assert chat(url, [docs["ship"]], "Who logs the ships?", scope="archive")["usage"]["tessera"]["remote_units"] == 1
    queries = ["Where is the largest reef?", "How is espresso brewed?", "Which mountain is highest?"]
    before = [send(url, "POST", "/v1/retrieve", {"version": V, "scope": "archive", "query": q, "top_k": 3})[1]
              for q in queries]
    cluster.restart("retrieval", crash=True)
    after = [send(url, "POST", "/v1/retrieve", {"version": V, "scope": "archive", "query": q, "top_k": 3})[1]
             for q in queries]
    assert [[u["unit_id"] for u in b["units"]] for b in before] == [[u["unit_id"] for u in a["units"]] for a in after]
    assert after[0]["units"][0]["metadata"] == {"name": "reef"} and after[0]["units"][0]["unit_id"] == ids["reef"]
    kv_url = f"http://127.0.0.1:{cfg.kvpools[0].port}"
    wait_for(lambda: json.loads(signed_get(cfg, kv_url + "/info"))["stats"]["adopted"] >= 1, timeout=180,
             what="recovery")
    stats = chat(url, [docs["ship"]], "Who logs the ships?", scope="archive")["usage"]["tessera"]
    assert (stats["remote_units"], stats["computed_units"], stats["fallbacks"]) == (1, 0, 0), stats
    assert node_metric(node_url, "tessera_node_writebacks_published_total", cfg) == published  # nothing rewritten
    # a unit deleted before the crash stays deleted
    assert send(url, "DELETE", f"/v1/units/{ids['coffee']}")[0] == 200
    cluster.restart("retrieval", crash=True)
    assert send(url, "DELETE", f"/v1/units/{ids['coffee']}")[1]["already"] == [ids["coffee"]]


def test_a_whole_cluster_restart_serves_the_units_of_the_first_run(durable: tuple[ClusterConfig, LocalCluster]) -> None:
    """What `tessera up` twice does: every role stops cleanly and starts again on the same data directory."""
    cfg, cluster = durable
    url = cfg.retrieval_url
    query = {"version": V, "scope": "archive", "query": "Which mountain is highest?", "top_k": 3}
    before = send(url, "POST", "/v1/retrieve", query)[1]
    cluster.stop()
    cluster.start(timeout=120)
    assert send(url, "POST", "/v1/retrieve", query)[1] == before
    log = (cluster.log_dir / "retrieval-main.log").read_text()
    assert "rebuilt" not in log, "a clean stop saves the indexes: the restart loads them"
