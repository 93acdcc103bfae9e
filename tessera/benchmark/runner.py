"""``tessera bench``: systems × rates on one workload, each run on a freshly started cluster.

Every (system, rate) run starts the cluster anew so that no run inherits another's caches;
the first ``warmup_frac`` of the request sequence warms the caches and is excluded from the
numbers. By default the measured requests start only once every warm-up request has
finished (``drain_warmup``): the cold-start backlog (every unit a miss) would otherwise spill
into the measured half and the numbers would describe the transient, not the steady state.
Before the sweep, each system's *unloaded* TTFT is measured with requests sent one at a time
(after the same warm-up). Once a system's mean TTFT passes ``saturation_factor`` × its
unloaded TTFT, its higher rates are skipped: past that point it is saturated, and an
overloaded 300-request run of the baseline costs minutes without telling anything new.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.benchmark.client import BENCH_CLIENT_TIMEOUT_S, BodyOf, Result, run_load
from tessera.benchmark.report import compare, plot, summarize, table
from tessera.benchmark.sglang import BASELINE_SYSTEM, sglang_target
from tessera.benchmark.targets import FreshCluster, Target
from tessera.benchmark.workloads import BenchRequest, Workload
from tessera.config import ClusterConfig, ControlConfig, GenerationNodeConfig
from tessera.engines.base import ENGINES
from tessera.errors import ConfigError

# the paper's §6.4 ablations, plus the exact-prefix baseline (what SGLang/vLLM do today)
SYSTEMS: dict[str, dict[str, Any]] = {
    "prefix": {"mode": "prefix", "admission": "lru", "routing": "load"},
    "C+S": {"mode": "compose", "admission": "lru", "routing": "load"},
    "C+S+R": {"mode": "compose", "admission": "lru", "routing": "cache_aware"},
    "C+S+A": {"mode": "compose", "admission": "demand", "routing": "load"},
    "tessera": {"mode": "compose", "admission": "demand", "routing": "cache_aware"},
}


# ``SYSTEM@ENGINE`` runs a system on another engine than the config's ``model.engine``
ENGINE_SEPARATOR = "@"


def split_system(system: str) -> tuple[str, str | None]:
    """``"tessera@sglang"`` -> ``("tessera", "sglang")``; a plain name has no engine of its own."""
    name, sep, engine = system.partition(ENGINE_SEPARATOR)
    if name not in SYSTEMS or (sep and engine not in ENGINES.names()):
        raise ConfigError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}, each optionally "
                          f"{ENGINE_SEPARATOR}ENGINE with ENGINE one of {', '.join(ENGINES.names())}")
    return name, engine if sep else None


def system_config(base: ClusterConfig, system: str, overload_control: bool = False) -> ClusterConfig:
    """The cluster config of one bench system: its control settings, on its engine.

    On ``@sglang`` the nodes compute in ``[sglang] dtype``, the unmodified baseline's dtype, so
    Tessera on SGLang and SGLang itself are compared at one precision. ``overload_control``
    keeps the config's ``max_queue_wait_s`` (goodput under the shipped defaults: refused
    requests count as failed, the throughput is the accepted ones')."""
    name, engine = split_system(system)
    if engine is not None:
        dtype = base.sglang.dtype if engine == "sglang" else base.model.dtype
        base = dataclasses.replace(base, model=dataclasses.replace(base.model, engine=engine, dtype=dtype))
    if base.model.engine == "sglang":
        base = dataclasses.replace(base, generation=disjoint_cores(base))
    # overload control off: the bench measures how queueing grows with the rate, and a 429
    # would hide exactly that (refused requests have no TTFT); bench/overload.py measures it.
    # For the same reason the first-token deadline is the client's own: past saturation a
    # request queues longer than the default 60 s, and the deadline would end it with a 503
    # (and take its busy but healthy node out of routing) instead of measuring its wait
    control: ControlConfig = dataclasses.replace(
        base.control, **SYSTEMS[name],
        max_queue_wait_s=base.control.max_queue_wait_s if overload_control else 0.0,
        first_token_timeout_s=max(base.control.first_token_timeout_s, BENCH_CLIENT_TIMEOUT_S))
    return dataclasses.replace(base, control=control)


def disjoint_cores(base: ClusterConfig) -> tuple[GenerationNodeConfig, ...]:
    """The generation nodes, each without ``cpus`` given its own ``model.threads`` cores in turn
    (SGLang's kernels bind cores, so nodes sharing a host must be told which)."""
    t = base.model.threads
    return tuple(n if n.cpus else dataclasses.replace(n, cpus=f"{i * t}-{(i + 1) * t - 1}")
                 for i, n in enumerate(base.generation))


def system_description(cfg: ClusterConfig, system: str) -> dict[str, Any]:
    """What a report says a system is: its control settings and the engine its nodes run
    (``cfg``: the system's config, :func:`system_config`)."""
    return {**SYSTEMS[split_system(system)[0]], "engine": cfg.model.engine, "dtype": cfg.model.dtype}


def _fresh(cfg: ClusterConfig, system: str, workload: Workload,
           embeddings: Mapping[str, list[float]] | None) -> FreshCluster:
    return FreshCluster(cfg, workload, system_description(cfg, system), embeddings)


