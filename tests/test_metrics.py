"""Prometheus text rendering of the serving metrics."""

from __future__ import annotations

from tessera.metrics import Registry


def test_counters_gauges_and_histograms_render_as_prometheus_text() -> None:
    reg = Registry()
    c = reg.counter("t_requests_total", "Requests")
    c.inc(labels={"status": "200"})
    c.inc(2, labels={"status": "200"})
    g = reg.gauge("t_inflight", "In flight")
    g.set(3, {"node": 'g"0'})
    h = reg.histogram("t_ttft_seconds", "TTFT", buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    text = reg.render()
    assert '# TYPE t_requests_total counter' in text
    assert 't_requests_total{status="200"} 3' in text
    assert 't_inflight{node="g\\"0"} 3' in text
    assert 't_ttft_seconds_bucket{le="0.1"} 1' in text
    assert 't_ttft_seconds_bucket{le="1"} 2' in text
    assert 't_ttft_seconds_bucket{le="+Inf"} 3' in text
    assert "t_ttft_seconds_count 3" in text and h.count() == 3
