"""``tessera bench`` and ``tessera demo``: the options of a TTFT sweep, checked, run and printed.

The sweep itself (fresh clusters, Poisson load, saturation cut-off) is
:func:`tessera.benchmark.runner.run_bench`; this module turns the command-line options into
its :class:`~tessera.benchmark.runner.BenchOptions` and a workload (or a traffic trace,
``--trace``, replayed at its recorded times or at Poisson rates), picks the targets (fresh
clusters, or running endpoints with ``--url``), and prints the report.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from tessera.benchmark import extras, options
from tessera.benchmark.client import BENCH_CLIENT_TIMEOUT_S
from tessera.benchmark.options import LoadOptions, say
from tessera.benchmark.report import format_demo, format_report
from tessera.benchmark.runner import SYSTEMS, BenchOptions, run_bench, system_config
from tessera.benchmark.sglang import BASELINE_SYSTEM
from tessera.benchmark.targets import Target
from tessera.benchmark.workloads import Workload, synthetic_workload
from tessera.config import ClusterConfig
from tessera.engines.sglang.runner import sglang_missing
from tessera.errors import ConfigError


@dataclass(frozen=True)
class SweepOptions:
    """``tessera bench``'s options as given: the load, and how to measure it (see ``tessera bench --help``)."""

    load: LoadOptions
    out: Path
    dump_trace: bool
    trace_only: bool
    saturation: float
    fidelity: int
    arrivals: str = "auto"  # trace: recorded | poisson | auto (recorded when the trace has times)
    urls: tuple[str, ...] = ()  # [NAME=]URL of running endpoints instead of fresh clusters
    allow_hosts: tuple[str, ...] = ()
    api: str = "auto"
    api_key: str = ""
    max_concurrency: int = 0
    timeout_s: float = BENCH_CLIENT_TIMEOUT_S
    warmup_rate: float = 0.0  # the warm-up share's req/s (0: each run's rate)
    overload_control: bool = False  # keep the config's max_queue_wait_s (429s count as failed)


def _system_rates(specs: tuple[str, ...], systems: list[str]) -> dict[str, list[float]]:
    """``--rates-for SYSTEM=R1,R2,...``: each named system's own rates."""
    out: dict[str, list[float]] = {}
    for spec in specs:
        system, sep, values = spec.partition("=")
        if not sep or system.strip() not in systems:
            raise ConfigError(f"--rates-for {spec!r}: expected SYSTEM=R1,R2,... with SYSTEM one of "
                              f"--systems ({', '.join(systems)})")
        out[system.strip()] = options.floats(values, f"--rates-for {system.strip()}")
    return out


def _trace(config: ClusterConfig, opts: SweepOptions) -> tuple[Workload, list[float] | None]:
    """``--trace``: the trace as a workload, and its recorded arrivals (scaled) unless Poisson is asked."""
    from tessera.benchmark.traffic import UnitTexts, read_traffic, trace_workload
    from tessera.engines.checkpoint import resolve
    from tessera.engines.tokenizer import load_tokenizer

    trace, time_scale = opts.load.trace, opts.load.time_scale
    assert trace is not None
    if not trace.is_file():
        raise ConfigError(f"--trace {trace} does not exist")
    if opts.arrivals not in ("auto", "recorded", "poisson") or time_scale <= 0:
        raise ConfigError("--arrivals takes auto, recorded or poisson; --time-scale must be > 0")
    requests = read_traffic(trace)
    wl = trace_workload(trace.stem, requests, UnitTexts(load_tokenizer(resolve(config.model)).encode_plain))
    recorded = [r.arrival_s for r in requests if r.arrival_s is not None]
    if opts.arrivals == "recorded" and not recorded:
        raise ConfigError(f"--arrivals recorded: {trace} has no arrival_s; use --arrivals poisson --rates ...")
    if opts.arrivals == "poisson" or not recorded:
        return wl, None
    return wl, [(t - recorded[0]) * time_scale for t in recorded]