@dataclass
class BenchOptions:
    systems: list[str]
    rates: list[float]
    max_tokens: int = 1
    warmup_frac: float = 0.5
    unloaded_requests: int = 0  # measured one at a time after the warm-up; 0 = skip
    out_dir: Path = Path("results")
    dump_trace: bool = False
    progress: bool = True
    seed: int = 0
    # precompute corpus and query embeddings once in the bench process (the paper excludes
    # query embedding from TTFT); False: the retrieval node embeds everything itself
    precompute_embeddings: bool = True
    # measured requests start after the warm-up requests have all completed
    drain_warmup: bool = True
    # the warm-up share's own Poisson rate (req/s; 0: each run's rate). A long warm-up (enough
    # requests that the measured window's units have been seen) sent at a low run's rate would
    # cost minutes per run; only the cache state it leaves matters, not its latency. Needs the
    # drain, so that the measured share still starts on an idle cluster
    warmup_rate: float = 0.0
    # skip a system's higher rates once its mean TTFT exceeds this × its unloaded TTFT (0: never)
    saturation_factor: float = 10.0
    # per-system rate lists replacing ``rates`` (each system swept where its curve bends)
    system_rates: dict[str, list[float]] = field(default_factory=dict)
    # a trace's recorded arrival times (seconds, already scaled), one per request: one run per
    # system at these times instead of Poisson arrivals at each rate
    arrivals: list[float] | None = None
    max_concurrency: int = 0  # requests in flight at most (0: no bound)
    overload_control: bool = False  # keep the config's max_queue_wait_s (see system_config)
    timeout_s: float = BENCH_CLIENT_TIMEOUT_S  # per request

    def rates_for(self, system: str) -> list[float]:
        if self.arrivals is not None:
            return [recorded_rate(self.arrivals)]
        return self.system_rates.get(system, self.rates)


def recorded_rate(arrivals: list[float]) -> float:
    """The mean rate of recorded arrivals (req/s): what a recorded-time run is labelled with."""
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    return round(len(arrivals) / span, 4) if span > 0 else float(len(arrivals))


def embed_workload(workload: Workload) -> dict[str, list[float]]:
    """MiniLM vectors of every corpus text and retrieval query, computed once per bench."""
    from tessera.retrieval.embedder import Embedder

    texts = list(dict.fromkeys([u.text for u in workload.corpus] +
                               [r.retrieval["query"] for r in workload.requests if r.retrieval is not None]))
    if not texts:
        return {}
    embedder = Embedder(threads=2)
    out: dict[str, list[float]] = {}
    for i in range(0, len(texts), 256):
        chunk = texts[i:i + 256]
        for text, vec in zip(chunk, embedder.embed(chunk), strict=True):
            out[text] = [float(x) for x in vec]
        print(f"\rembedding the workload once: {min(i + 256, len(texts))}/{len(texts)}", end="", file=sys.stderr,
              flush=True)
    print(file=sys.stderr)
    return out


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _write_trace(path: Path, results: list[Result], workload: Workload) -> None:
    with open(path, "w") as fh:
        for r, req in zip(results, workload.requests, strict=False):
            if r.layout is not None:
                rec = dict(r.layout)
                rec["stream"] = req.stream
                fh.write(json.dumps(rec) + "\n")


async def run_phases(url: str, load: list[BenchRequest], rate: float, opts: BenchOptions, *, drain: bool,
                     embeddings: dict[str, list[float]] | None = None, body_of: BodyOf | None = None,
                     headers: dict[str, str] | None = None) -> list[Result]:
    """Send ``load`` open-loop at ``rate`` (or at ``opts.arrivals``); with ``drain``, the measured
    share starts only after every warm-up request has completed (the results keep the
    sequence's order either way; a recorded phase keeps its own spacing, from its first arrival),
    and the warm-up share goes at ``opts.warmup_rate`` where one is set."""
    split = int(len(load) * opts.warmup_frac)
    cuts = [(0, split), (split, len(load))] if drain and 0 < split < len(load) else [(0, len(load))]
    results: list[Result] = []
    for n, (a, b) in enumerate(cuts):
        phase = load[a:b]
        warming = len(cuts) > 1 and n == 0
        phase_rate = opts.warmup_rate if warming and opts.warmup_rate > 0 else rate
        arrivals = None
        if opts.arrivals is not None and phase_rate == rate:
            arrivals = [t - opts.arrivals[a] for t in opts.arrivals[a:b]]
        part = await run_load(url, phase, phase_rate, max_tokens=opts.max_tokens, seed=opts.seed + n,
                              # per-unit receipts: the report's reuse efficiency reads them
                              return_layout=True, progress=opts.progress,
                              desc=f"{phase_rate:g} req/s" + (" warm-up" if warming else ""),
                              embeddings=embeddings, arrivals=arrivals, body_of=body_of,
                              max_concurrency=opts.max_concurrency, timeout_s=opts.timeout_s, headers=headers)
        for r in part:
            r.index += len(results)
        results += part
    return results


