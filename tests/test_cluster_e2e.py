"""End to end: real retrieval, kvpool and generation processes on loopback (tiny random Llama)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cluster import StartCluster, cluster_config
from helpers.http import call, chat, node_metric, wait_for

from tessera.composition.layout import layout_from_trace
from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.config_file import load_config
from tessera.engines.offline import compose, prefill_units
from tessera.engines.reference import ReferenceEngine
from tessera.engines.tokenizer import Tokenizer, load_tokenizer
from tessera.launcher import LocalCluster
from tessera.units import blocks_for

UNIT_A = "Record A: the lighthouse keeper logs every passing ship in a blue notebook. " * 2
UNIT_B = "Record B: the orchard on the hill grows pears, plums and late apples each autumn. " * 2
UNIT_C = "Record C: the ferry leaves the harbour at seven and returns before dusk. " * 3


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    from tessera.engines.checkpoint import Checkpoint

    return load_tokenizer(Checkpoint(tiny_model, "tiny", "x"))


@pytest.fixture(scope="module")
def one_node(tiny_model: Path, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory,
        start_module_cluster: StartCluster) -> Any:
    """One generation node whose local cache fits exactly unit A; a shared pool for the rest."""
    lead = tokenizer.encode(load_config().composition.unit_lead)  # every unit starts with the sink token
    a_blocks = blocks_for(len(lead) + len(tokenizer.encode(UNIT_A)), 16)
    cfg = cluster_config(str(tiny_model), nodes=1, local_blocks=a_blocks)
    cluster = start_module_cluster(cfg, tmp_path_factory.mktemp("one-node"))
    yield cfg, cluster


@pytest.fixture(scope="module")
def engine(one_node: tuple[ClusterConfig, LocalCluster]) -> ReferenceEngine:
    return ReferenceEngine.from_config(one_node[0])


def offline(engine: ReferenceEngine, cfg: ClusterConfig, response: dict[str, Any],
            n: int) -> tuple[list[int], torch.Tensor]:
    """The engine's own offline composition of the layout the server used."""
    layout = layout_from_trace(response["tessera_layout"])
    states = prefill_units(engine, layout)
    comp = compose(engine, layout, policy_from_config(cfg.composition), states, max_new_tokens=n,
                   stop_ids=engine.eos_token_ids)
    return comp.generated, torch.log_softmax(comp.logits.float(), dim=-1)


def served_tokens(response: dict[str, Any]) -> list[int]:
    return [e["token_id"] for e in response["choices"][0]["logprobs"]["content"]]


def assert_same_as_offline(engine: ReferenceEngine, cfg: ClusterConfig, response: dict[str, Any]) -> None:
    tokens = served_tokens(response)
    expected, first_lp = offline(engine, cfg, response, len(tokens))
    assert tokens == expected[: len(tokens)]
    for entry in response["choices"][0]["logprobs"]["content"][0]["top_logprobs"]:
        assert entry["logprob"] == pytest.approx(float(first_lp[entry["token_id"]]), abs=1e-3)


def test_local_remote_and_missing_units_compose_like_the_offline_engine(one_node: Any, engine: ReferenceEngine) -> None:
    """A request mixing a local hit, a remote hit and a miss returns what offline composition returns."""
    cfg, cluster = one_node
    url = cfg.retrieval_url
    node_url = f"http://127.0.0.1:{cfg.generation[0].port}"
    r1 = chat(url, [UNIT_A, UNIT_B], "Who keeps the log?")
    assert r1["usage"]["tessera"]["computed_units"] == 2  # nothing is cached yet
    # free space is taken at first sight: A fills the local cache exactly, both go to the shared pool
    wait_for(lambda: node_metric(node_url, "tessera_node_writebacks_published_total", cluster.config) >= 2,
             what="writeback")
    r2 = chat(url, [UNIT_B, UNIT_A], "What grows on the hill?")
    t = r2["usage"]["tessera"]
    assert (t["local_units"], t["remote_units"], t["computed_units"]) == (1, 1, 0), t
    r3 = chat(url, [UNIT_B, UNIT_C, UNIT_A], "When does the ferry leave?")
    t = r3["usage"]["tessera"]
    assert (t["local_units"], t["remote_units"], t["computed_units"]) == (1, 1, 1), t
    assert t["fallbacks"] == 0
    for response in (r1, r2, r3):
        assert_same_as_offline(engine, cfg, response)


