"""End to end with the bundled SmolLM2-135M-Instruct: real answers, coalesced misses."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
from helpers.cluster import StartCluster, cluster_config
from helpers.http import chat, node_metric

pytestmark = pytest.mark.model

VAULT = "Security memo: the museum vault opens with the code 7421."
GARDEN = ("Garden notes. The museum garden has forty rose bushes, a fountain with bronze fish and "
          "a bench dedicated to the founder, who planted the first oak tree there in 1911.")


def test_smollm2_cluster_answers_from_units_and_prefills_a_shared_miss_once(tmp_path: Path,
        start_cluster: StartCluster) -> None:
    """Requests missing the same units share one prefill per unit on the node; the answer uses the unit."""
    cfg = cluster_config("smollm2", nodes=1, threads=2)
    cluster = start_cluster(cfg, tmp_path)
    url = cfg.retrieval_url
    questions = ["What is the vault code? Answer with the number only.", "Who knows the vault code?",
                 "How many rose bushes are there?", "When was the oak tree planted?"]
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        responses = list(pool.map(
            lambda q: chat(url, [VAULT, GARDEN], q, max_tokens=30, unit_placement="user"), questions))
    node_url = f"http://127.0.0.1:{cfg.generation[0].port}"
    assert node_metric(node_url, "tessera_node_unit_prefills_total", cluster.config) == 2
    # every other use joined the in-flight prefill or, when its request came later (a loaded
    # machine), found the unit retained in the local cache: never a second prefill
    usage = [r["usage"]["tessera"] for r in responses]
    assert sum(u["coalesced_units"] + u["local_units"] for u in usage) == 2 * len(questions) - 2
    assert "7421" in responses[0]["choices"][0]["message"]["content"]