async def _run_once(target: Target, opts: BenchOptions, log_dir: Path, *, load: list[BenchRequest], rate: float,
                    serial: list[BenchRequest] | None = None,
                    embeddings: dict[str, list[float]] | None = None) -> tuple[list[Result], list[Result]]:
    """One run on ``target``: send ``load`` open-loop at ``rate``, then ``serial`` one at a time."""
    async with target.open(log_dir, opts.progress) as url:
        results = await run_phases(url, load, rate, opts, drain=opts.drain_warmup and serial is None,
                                   embeddings=embeddings, body_of=target.body_of, headers=target.headers)
        serial_results: list[Result] = []
        if serial:
            serial_results = await run_load(url, serial, 0.0, max_tokens=opts.max_tokens, progress=opts.progress,
                                            desc="unloaded", embeddings=embeddings, body_of=target.body_of,
                                            timeout_s=opts.timeout_s, headers=target.headers)
        return results, serial_results


def _saturated(sysrep: dict[str, Any], summary: dict[str, Any], factor: float) -> bool:
    """Whether ``summary`` is past ``factor`` × the system's unloaded (else its first) mean TTFT."""
    if factor <= 0 or "mean" not in summary:
        return False
    reference = sysrep.get("unloaded") or next((r for r in sysrep["runs"] if "mean" in r), None)
    if reference is None or "mean" not in reference:
        return False
    return bool(summary["mean"] > factor * reference["mean"])


async def run_bench(base: ClusterConfig, workload: Workload, opts: BenchOptions,
                    targets: dict[str, Target] | None = None) -> dict[str, Any]:
    """Sweep ``opts.systems`` on fresh clusters of ``base`` (or the given running ``targets``)."""
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "workload": workload.name,
        "workload_notes": workload.notes,
        "requests": len(workload.requests),
        "warmup_frac": opts.warmup_frac,
        "warmup_rate": opts.warmup_rate or None,
        "max_tokens": opts.max_tokens,
        "overload_control": opts.overload_control,
        "rates": opts.rates,
        "systems": {},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    split = int(len(workload.requests) * opts.warmup_frac)
    embeddings = None
    if targets is None:
        embeddings = await asyncio.to_thread(embed_workload, workload) if opts.precompute_embeddings else None
        targets = {s: sglang_target(base, workload) if s == BASELINE_SYSTEM
                   else _fresh(system_config(base, s, opts.overload_control), s, workload, embeddings)
                   for s in opts.systems}
    for system, target in targets.items():
        rates = opts.rates_for(system)
        sysrep: dict[str, Any] = {"config": target.description, "rates": rates, "runs": []}
        report["systems"][system] = sysrep
        if opts.unloaded_requests:
            # the sweep's warm-up requests (open loop at the warm-up rate, else the middle rate:
            # only the cache state matters, not their latency), then measured requests one at a time
            _say(f"[{system}] unloaded reference: {opts.unloaded_requests} requests one at a time after warm-up")
            _, serial = await _run_once(
                target, opts, opts.out_dir / f"logs-{system}-unloaded",
                load=workload.requests[:split], rate=opts.warmup_rate or rates[len(rates) // 2],
                serial=workload.requests[split:split + opts.unloaded_requests], embeddings=embeddings)
            sysrep["unloaded"] = summarize(serial, 0.0, 0.0)
            _say(f"[{system}] unloaded mean TTFT {sysrep['unloaded'].get('mean', float('nan')):.3f}s")
        saturated_at: float | None = None
        for rate in rates:
            if saturated_at is not None:
                sysrep["runs"].append({"rate": rate, "requests": 0, "ok": 0,
                                       "skipped": f"saturated at {saturated_at:g}"})
                _say(f"[{system}] rate {rate:g}: skipped (saturated at {saturated_at:g} req/s)")
                continue
            _say(f"[{system}] rate {rate:g} req/s: {len(workload.requests)} requests "
                 f"(first {opts.warmup_frac:.0%} warm up"
                 + (f" at {opts.warmup_rate:g} req/s)" if opts.warmup_rate > 0 else ")"))
            results, _ = await _run_once(target, opts, opts.out_dir / f"logs-{system}-{rate:g}",
                                         load=workload.requests, rate=rate, embeddings=embeddings)
            summary = summarize(results, opts.warmup_frac, rate)
            summary["nodes"] = dict(target.counters)
            sysrep["runs"].append(summary)
            _say(f"[{system}] rate {rate:g}: mean TTFT {summary.get('mean', float('nan')):.3f}s "
                 f"p90 {summary.get('p90', float('nan')):.3f}s ok {summary['ok']}/{summary['requests']}")
            if _saturated(sysrep, summary, opts.saturation_factor):
                saturated_at = rate
            if opts.dump_trace:
                _write_trace(opts.out_dir / f"trace-{workload.name}-{system}-{rate:g}.jsonl", results, workload)
    report["comparison"] = compare(report)
    report["plots"] = [str(p) for p in plot(report, opts.out_dir)]
    report["table"] = table(report)
    (opts.out_dir / "bench.json").write_text(json.dumps(report, indent=1))
    return report
