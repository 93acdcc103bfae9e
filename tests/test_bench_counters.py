"""The bench reads the nodes' writeback counters from the same text the nodes render."""

from __future__ import annotations

from tessera.benchmark.counters import parse
from tessera.metrics import Metrics, counter, gauge


def test_node_counters_are_read_by_name_and_label_from_a_rendered_page() -> None:
    metrics = Metrics()
    metrics.read_at_scrape(lambda: [
        counter("tessera_node_writebacks_published_total", "published", 7),
        counter("tessera_node_writeback_failures_total", "failed", 3),
        counter("tessera_node_writebacks_skipped_total", "skipped", {"over_budget": 1, "not_needed": 2},
                label="reason"),
        gauge("tessera_node_inflight", "not a counter of the report", 5),
    ])
    got = parse(metrics.render().decode())
    assert got == {"writebacks_published": 7.0, "writebacks_failed": 3.0,
                   "writebacks_skipped:over_budget": 1.0, "writebacks_skipped:not_needed": 2.0}
