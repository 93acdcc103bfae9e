"""``tessera simulate``'s sweep: systems × rates, each run on a fresh simulated cluster.

It mirrors ``tessera bench`` (:func:`tessera.benchmark.runner.run_bench`) step for step, so a
simulated table reads like a measured one: the same systems (:data:`SYSTEMS`, the same config
overrides), the same request sequence and Poisson send times (same seeds), the warm-up share
drained before the measured share starts, the serial reference after a warm-up at the middle
rate, and the report's summaries, comparison, table and plots from
:mod:`tessera.benchmark.report`. It adds what only a simulation can show cheaply: load
imbalance across the nodes, each node's engine utilisation, and the control plane's own CPU
time per request.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tessera.benchmark.client import Result
from tessera.benchmark.report import compare, plot, summarize, table
from tessera.benchmark.runner import SYSTEMS, recorded_rate, system_config
from tessera.benchmark.traffic_render import TraceRenderer
from tessera.benchmark.workloads import Workload
from tessera.config import ClusterConfig
from tessera_lab.simulate.cluster import Outcome, SimCluster
from tessera_lab.simulate.costs import CostModel
from tessera_lab.simulate.workload import SimRequest, poisson_arrivals, render, unit_texts


@dataclass
class SimOptions:
    systems: list[str]
    rates: list[float]
    max_tokens: int = 1
    warmup_frac: float = 0.5
    unloaded_requests: int = 0
    seed: int = 0
    drain_warmup: bool = True
    system_rates: dict[str, list[float]] = field(default_factory=dict)
    arrivals: list[float] | None = None  # a trace's recorded send times instead of Poisson
    out_dir: Path | None = None  # bench.json-like simulate.json and the plots; None: nothing written

    def rates_for(self, system: str) -> list[float]:
        return self.system_rates.get(system, self.rates)


@dataclass
class RunStats:
    """One simulated run's results plus what the cluster saw."""

    results: list[Result]
    cluster: SimCluster
    plane_path_s: list[float] = field(default_factory=list)  # each request's own plane CPU, in order


def _result(i: int, out: Outcome, t0: float) -> Result:
    usage: dict[str, Any] = {}
    if out.stats is not None:
        s = out.stats
        usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                 "tessera": {"prefix_cached_tokens": s.prefix_cached_tokens, "local_tokens": s.local_tokens,
                             "remote_tokens": s.remote_tokens, "computed_unit_tokens": s.computed_unit_tokens,
                             "coalesced_unit_tokens": s.coalesced_unit_tokens, "coalesced_units": s.coalesced_units,
                             "recomputed_tokens": s.recomputed_tokens}}
    return Result(i, out.sent_at - t0, out.ttft, out.latency, status=200 if out.ttft is not None else 0, usage=usage)


def simulate_run(config: ClusterConfig, costs: CostModel, requests: Sequence[SimRequest], rate: float,
                 opts: SimOptions, serial: Sequence[SimRequest] = ()) -> RunStats:
    """One run: ``requests`` open loop at ``rate`` in phases (warm-up drained), then ``serial`` one at a time."""
    cluster = SimCluster(config, costs)
    loop = cluster.loop
    outcomes: list[Outcome | None] = [None] * len(requests)
    serial_out: list[Outcome] = []
    finished = [0]  # requests done (a counter: the loop asks after every event)
    split = int(len(requests) * opts.warmup_frac)
    drain = opts.drain_warmup and not serial
    cuts = [(0, split), (split, len(requests))] if drain and 0 < split < len(requests) else [(0, len(requests))]

    def phase(n: int) -> None:
        if n == len(cuts):
            send_serial(0)
            return
        a, b = cuts[n]
        if opts.arrivals is not None:
            times = [t - opts.arrivals[a] for t in opts.arrivals[a:b]]
        else:
            times = poisson_arrivals(b - a, rate, opts.seed + n)
        left = [b - a]
        start = loop.now

        def done(i: int, out: Outcome) -> None:
            outcomes[i] = out
            finished[0] += 1
            left[0] -= 1
            if left[0] == 0:
                phase(n + 1)

        for i, t in zip(range(a, b), times, strict=True):
            loop.at(start + t, partial(cluster.send, requests[i], opts.max_tokens, partial(done, i)))

    def send_serial(i: int) -> None:
        if i < len(serial):
            cluster.send(serial[i], opts.max_tokens, partial(serial_done, i))

    def serial_done(i: int, out: Outcome) -> None:
        serial_out.append(out)
        finished[0] += 1
        send_serial(i + 1)

    t0 = loop.now
    loop.at(t0, lambda: phase(0))
    total = len(requests) + len(serial)
    loop.run(until=lambda: finished[0] == total)
    done = serial_out if serial else [o for o in outcomes if o is not None]
    return RunStats([_result(i, o, cluster.started_at) for i, o in enumerate(done)], cluster,
                    [o.plane_s for o in done])


