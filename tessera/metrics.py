"""Prometheus text-format metrics: counters, gauges and histograms with labels.

Small on purpose: the serving path increments plain dict entries; rendering happens only on
``GET /metrics``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

Labels = tuple[tuple[str, str], ...]

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 60.0)


def _labels(labels: dict[str, str] | None) -> Labels:
    return tuple(sorted((labels or {}).items()))


def _fmt_labels(labels: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    inner = ",".join(f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in items)
    return "{" + inner + "}"


def _fmt_value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


class Metric:
    kind = ""

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", *self._samples()]

    def _samples(self) -> list[str]:
        raise NotImplementedError


class Counter(Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, labels: dict[str, str] | None = None) -> None:
        assert amount >= 0, f"counter {self.name} decremented by {amount}"
        key = _labels(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, labels: dict[str, str] | None = None) -> float:
        return self.values.get(_labels(labels), 0.0)

    def _samples(self) -> list[str]:
        return [f"{self.name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in sorted(self.values.items())]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, labels: dict[str, str] | None = None) -> None:
        self.values[_labels(labels)] = value


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = TTFT_BUCKETS) -> None:
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self.counts: dict[Labels, list[int]] = {}
        self.sums: dict[Labels, float] = {}

    def observe(self, value: float, labels: dict[str, str] | None = None) -> None:
        key = _labels(labels)
        counts = self.counts.setdefault(key, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sums[key] = self.sums.get(key, 0.0) + value

    def count(self, labels: dict[str, str] | None = None) -> int:
        return sum(self.counts.get(_labels(labels), []))

    def _samples(self) -> list[str]:
        out: list[str] = []
        for key, counts in sorted(self.counts.items()):
            cumulative = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += n
                out.append(f"{self.name}_bucket{_fmt_labels(key, (('le', _fmt_value(bound)),))} {cumulative}")
            out.append(f"{self.name}_sum{_fmt_labels(key)} {_fmt_value(self.sums[key])}")
            out.append(f"{self.name}_count{_fmt_labels(key)} {cumulative}")
        return out


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}

    def _add(self, metric: Metric) -> Metric:
        assert metric.name not in self._metrics, f"metric {metric.name} registered twice"
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help_text: str) -> Counter:
        metric = self._add(Counter(name, help_text))
        assert isinstance(metric, Counter)
        return metric

    def gauge(self, name: str, help_text: str) -> Gauge:
        metric = self._add(Gauge(name, help_text))
        assert isinstance(metric, Gauge)
        return metric

    def histogram(self, name: str, help_text: str, buckets: Sequence[float] = TTFT_BUCKETS) -> Histogram:
        metric = self._add(Histogram(name, help_text, buckets))
        assert isinstance(metric, Histogram)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
