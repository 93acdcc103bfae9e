"""A cluster choosing the composition setting per request: the receipt names the setting each
prompt got, the node serves exactly it (offline composition with that policy gives the same
tokens), the metrics count each, and without a record every request is served with full prefill."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from helpers.cluster import StartCluster, cluster_config
from helpers.http import chat, metrics_text

from tessera.composition.calibration import Fingerprint, knobs, write_record
from tessera.composition.layout import layout_from_trace
from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.engines.offline import compose, prefill_units
from tessera.engines.reference import ReferenceEngine

LONG = ["Record A: the lighthouse keeper logs every passing ship in a blue notebook, page by page. " * 5,
        "Record B: the orchard on the hill grows pears, plums and late apples each autumn, row by row. " * 5]
SHORT = ["The ferry leaves at seven."]
QUERY = {"policy": "query", "recompute_tokens": 8, "recompute_budget": 0.05}


def _cluster(tiny_model: Path, root: Path, start: StartCluster, settings: list[dict[str, Any]]) -> ClusterConfig:
    cfg = cluster_config(str(tiny_model), nodes=1)
    cfg = dataclasses.replace(cfg, composition=dataclasses.replace(
        cfg.composition, per_request=True, calibration_dir=str(root / "records")))
    model = ReferenceEngine.from_config(cfg).fingerprint.model
    for setting in settings:
        fp = Fingerprint.of(dataclasses.replace(cfg.composition, **setting), model, cfg.model.dtype, cfg.kv_dtype,
                            cfg.model.engine)
        write_record(root / "records", fp, {"mean": 0.1, "lo": 0.05, "hi": 0.15},
                     {"mean": 0.6, "lo": 0.5, "hi": 0.7}, 24, "test")
    start(cfg, root / "logs")
    return cfg


@pytest.fixture(scope="module")
def chooser(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
            start_module_cluster: StartCluster) -> ClusterConfig:
    """Records for the default epic and for query k=8 with a 5% budget, both meeting the targets."""
    return _cluster(tiny_model, tmp_path_factory.mktemp("choice"), start_module_cluster, [{}, QUERY])


def _receipt(reply: dict[str, Any]) -> dict[str, Any]:
    return reply["usage"]["tessera"]["receipt"]  # type: ignore[no-any-return]


def test_each_prompt_is_served_with_the_cheapest_calibrated_setting(chooser: ClusterConfig) -> None:
    """Long units go to query (8 heads and 5% of the rest), a short unit to epic (a quarter of
    it); each reply's tokens are offline composition's with the policy its receipt names."""
    engine = ReferenceEngine.from_config(chooser)
    for units, policy in ((LONG, "query"), (SHORT, "epic")):
        reply = chat(chooser.retrieval_url, units, "Who keeps the log?")
        receipt = _receipt(reply)
        assert receipt["policy"]["policy"] == policy and receipt["choice"] == "per-request"
        assert receipt["calibration"] == "calibrated" and receipt["fidelity"]["prompts"] == 24
        config = dataclasses.replace(chooser.composition, **{k: v for k, v in receipt["policy"].items()})
        assert knobs(config) == receipt["policy"]
        layout = layout_from_trace(reply["tessera_layout"])
        content = reply["choices"][0]["logprobs"]["content"]
        offline = compose(engine, layout, policy_from_config(config).bound(engine), prefill_units(engine, layout),
                          max_new_tokens=len(content), stop_ids=engine.eos_token_ids, use_prefix_cache=False)
        assert [e["token_id"] for e in content] == offline.generated[: len(content)]
    text = metrics_text(chooser.retrieval_url)
    assert 'tessera_requests_by_setting_total{setting="policy=query recompute_tokens=8' in text
    assert 'tessera_requests_by_setting_total{setting="policy=epic recompute_tokens=16' in text


def test_without_a_calibrated_setting_every_request_is_served_with_full_prefill(
        tiny_model: Path, tmp_path: Path, start_cluster: StartCluster) -> None:
    cfg = _cluster(tiny_model, tmp_path, start_cluster, [])
    receipt = _receipt(chat(cfg.retrieval_url, LONG))
    assert receipt["policy"]["policy"] == "full" and receipt["calibration"] == "fallback-full"
    assert "tessera verify --calibrate" in receipt["reason"]
