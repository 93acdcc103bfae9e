"""One served scenario, reusable per engine and device: a request mixing a local hit, a remote hit
and a miss, whose tokens must equal the same engine's offline composition."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.cluster import cluster_config
from helpers.http import chat, node_metric, wait_for
from tessera.composition.layout import layout_from_trace
from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.config_file import load_config
from tessera.engines.base import ENGINES, EngineAdapter
from tessera.engines.offline import compose, prefill_units
from tessera.engines.tokenizer import Tokenizer
from tessera.launcher import LocalCluster
from tessera.units import blocks_for

UNIT_A = "Record A: the lighthouse keeper logs every passing ship in a blue notebook. " * 2
UNIT_B = "Record B: the orchard on the hill grows pears, plums and late apples each autumn. " * 2
UNIT_C = "Record C: the ferry leaves the harbour at seven and returns before dusk. " * 3


def mixed_config(model: Path, tokenizer: Tokenizer, *, engine: str, device: str,
                 dtype: str = "float32") -> ClusterConfig:
    """One generation node whose local cache fits exactly unit A; a shared pool for the rest."""
    lead = tokenizer.encode(load_config().composition.unit_lead)  # every unit starts with the sink token
    a_blocks = blocks_for(len(lead) + len(tokenizer.encode(UNIT_A)), 16)
    cfg = cluster_config(str(model), nodes=1, local_blocks=a_blocks)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engine=engine, device=device, dtype=dtype,
                                                              kv_pool_tokens=16384))


def served_tokens(response: dict[str, Any]) -> list[int]:
    return [e["token_id"] for e in response["choices"][0]["logprobs"]["content"]]


def assert_same_as_offline(engine: EngineAdapter, cfg: ClusterConfig, response: dict[str, Any]) -> None:
    """Served tokens and first-token logprobs equal the engine's own offline composition of the layout."""
    tokens = served_tokens(response)
    layout = layout_from_trace(response["tessera_layout"])
    comp = compose(engine, layout, policy_from_config(cfg.composition), prefill_units(engine, layout),
                   max_new_tokens=len(tokens), stop_ids=engine.eos_token_ids)
    assert tokens == comp.generated[: len(tokens)]
    first = torch.log_softmax(comp.logits.float(), dim=-1).cpu()
    for entry in response["choices"][0]["logprobs"]["content"][0]["top_logprobs"]:
        assert entry["logprob"] == pytest.approx(float(first[entry["token_id"]]), abs=1e-3)


def run_mixed_scenario(cfg: ClusterConfig, start_cluster: Callable[[ClusterConfig, Path], LocalCluster],
                       log_dir: Path) -> None:
    """Serve three requests (the third: local A, remote B, missing C) and check each against offline.

    ``start_cluster``: the fixture; the cluster is stopped before the offline engine loads.
    """
    cluster = start_cluster(cfg, log_dir)
    url = cfg.retrieval_url
    node_url = f"http://127.0.0.1:{cfg.generation[0].port}"
    r1 = chat(url, [UNIT_A, UNIT_B], "Who keeps the log?")
    r2 = chat(url, [UNIT_B, UNIT_A], "What grows on the hill?")
    wait_for(lambda: node_metric(node_url, "tessera_node_writebacks_published_total", cluster.config) >= 2,
             what="writeback")
    r3 = chat(url, [UNIT_B, UNIT_C, UNIT_A], "When does the ferry leave?")
    cluster.stop()
    t = r3["usage"]["tessera"]
    assert (t["local_units"], t["remote_units"], t["computed_units"], t["fallbacks"]) == (1, 1, 1, 0), t
    engine = ENGINES.get(cfg.model.engine).from_config(cfg, 4096)
    for response in (r1, r2, r3):
        assert_same_as_offline(engine, cfg, response)
