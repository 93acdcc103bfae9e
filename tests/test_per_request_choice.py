"""The per-request choice under the gate: only calibrated settings that meet the targets compose,
each prompt gets the one whose final extend computes the fewest positions, and a missing or
failing record falls back (to another setting, or full prefill)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tessera.composition.calibration import BadRecord, Fingerprint, calibrated_settings, write_record
from tessera.composition.choice import Choices
from tessera.composition.policies import get_policy
from tessera.config import CompositionConfig
from tessera.errors import ConfigError
from tessera.generation.executor import Executor
from tessera.messages.generation import ExecuteRequest
from tessera.messages.plan import RequestPlan
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
from tessera.wire import WIRE_VERSION

MODEL = "tiny:abc"
EPIC16 = {"policy": "epic", "recompute_tokens": 16}
EPIC4 = {"policy": "epic", "recompute_tokens": 4}
QUERY8 = {"policy": "query", "recompute_tokens": 8, "recompute_budget": 0.05}


def layout(*unit_lengths: int) -> PromptLayout:
    segments = [Segment(SegmentKind.TEXT, (1, 2, 3))]
    for i, n in enumerate(unit_lengths):
        segments += [Segment(SegmentKind.UNIT, tuple(range(10, 10 + n)), f"u{i}"), Segment(SegmentKind.TEXT, (4,))]
    return PromptLayout((*segments, Segment(SegmentKind.TEXT, (5, 6))))


def gate_config(directory: Path, **over: object) -> CompositionConfig:
    return CompositionConfig(per_request=True, max_kl=0.2, min_agreement=0.35, calibration_dir=str(directory),
                             **over)  # type: ignore[arg-type]


def record(base: CompositionConfig, setting: dict[str, object], kl: float, agreement: float = 0.5,
           model: str = MODEL, engine: str = "reference") -> None:
    config = dataclasses.replace(base, **setting)  # type: ignore[arg-type]
    fp = Fingerprint.of(config, model, "float32", "float16", engine)
    write_record(Path(base.calibration_dir), fp, {"mean": kl, "lo": kl, "hi": kl},
                 {"mean": agreement, "lo": 0.0, "hi": 1.0}, 8, "test")


def choices(config: CompositionConfig) -> Choices:
    return Choices.gate(config, MODEL, "float32", "float16", "reference")[0]


def test_without_records_every_prompt_is_served_with_full_prefill(tmp_path: Path) -> None:
    c = choices(gate_config(tmp_path))
    chosen, served = c.choose(layout(100))
    assert c.labels == [] and chosen.decision.status == "fallback-full" and chosen.policy.name == "full"
    assert served == layout(100)


def test_only_settings_whose_record_meets_the_targets_may_compose(tmp_path: Path) -> None:
    config = gate_config(tmp_path)
    record(config, EPIC16, kl=0.15)
    record(config, EPIC4, kl=0.3)  # misses max_kl
    record(config, QUERY8, kl=0.1, agreement=0.2)  # misses min_agreement
    calibrated, passed = calibrated_settings(config, MODEL, "float32", "float16")
    assert [d.served.recompute_tokens for d in calibrated] == [16]
    assert sum("misses the targets" in why for why in passed) == 2
    assert choices(config).choose(layout(100))[0].label == "epic k=16 f=0.25 inline=0.75 lead=none"


def test_records_of_another_model_engine_or_unit_lead_are_passed_over(tmp_path: Path) -> None:
    config = gate_config(tmp_path)
    record(config, EPIC16, kl=0.1, model="other:123")
    record(config, EPIC16, kl=0.1, engine="sglang")
    record(dataclasses.replace(config, unit_lead="<|endoftext|>"), EPIC16, kl=0.1)
    calibrated, passed = calibrated_settings(config, MODEL, "float32", "float16")
    assert calibrated == [] and sorted(why.split(": ", 1)[1] for why in passed) == [
        "another engine", "another model", "another unit_lead"]


def test_each_prompt_gets_the_setting_that_computes_the_fewest_positions(tmp_path: Path) -> None:
    """Long units: query's 8 heads and 5% of the rest cost less than epic's 16 heads; a short
    unit: epic's length-aware head (a quarter of it) costs less than query's head and budget."""
    config = gate_config(tmp_path)
    record(config, EPIC16, kl=0.15)
    record(config, QUERY8, kl=0.12)
    c = choices(config)
    long_units, short_unit = layout(100, 100), layout(20)
    epic, query = get_policy("epic"), get_policy("query", recompute_tokens=8, recompute_budget=0.05)
    assert query.extend_tokens(long_units) < epic.extend_tokens(long_units)
    assert epic.extend_tokens(short_unit) < query.extend_tokens(short_unit)
    assert c.choose(long_units)[0].policy.name == "query"
    assert c.choose(short_unit)[0].policy.name == "epic"


def test_a_tie_goes_to_the_lower_calibrated_kl(tmp_path: Path) -> None:
    config = gate_config(tmp_path)
    record(config, EPIC16, kl=0.15)
    record(config, {"policy": "epic", "recompute_tokens": 16, "inline_share": 0.9}, kl=0.05)
    assert choices(config).choose(layout(100))[0].policy.inline_share == 0.9  # type: ignore[attr-defined]


def test_a_query_policys_price_is_known_without_the_model() -> None:
    """extend_tokens needs no probe, and is what select computes once the model is read."""
    query = get_policy("query", recompute_tokens=8, recompute_budget=0.05)
    ranges = query.bound(_FlatProbe()).select(layout(100, 30))
    assert query.extend_tokens(layout(100, 30)) == sum(b - a for a, b in ranges)


class _FlatProbe:
    probes_model = True

    def first_layer_attention(self, token_ids: list[int], query_from: int) -> list[float]:
        return [float(i % 7) for i in range(len(token_ids))]

    def second_layer_deviation(self, token_ids: list[int], units: list[tuple[int, int]]) -> list[float]:
        return [0.0] * len(token_ids)


def test_an_untrusted_record_stops_a_gated_role_and_is_passed_over_without_the_gate(tmp_path: Path) -> None:
    config = gate_config(tmp_path)
    record(config, EPIC16, kl=0.1)
    (next(tmp_path.glob("*.json"))).chmod(0o666)
    calibrated, passed = calibrated_settings(config, MODEL, "float32", "float16")
    assert calibrated == [] and "may be written by other users" in passed[0]
    with pytest.raises(BadRecord, match="may be written by other users"):
        calibrated_settings(dataclasses.replace(config, require_calibration=True), MODEL, "float32", "float16")


def test_a_node_refuses_a_setting_it_has_no_record_for(tmp_path: Path) -> None:
    config = gate_config(tmp_path)
    record(config, EPIC16, kl=0.1)
    executor = Executor(None, None, None, None, None, print, get_policy("epic"), "compose",  # type: ignore[arg-type]
                        choices(config))
    plan = RequestPlan(WIRE_VERSION, "r1", "gen0", ())
    named = ExecuteRequest(WIRE_VERSION, "r1", layout(10), plan, setting="epic k=16 f=0.25 inline=0.75 lead=none")
    assert executor._policy(named).name == "epic"
    with pytest.raises(ConfigError, match="no calibration record"):
        executor._policy(dataclasses.replace(named, setting="epic k=2 f=0.25 inline=0.75 lead=none"))
    assert executor._policy(dataclasses.replace(named, setting="")) is executor.policy
