"""A cluster serving order-free requests: their units are deduplicated, never changed, and
ordered so that what an earlier prompt began with is served exactly from the prefix cache (in
prefix mode whole units; composing, what precedes the first placed state); receipts and metrics
say how each prompt was served."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from helpers.cluster import StartCluster, cluster_config
from helpers.http import chat, metrics_text

from tessera.config import ClusterConfig

A = "Record A: the lighthouse keeper logs every passing ship in a blue notebook, page by page."
B = "Record B: the orchard on the hill grows pears, plums and late apples each autumn."
C = "Record C: the ferry to the island leaves at seven and returns before the storm."
D = "Record D: the baker on the corner sells rye bread on Tuesdays and Fridays only."


def _start(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, start_module_cluster: StartCluster,
           mode: str) -> ClusterConfig:
    """One generation node (every prompt meets the same prefix cache); scopes "free/*" are order-free."""
    cfg = cluster_config(str(tiny_model), nodes=1, mode=mode)
    cfg = dataclasses.replace(cfg, retrieval=dataclasses.replace(cfg.retrieval, order_free_scopes=("free/*",)))
    start_module_cluster(cfg, tmp_path_factory.mktemp(f"order-free-{mode}") / "logs")
    return cfg


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
           start_module_cluster: StartCluster) -> ClusterConfig:
    """Tessera composing (the default policy)."""
    return _start(tiny_model, tmp_path_factory, start_module_cluster, "compose")


@pytest.fixture(scope="module")
def prefixing(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
              start_module_cluster: StartCluster) -> ClusterConfig:
    """Exact prefix caching only (as when the fidelity gate serves full prefill)."""
    return _start(tiny_model, tmp_path_factory, start_module_cluster, "prefix")


def spans(reply: dict[str, Any]) -> list[tuple[int, ...]]:
    """The token ids of each unit of the served prompt, in prompt order."""
    layout = reply["tessera_layout"]
    return [tuple(layout["tokens"][a:b]) for a, b in layout["units"]]


def sources(reply: dict[str, Any]) -> list[str]:
    return [u["source"] for u in reply["usage"]["tessera"]["receipt"]["per_unit"]]


def test_a_free_request_keeps_each_of_its_units_once_and_unchanged(served: ClusterConfig) -> None:
    """The same units with repeats, fixed and free: the free prompt holds exactly the distinct
    unit texts of the fixed one, each once."""
    fixed = chat(served.retrieval_url, [A, B, A, C, B], scope="s1", unit_order="fixed")
    free = chat(served.retrieval_url, [A, B, A, C, B], scope="s1", unit_order="free")
    assert len(spans(fixed)) == 5 and len(spans(free)) == 3
    assert set(spans(free)) == set(spans(fixed))


def test_units_an_earlier_prompt_began_with_lead_and_are_served_exactly(prefixing: ClusterConfig) -> None:
    """After [A, B], a free request for [B, D, A] is served as [A, B, D]: A and B come from the
    prefix cache (source "prefix"), exactly; the same request with its order fixed is not."""
    url = prefixing.retrieval_url
    first = chat(url, [A, B], scope="s2", unit_order="free")
    assert first["usage"]["tessera"]["receipt"]["way"] == "exact"
    later = chat(url, [B, D, A], scope="s2", unit_order="free")
    assert spans(later)[:2] == spans(first)
    assert sources(later)[:2] == ["prefix", "prefix"]
    fixed = chat(url, [B, D, A], scope="s2", unit_order="fixed")
    assert "prefix" not in sources(fixed)


def test_a_free_order_seen_twice_is_served_exactly_and_then_from_the_prefix_cache(
        served: ClusterConfig) -> None:
    """First sight: composed (its cold units are kept, so composing is cheaper than computing it
    whole), leaving in the prefix cache the lead and the first unit's recomputed head. Second
    sight, in any order: the hit covers that much, and the rest is computed exactly. Third
    sight, with another question: both units come from the prefix cache."""
    url = served.retrieval_url
    first = chat(url, [C, D], "Which ferry?", scope="s3", unit_order="free")
    assert first["usage"]["tessera"]["receipt"]["way"] == "composed"
    again = chat(url, [D, C], "Which ferry?", scope="s3", unit_order="free")
    assert spans(again) == spans(first)
    lead = again["usage"]["tessera"]["receipt"]["per_unit"][0]["offset"]
    assert lead < again["usage"]["tessera"]["prefix_cached_tokens"] < lead + len(spans(again)[0])
    assert again["usage"]["tessera"]["receipt"]["way"] == "exact"
    third = chat(url, [C, D], "When does it return?", scope="s3", unit_order="free")
    assert sources(third) == ["prefix", "prefix"]


def test_a_scope_listed_as_order_free_is_free_unless_the_request_says_fixed(served: ClusterConfig) -> None:
    url = served.retrieval_url
    assert len(spans(chat(url, [D, D], scope="free/x"))) == 1
    assert len(spans(chat(url, [D, D], scope="free/x", unit_order="fixed"))) == 2
    assert len(spans(chat(url, [D, D], scope="other"))) == 2


def test_the_way_each_reply_was_served_is_counted(served: ClusterConfig, prefixing: ClusterConfig) -> None:
    for cfg, way in ((served, "composed"), (prefixing, "exact")):
        before = _way_count(cfg, way)
        chat(cfg.retrieval_url, [A, C], "Anything else?", scope="s4", unit_order="free")
        assert _way_count(cfg, way) == before + 1


def _way_count(cfg: ClusterConfig, way: str) -> float:
    for line in metrics_text(cfg.retrieval_url).splitlines():
        if line.startswith(f'tessera_requests_by_way_total{{way="{way}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