def test_openai_client_round_trip(one_node: Any) -> None:
    """The official openai client works unchanged, streaming and not, with extension fields."""
    import openai

    cfg, _ = one_node
    client = openai.OpenAI(base_url=cfg.retrieval_url + "/v1", api_key="unused")
    extra = {"context_units": [UNIT_C], "unit_placement": "user"}
    messages: Any = [{"role": "user", "content": "When does the ferry leave?"}]
    done = client.chat.completions.create(model="tessera", messages=messages, max_tokens=4, temperature=0,
                                          extra_body=extra)
    assert done.choices[0].finish_reason in ("stop", "length")
    assert done.usage is not None and done.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model="tessera", messages=messages, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert [m.id for m in client.models.list()]


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "retrieval": {"query": "x", "scope": "nowhere"}}, 404,
     "unknown scope"),
    ({"messages": [{"role": "user", "content": "hi"}], "context_units": [""]}, 400, "context_units[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "context_units": [{"text": "x", "scope": "bad scope!"}]},
     400, "scope"),
    ({"messages": [{"role": "user", "content": "hi"}], "retrieval": {"query": "q", "top_k": 0}}, 400, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "retrieval": {"query": "q"}, "context_units": ["u"]}, 400,
     "not both"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "context_units": ["word " * 1000, "word " * 1000,
                                                                         "word " * 900]}, 400, "context"),
])
def test_bad_input_is_a_4xx_that_says_what_to_fix(one_node: Any, body: dict[str, Any], status: int,
                                                 needle: str) -> None:
    cfg, _ = one_node
    got, payload = call(cfg.retrieval_url, "/v1/chat/completions", body)
    assert got == status, payload
    assert needle in payload["error"]["message"]


def test_malformed_json_is_a_400(one_node: Any) -> None:
    cfg, _ = one_node
    status, payload = call(cfg.retrieval_url, "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and "JSON" in payload["error"]["message"]


def test_metrics_are_prometheus_text(one_node: Any) -> None:
    cfg, _ = one_node
    status, text = call(cfg.retrieval_url, "/metrics")
    assert status == 200
    for name in ("tessera_requests_total", "tessera_ttft_seconds_bucket", "tessera_prompt_tokens_total",
                 "tessera_fetch_fallbacks_total", "tessera_coalesced_prefills_total", "tessera_bytes_fetched_total",
                 "tessera_node_queued_tokens"):
        assert name in text


def test_the_openapi_schema_of_the_chat_endpoint_is_served(one_node: Any) -> None:
    """GET /openapi.json describes POST /v1/chat/completions with its request schema."""
    cfg, _ = one_node
    status, doc = call(cfg.retrieval_url, "/openapi.json")
    assert status == 200
    assert "post" in doc["paths"]["/v1/chat/completions"]
    assert "ChatCompletionRequest" in doc["components"]["schemas"]


@pytest.fixture
def tcp_cluster(tiny_model: Path, tmp_path: Path, start_cluster: StartCluster) -> Any:
    cfg = cluster_config(str(tiny_model), nodes=2, local_blocks=0, transport="tcp", max_inflight=2)
    cluster = start_cluster(cfg, tmp_path)
    yield cfg, cluster


def test_overload_answers_503_or_429_instead_of_queueing(tcp_cluster: Any) -> None:
    """Beyond the nodes' max_inflight the cluster refuses at once; admitted requests still finish."""
    cfg, _ = tcp_cluster
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 300, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        statuses = [s for s, _ in pool.map(lambda _: call(cfg.retrieval_url, "/v1/chat/completions", body),
                                           range(12))]
    assert statuses.count(200) >= 1
    assert set(statuses) <= {200, 429, 503}
    assert any(s in (429, 503) for s in statuses)


def test_killing_the_kvpool_mid_run_still_answers_every_request(tcp_cluster: Any) -> None:
    """Remote hits whose memory node died fall back to prefill; every request succeeds."""
    cfg, cluster = tcp_cluster
    url = cfg.retrieval_url
    units = [UNIT_A, UNIT_B]
    chat(url, units, "first")
    chat(url, units, "second")  # both units are in the shared pool since the first (no local cache)
    wait_for(lambda: sum(node_metric(f"http://127.0.0.1:{g.port}", "tessera_node_writebacks_published_total",
                                     cluster.config)
                         for g in cfg.generation) >= 2, what="writeback")
    r = chat(url, units, "third")
    assert r["usage"]["tessera"]["remote_units"] == 2  # served from the pool while it lives
    kvpool = next(c for c in cluster.children if c.role == "kvpool")
    os.kill(kvpool.proc.pid, signal.SIGKILL)
    kvpool.proc.wait()
    for i in range(4):
        r = chat(url, units, f"after the crash {i}")
        assert r["choices"][0]["finish_reason"] in ("stop", "length")
    _, text = call(url, "/metrics")
    fallbacks = [ln for ln in text.splitlines() if ln.startswith("tessera_fetch_fallbacks_total ")]
    assert float(fallbacks[0].split()[1]) >= 2
