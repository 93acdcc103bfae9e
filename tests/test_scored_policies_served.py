"""A cluster serving a policy that reads the model (query, deviation): what it serves equals
offline composition, and its receipts name the policy, every knob and the positions the node chose."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cluster import StartCluster, cluster_config
from helpers.http import chat

from tessera.composition.calibration import knobs
from tessera.composition.layout import layout_from_trace
from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.engines.offline import compose, prefill_units
from tessera.engines.reference import ReferenceEngine

UNIT_A = "Record A: the lighthouse keeper logs every passing ship in a blue notebook, page by page. " * 2
UNIT_B = "Record B: the orchard on the hill grows pears, plums and late apples each autumn. " * 2


@pytest.fixture(scope="module", params=["query", "deviation"])
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, start_module_cluster: StartCluster,
           request: pytest.FixtureRequest) -> ClusterConfig:
    """One generation node serving the policy (k=4, a fifth of the other unit tokens)."""
    cfg = cluster_config(str(tiny_model), nodes=1)
    root = tmp_path_factory.mktemp(request.param)
    cfg = dataclasses.replace(cfg, composition=dataclasses.replace(
        cfg.composition, policy=request.param, recompute_tokens=4, recompute_budget=0.2,
        calibration_dir=str(root / "records")))
    start_module_cluster(cfg, root / "logs")
    return cfg


def _offline(engine: ReferenceEngine, cfg: ClusterConfig, reply: dict[str, Any], n: int) -> Any:
    layout = layout_from_trace(reply["tessera_layout"])
    return compose(engine, layout, policy_from_config(cfg.composition), prefill_units(engine, layout),
                   max_new_tokens=n, stop_ids=engine.eos_token_ids)


def test_served_composition_equals_offline_and_its_receipt_counts_what_the_node_chose(
        served: ClusterConfig) -> None:
    """Two requests over the same units (computed, then local): each reply is the engine's own
    offline composition of the served layout, token for token and in its first logprobs, and
    the receipt's recomputed unit tokens are the unit positions offline composition computed."""
    engine = ReferenceEngine.from_config(served)
    replies = [chat(served.retrieval_url, [UNIT_A, UNIT_B], "Who keeps the log?"),
               chat(served.retrieval_url, [UNIT_A, UNIT_B], "What grows on the hill in autumn?")]
    assert replies[1]["usage"]["tessera"]["local_units"] == 2  # the second reuses both states
    chosen = []
    for reply in replies:
        content = reply["choices"][0]["logprobs"]["content"]
        tokens = [e["token_id"] for e in content]
        comp = _offline(engine, served, reply, len(tokens))
        assert tokens == comp.generated[: len(tokens)]
        first = torch.log_softmax(comp.logits.float(), dim=-1)
        for entry in content[0]["top_logprobs"]:
            assert entry["logprob"] == pytest.approx(float(first[entry["token_id"]]), abs=1e-3)
        receipt = reply["usage"]["tessera"]["receipt"]
        assert receipt["policy"] == knobs(served.composition)
        assert receipt["policy"]["recompute_budget"] == 0.2
        spans = reply["tessera_layout"]["units"]
        in_units = {p for a, b in comp.computed for p in range(a, b) if any(s <= p < e for s, e in spans)}
        assert sum(receipt["recomputed_tokens"].values()) == len(in_units)
        chosen.append(in_units)
    if served.composition.policy == "query":
        assert chosen[0] != chosen[1]  # another question, other unit tokens recomputed
