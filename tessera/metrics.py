"""Prometheus metrics of one role process, through ``prometheus_client``.

Each role process builds its own :class:`Metrics` (one ``CollectorRegistry``), never the
library's global default registry, so a test can build several role applications in one
process without "duplicated timeseries" errors. Counters and histograms are incremented on
the serving path; figures that live in other components (a scheduler's queue, the plane's
directory) are read only at scrape time by a :class:`ScrapeCollector`, so the serving path
never keeps a second copy of them.

This module knows nothing about any role: roles name their own metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["TTFT_BUCKETS", "Metric", "Metrics", "ScrapeCollector", "counter", "gauge"]

# the `*_created` timestamp series double every counter's output and no dashboard of ours uses them
disable_created_metrics()  # type: ignore[no-untyped-call]

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 60.0)
# a sample's value: one number, or one number per value of a single label
Sample = float | Mapping[str, float]


class ScrapeCollector(Collector):
    """Reads figures owned by other components when ``/metrics`` is scraped."""

    def __init__(self, read: Callable[[], Iterable[Metric]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        return self._read()

    def describe(self) -> Iterable[Metric]:
        return ()  # names are only known at scrape time; the registry skips its duplicate check


def gauge(name: str, help_text: str, value: Sample, label: str = "") -> GaugeMetricFamily:
    """A scrape-time gauge: ``value`` is a number, or ``{label value: number}`` when ``label`` is set."""
    if not isinstance(value, Mapping):
        return GaugeMetricFamily(name, help_text, value=value)
    family = GaugeMetricFamily(name, help_text, labels=[label])
    for key, v in sorted(value.items()):
        family.add_metric([key], v)
    return family


def counter(name: str, help_text: str, value: Sample, label: str = "") -> CounterMetricFamily:
    """A scrape-time counter owned by another component (``name`` ends in ``_total`` on the wire);
    ``value`` is a number, or ``{label value: number}`` when ``label`` is set."""
    if not isinstance(value, Mapping):
        return CounterMetricFamily(name.removesuffix("_total"), help_text, value=value)
    family = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=[label])
    for key, v in sorted(value.items()):
        family.add_metric([key], v)
    return family


class Metrics:
    """One role process's registry; the factories bind each metric to it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, help_text, labelnames=labels, registry=self.registry)

    def gauge(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, help_text, labelnames=labels, registry=self.registry)

    def histogram(self, name: str, help_text: str, buckets: Sequence[float] = TTFT_BUCKETS) -> Histogram:
        return Histogram(name, help_text, buckets=buckets, registry=self.registry)

    def read_at_scrape(self, read: Callable[[], Iterable[Metric]]) -> None:
        """Register ``read``, called at every scrape, for figures that other components own."""
        self.registry.register(ScrapeCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def response(self) -> web.Response:
        """The Prometheus text exposition as an aiohttp response."""
        return web.Response(body=self.render(), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