def cluster_figures(run: RunStats, measured_from: float) -> dict[str, Any]:
    """Load imbalance, engine utilisation and the plane's CPU time of one run."""
    c = run.cluster
    served = [n.served for n in c.nodes.values()]
    busy = [n.engine.busy_s for n in c.nodes.values()]
    span = max(c.loop.now - c.started_at, 1e-9)  # busy time counts the warm-up too
    mean_served = sum(served) / len(served)
    mean_busy = sum(busy) / len(busy)
    t = c.timed.time
    n_req = max(len(run.results), 1)
    path = np.array(run.plane_path_s or [0.0])
    return {
        "nodes": len(served),
        "imbalance_requests": max(served) / mean_served if mean_served else 0.0,  # max / mean
        "imbalance_busy": max(busy) / mean_busy if mean_busy else 0.0,
        "mean_utilisation": mean_busy / span,
        # cores the other roles' CPU work took on average, per host (0 without a measured cpu_per_request_s)
        "role_cpu_cores": {h: host.cpu_s / span for h, host in sorted(c.hosts.items())},
        # the engines' CPU (steps and their stretch) per request served, the warm-up's included
        "engine_cpu_per_request_s": sum(h.engine_cpu_s for h in c.hosts.values()) / max(sum(served), 1),
        "plane_cpu_per_request_us": 1e6 * t.total_s / n_req,
        # the request's own path (route, finalize, started, complete): median and p99 of requests
        "plane_cpu_path_p50_us": 1e6 * float(np.percentile(path, 50)),
        "plane_cpu_path_p99_us": 1e6 * float(np.percentile(path, 99)),
        "plane_cpu_by_verb_s": {k: round(v, 6) for k, v in sorted(t.by_verb.items())},
        "plane_calls": dict(sorted(t.calls.items())),
        "plane_stats": c.plane.stats.snapshot(),
        "shared_evictions": c.plane.shared.evictions,
        "publishes_rejected": c.timed.rejected,
        "simulated_s": c.loop.now - c.started_at,
        "events": c.loop.events,
    }


def by_stream(results: Sequence[Result], requests: Sequence[SimRequest]) -> dict[str, float]:
    """Mean TTFT of the measured requests of each stream (a LoCoMo conversation, the paper's Fig. 14)."""
    ttfts: dict[str, list[float]] = {}
    for r, req in zip(results, requests, strict=True):
        if r.ttft is not None:
            ttfts.setdefault(req.stream, []).append(r.ttft)
    return {s: float(np.mean(v)) for s, v in sorted(ttfts.items())}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_simulation(base: ClusterConfig, workload: Workload, costs: CostModel, opts: SimOptions,
                   progress: bool = True) -> dict[str, Any]:
    """The whole sweep; returns the report (``tessera bench``'s shape plus ``cluster`` per run)."""
    report: dict[str, Any] = {
        "workload": workload.name, "workload_notes": workload.notes, "requests": len(workload.requests),
        "warmup_frac": opts.warmup_frac, "max_tokens": opts.max_tokens, "rates": opts.rates,
        "cost_model": costs.name, "nodes": len(base.generation), "systems": {},
    }
    texts = unit_texts(base, workload)
    split = int(len(workload.requests) * opts.warmup_frac)
    for system in opts.systems:
        config = system_config(base, system)
        requests = render(config, workload, texts, TraceRenderer(config))
        # a trace's recorded times: one run, labelled with their mean rate (as tessera bench labels it)
        rates = opts.rates_for(system) if opts.arrivals is None else [recorded_rate(opts.arrivals)]
        sysrep: dict[str, Any] = {"config": SYSTEMS[system], "rates": rates, "runs": []}
        report["systems"][system] = sysrep
        if opts.unloaded_requests:
            run = simulate_run(config, costs, requests[:split], rates[len(rates) // 2], opts,
                               serial=requests[split:split + opts.unloaded_requests])
            sysrep["unloaded"] = summarize(run.results, 0.0, 0.0)
        for rate in rates:
            run = simulate_run(config, costs, requests, rate, opts)
            summary = summarize(run.results, opts.warmup_frac, rate)
            measured = run.results[split:]
            summary["cluster"] = cluster_figures(run, min((r.sent_at for r in measured), default=0.0))
            summary["by_stream"] = by_stream(run.results[split:], requests[split:])
            sysrep["runs"].append(summary)
            if progress:
                _say(f"[{system}] rate {rate:g}: simulated mean TTFT {summary.get('mean', float('nan')):.3f}s "
                     f"p90 {summary.get('p90', float('nan')):.3f}s, plane "
                     f"{summary['cluster']['plane_cpu_per_request_us']:.0f} us CPU/request")
    report["comparison"] = compare(report)
    report["table"] = table(report)
    report["cluster_table"] = cluster_table(report)
    if opts.out_dir is not None:
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        report["plots"] = [str(p) for p in plot(report, opts.out_dir)]
        (opts.out_dir / "simulate.json").write_text(json.dumps(report, indent=1))
    return report


def cluster_table(report: dict[str, Any]) -> str:
    rows = ["| system | rate (req/s) | nodes | prefix-cached share of prompt | load imbalance (max/mean requests) "
            "| engine busy max/mean | mean utilisation | plane CPU per request, all calls (us) "
            "| its own path p50 / p99 (us) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, sysrep in report["systems"].items():
        for r in sysrep["runs"]:
            c = r.get("cluster")
            if c is None:
                continue
            rows.append(f"| {name} | {r['rate']:g} | {c['nodes']} | {r['hit_rate']['prefix']:.0%} | "
                        f"{c['imbalance_requests']:.2f} | {c['imbalance_busy']:.2f} | {c['mean_utilisation']:.0%} | "
                        f"{c['plane_cpu_per_request_us']:.0f} | {c['plane_cpu_path_p50_us']:.0f} / "
                        f"{c['plane_cpu_path_p99_us']:.0f} |")
    return "\n".join(rows)
