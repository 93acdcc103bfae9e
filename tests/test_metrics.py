"""Prometheus exposition of a role's metrics (prometheus_client, one registry per role)."""

from __future__ import annotations

from typing import cast

from prometheus_client.parser import text_string_to_metric_families

from tessera.control.plane import ControlPlane
from tessera.messages.generation import RequestStats
from tessera.metrics import Metric, Metrics, counter, gauge
from tessera.retrieval.chat.metrics import ChatMetrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_counters_gauges_and_histograms_render_as_prometheus_text() -> None:
    """Labelled counters add up, gauges keep the last value, histogram buckets are cumulative."""
    m = Metrics()
    c = m.counter("t_requests_total", "Requests", ["status"])
    c.labels(status="200").inc()
    c.labels(status="200").inc(2)
    m.gauge("t_inflight", "In flight", ["node"]).labels(node='g"0').set(3)
    h = m.histogram("t_ttft_seconds", "TTFT", buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    text = m.render().decode()
    assert "# TYPE t_requests_total counter" in text
    samples = _samples(text)
    assert samples[("t_requests_total", (("status", "200"),))] == 3
    assert samples[("t_inflight", (("node", 'g"0'),))] == 3
    assert samples[("t_ttft_seconds_bucket", (("le", "0.1"),))] == 1
    assert samples[("t_ttft_seconds_bucket", (("le", "1.0"),))] == 2
    assert samples[("t_ttft_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("t_ttft_seconds_count", ())] == 3
    assert "_created" not in text


def test_two_registries_in_one_process_do_not_collide() -> None:
    """Each role builds its own registry, so two apps in one test process may use the same names."""
    first, second = Metrics(), Metrics()
    first.counter("t_same_total", "Same name").inc()
    second.counter("t_same_total", "Same name").inc(5)
    assert _samples(first.render().decode())[("t_same_total", ())] == 1
    assert _samples(second.render().decode())[("t_same_total", ())] == 5


def test_scrape_time_figures_are_read_at_every_scrape() -> None:
    """Figures owned by another component are read when scraped, not copied on the serving path."""
    m = Metrics()
    queued = {"gen0": 3.0, "gen1": 0.0}
    published = [1]
    m.read_at_scrape(lambda: [gauge("t_queued_tokens", "Queued", queued, label="node"),
                              counter("t_published_total", "Published", published[0])])
    assert _samples(m.render().decode())[("t_queued_tokens", (("node", "gen0"),))] == 3
    queued["gen0"] = 7.0
    published[0] = 4
    samples = _samples(m.render().decode())
    assert samples[("t_queued_tokens", (("node", "gen0"),))] == 7
    assert samples[("t_published_total", ())] == 4


def test_a_scrape_time_counter_may_carry_one_label() -> None:
    """The generation node's engine CPU by call: one labelled counter family, read at scrape time."""
    m = Metrics()
    by_call = {"step": 1.5, "place_units": 0.25}
    m.read_at_scrape(lambda: [counter("t_engine_cpu_seconds_total", "Engine CPU", by_call, label="call")])
    text = m.render().decode()
    assert 't_engine_cpu_seconds_total{call="step"} 1.5' in text
    assert _samples(text)[("t_engine_cpu_seconds_total", (("call", "place_units"),))] == 0.25


class NoPlane:
    """A control plane with no figures of its own to scrape."""

    def metrics(self) -> list[Metric]:
        return []


def test_a_unit_prefill_two_replies_share_counts_as_computed_tokens_once() -> None:
    """The retrieval role's computed-token counter counts one forward pass once: the reply that
    joined another's prefill of the unit adds to the coalesced label instead."""
    chat = ChatMetrics(lambda: cast(ControlPlane, NoPlane()))
    ran = RequestStats(prompt_tokens=9, computed_unit_tokens=4, computed_units=1, recomputed_tokens=5)
    joined = RequestStats(prompt_tokens=9, coalesced_unit_tokens=4, coalesced_units=1, recomputed_tokens=5)
    for stats in (ran, joined):
        chat.finished(stats, {"units": {}, "unit_tokens": {}, "recomputed_tokens": {}, "way": "composed"})
    samples = _samples(chat.registry.render().decode())
    assert samples[("tessera_prompt_tokens_total", (("source", "computed"),))] == 4
    assert samples[("tessera_prompt_tokens_total", (("source", "coalesced"),))] == 4
    assert samples[("tessera_units_total", (("preparation", "computed"),))] == 1
    assert samples[("tessera_units_total", (("preparation", "coalesced"),))] == 1
    assert samples[("tessera_coalesced_prefills_total", ())] == 1
