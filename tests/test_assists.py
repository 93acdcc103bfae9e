"""Assists on a real cluster: an idle node prefills some of a cold request's units at once.

Real retrieval, KV pool and two generation processes (tiny random Llama). A request whose
four units are all cold goes to one node; the plane gives the other (idle) node about half
of them, which it prefills and publishes while the serving node prefills its own; the serving
node fetches the helper's units and composes. The reply must be exactly offline
composition's, and the helper's and the serving node's counters must show who did what. The
generation node's assist endpoint refuses orders that are not its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cluster import StartCluster, cluster_config
from helpers.http import call, chat, metrics_text, wait_for

from tessera.composition.layout import layout_from_trace
from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.engines.offline import compose, prefill_units
from tessera.engines.reference import ReferenceEngine
from tessera.launcher import LocalCluster

UNITS = [
    "Record 1: the lighthouse keeper logs every passing ship in a blue notebook, with the hour and the flag. " * 2,
    "Record 2: the orchard on the hill grows pears, plums and late apples, picked by the whole village. " * 2,
    "Record 3: the ferry leaves the harbour at seven and returns before dusk unless the wind turns east. " * 2,
    "Record 4: the bakery on the square opens at five; its rye loaves are gone by eight most mornings. " * 2,
]


@pytest.fixture(scope="module")
def two_nodes(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
              start_module_cluster: StartCluster) -> tuple[ClusterConfig, LocalCluster]:
    cfg = cluster_config(str(tiny_model), nodes=2, assist_min_tokens=16)
    return cfg, start_module_cluster(cfg, tmp_path_factory.mktemp("assists"))


def assisted_units(cfg: ClusterConfig, node: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{cfg.generation[node].port}"
    out = {}
    for line in metrics_text(url, cfg).splitlines():
        if line.startswith("tessera_node_assisted_units_total{"):
            out[line.split('outcome="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_cold_request_is_prefilled_on_both_nodes_and_composes_like_offline(
        two_nodes: tuple[ClusterConfig, LocalCluster]) -> None:
    cfg, _ = two_nodes
    r = chat(cfg.retrieval_url, UNITS, "Which record mentions pears?")
    t: dict[str, Any] = r["usage"]["tessera"]
    serving = int(t["node"].removeprefix("gen"))
    helper = 1 - serving
    units = t["receipt"]["units"]
    # the helper took about half of the cold units (the largest first, at most half of the tokens)
    assert units["peer"] in (1, 2) and units["computed"] == 4 - units["peer"], t
    assert (t["computed_units"], t["remote_units"], t["fallbacks"]) == (4, 0, 0), t
    assert assisted_units(cfg, helper)["handed_to_writeback"] == units["peer"]
    assert assisted_units(cfg, serving)["handed_to_writeback"] == 0

    engine = ReferenceEngine.from_config(cfg)
    layout = layout_from_trace(r["tessera_layout"])
    tokens = [e["token_id"] for e in r["choices"][0]["logprobs"]["content"]]
    comp = compose(engine, layout, policy_from_config(cfg.composition), prefill_units(engine, layout),
                   max_new_tokens=len(tokens), stop_ids=engine.eos_token_ids)
    assert tokens == comp.generated[: len(tokens)]
    first = torch.log_softmax(comp.logits.float(), dim=-1)
    for entry in r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]:
        assert entry["logprob"] == pytest.approx(float(first[entry["token_id"]]), abs=1e-3)

    # every unit is in the shared tier now: the next request with them computes nothing
    wait_for(lambda: chat(cfg.retrieval_url, UNITS[::-1], "Who keeps the log?")["usage"]["tessera"]
             ["computed_units"] == 0, what="the units to be published")


def test_the_assist_endpoint_refuses_orders_that_are_not_its_own(
        two_nodes: tuple[ClusterConfig, LocalCluster]) -> None:
    cfg, cluster = two_nodes
    gen0 = f"http://127.0.0.1:{cfg.generation[0].port}"
    grant = {"unit_id": "u", "epoch": 1, "blocks": [{"node": "kv0", "index": 0}], "writer": "gen0", "n_tokens": 2,
             "deadline_s": 30.0}
    unit = {"unit_id": "u", "n_tokens": 2, "preparation": "compute", "retention": "shared", "grant": grant}
    plan = {"version": 1, "request_id": "r-forged", "node": "gen0", "units": [unit], "term": 0, "seal": "00" * 32}
    texts = [{"unit_id": "u", "token_ids": [5, 6]}]
    before = assisted_units(cfg, 0)
    for body, status, needle in [
        ({"version": 1, "plan": {**plan, "node": "gen1"}, "units": texts}, 400, "is for node 'gen1'"),
        ({"version": 1, "plan": plan, "units": [{"unit_id": "u", "token_ids": [5]}]}, 400, "1 token ids"),
        ({"version": 1, "plan": plan, "units": [{"unit_id": "v", "token_ids": [5, 6]}]}, 400, "once"),
        ({"version": 1, "plan": {**plan, "units": [{**unit, "grant": {**grant, "writer": "gen1"}}]},
          "units": texts}, 400, "write grant of 'gen0'"),
        ({"version": 1, "plan": plan, "units": texts}, 503, "without a valid seal"),
    ]:
        got, answer = call(gen0, "/v1/prefill", body, signed=cluster.config)
        assert got == status and needle in str(answer), (body, got, answer)
    # unsigned: the cluster-secret middleware refuses before reading
    got, _ = call(gen0, "/v1/prefill", {"version": 1, "plan": plan, "units": texts})
    assert got in (401, 403)
    assert assisted_units(cfg, 0) == before  # nothing was prefilled for any of them