def _endpoints(opts: SweepOptions, headers: dict[str, str]) -> dict[str, Target]:
    """``--url``: the running endpoints to drive, each asked which API it speaks."""
    from tessera.benchmark.endpoints import detect, parse_endpoint
    from tessera.benchmark.targets import RunningEndpoint

    given = [parse_endpoint(u, opts.allow_hosts, opts.api) for u in opts.urls]
    if len({e.name for e in given}) < len(given):
        raise ConfigError("two --url endpoints have the same name; name them: --url NAME=URL")
    found = [asyncio.run(detect(e, headers)) for e in given]
    for e in found:
        say(f"[{e.name}] {e.url}: {e.api} API, model {e.model}", err=True)
    return {e.name: RunningEndpoint(e, headers) for e in found}


def run_sweep(config: ClusterConfig, opts: SweepOptions) -> None:
    """Check the options, render traces (``trace_only``) or sweep systems × rates; print the report."""
    names = options.names(opts.load.systems)
    if not names:
        raise ConfigError(f"--systems names no system; known: {', '.join([*SYSTEMS, BASELINE_SYSTEM])}")
    # system_config raises for an unknown name, naming what is known
    on_sglang = [n for n in names if n == BASELINE_SYSTEM or system_config(config, n).model.engine == "sglang"]
    if on_sglang and not opts.urls and (why := sglang_missing()) is not None:
        raise ConfigError(why)  # before minutes of load on the other systems, not after
    if not 0 <= opts.load.warmup < 1 or opts.load.requests < 2 or opts.saturation < 0:
        raise ConfigError("--warmup must be in [0, 1), --requests >= 2 and --saturation >= 0")
    if opts.warmup_rate < 0 or (opts.warmup_rate > 0 and not opts.load.drain_warmup):
        raise ConfigError("--warmup-rate must be >= 0 (0: each run's rate) and needs --drain-warmup")
    if opts.max_concurrency < 0 or opts.timeout_s <= 0:
        raise ConfigError("--max-concurrency must be >= 0 (0: no bound) and --timeout > 0")
    arrivals = None
    if opts.load.trace is not None:
        wl, arrivals = _trace(config, opts)
    else:
        wl = opts.load.select_workload()
    if opts.trace_only:
        from tessera.benchmark.render import write_traces

        path = opts.out / f"trace-{wl.name}.jsonl"
        n = write_traces(config, wl, path)
        say(f"wrote {n} rendered prompts to {path}; classify them with: tessera analyze {path}")
        return
    extras.require("tessera bench")  # before minutes of load, not after
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    targets = _endpoints(opts, headers) if opts.urls else None
    load = opts.load
    system_rates = _system_rates(load.rates_for, list(targets or names))
    bench = BenchOptions(systems=list(targets or names), rates=options.floats(load.rates, "--rates"),
                         max_tokens=load.max_tokens, warmup_frac=load.warmup, unloaded_requests=load.unloaded,
                         out_dir=opts.out, dump_trace=opts.dump_trace, seed=load.seed, drain_warmup=load.drain_warmup,
                         saturation_factor=opts.saturation, system_rates=system_rates, arrivals=arrivals,
                         max_concurrency=opts.max_concurrency, timeout_s=opts.timeout_s,
                         warmup_rate=opts.warmup_rate, overload_control=opts.overload_control)
    report = asyncio.run(run_bench(config, wl, bench, targets))
    for line in format_report(report):
        say(line)
    if opts.fidelity > 0:
        from tessera.benchmark.verify import format_fidelity, measured_fidelity

        report["fidelity"] = measured_fidelity(config, wl, opts.fidelity, opts.load.warmup, seed=opts.load.seed)
        (opts.out / "bench.json").write_text(json.dumps(report, indent=1))
        say(format_fidelity(report["fidelity"]))


def run_demo(config: ClusterConfig, out: Path, requests: int, rates: str) -> None:
    """The demo sweep: agent-memory style requests (4 of 60 Zipf-popular records), prefix vs tessera."""
    extras.require("tessera demo")
    wl = synthetic_workload(requests, n_units=60, unit_words=120, units_per_request=4, zipf_s=1.0, seed=0)
    bench = BenchOptions(systems=["prefix", "tessera"], rates=options.floats(rates, "--rates"), max_tokens=1,
                         warmup_frac=0.5, unloaded_requests=0, out_dir=out, seed=0)
    say(f"tessera demo: {requests} requests per run at {rates} req/s, systems prefix and tessera; "
        f"each run starts a fresh cluster from the embedded config", err=True)
    report = asyncio.run(run_bench(config, wl, bench))
    for line in format_demo(report):
        say(line)
