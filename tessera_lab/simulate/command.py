"""``tessera simulate``: options as typed on the command line, the fleet's shape, the printout.

:func:`fleet` scales the configured cluster to N generation nodes and M memory nodes (copies
of the first of each, renamed; capacities overridable) so the real plane sees the fleet it
would run. :func:`run_command` builds the workload exactly as ``tessera bench`` does, loads
or fits the cost model and prints the bench's table, then the cluster table. Knows nothing
of typer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tessera.benchmark import options
from tessera.benchmark.options import LoadOptions, say
from tessera.benchmark.report import format_report
from tessera.benchmark.runner import SYSTEMS
from tessera.benchmark.workloads import Workload
from tessera.config import ClusterConfig
from tessera.errors import ConfigError
from tessera_lab.simulate.costs import load_cost_model
from tessera_lab.simulate.run import SimOptions, run_simulation

DEFAULT_COST_MODEL = Path("results/cost-model.json")  # where --calibrate writes unless told


@dataclass(frozen=True)
class SimulateOptions:
    """``tessera simulate``'s options as given: the load, the fleet and the cost model."""

    load: LoadOptions
    out: Path | None
    cost_model: str
    calibrate: bool
    nodes: int
    memory_nodes: int
    local_blocks: int
    shared_blocks: int
    max_batch_tokens: int
    prefix_cache_tokens: int = 0
    compare: Path | None = None  # a tessera bench report (bench.json) to compare the simulation with
    calibrate_cpu: bool = False  # measure the roles' CPU per request on a real cluster into the cost model


def fleet(config: ClusterConfig, nodes: int = 0, memory_nodes: int = 0, local_blocks: int = 0,
          shared_blocks: int = 0, max_batch_tokens: int = 0, prefix_cache_tokens: int = 0) -> ClusterConfig:
    """``config`` with N generation nodes and M memory nodes (0: as configured); ``shared_blocks``
    is the whole shared tier's capacity, split evenly over the memory nodes."""
    if min(nodes, memory_nodes, local_blocks, shared_blocks, max_batch_tokens, prefix_cache_tokens) < 0:
        raise ConfigError("--nodes, --memory-nodes, --local-blocks, --shared-blocks, --max-batch-tokens and "
                          "--prefix-cache-tokens must be >= 0 (0: as configured)")
    if not config.generation or not config.kvpools:
        raise ConfigError("tessera simulate needs a config with at least one [[generation]] and one [[kvpools]] node")
    gen, pool = config.generation[0], config.kvpools[0]
    if local_blocks:
        gen = dataclasses.replace(gen, local_capacity_blocks=local_blocks)
    if max_batch_tokens:
        gen = dataclasses.replace(gen, max_batch_tokens=max_batch_tokens)
    if prefix_cache_tokens:
        gen = dataclasses.replace(gen, prefix_cache_tokens=prefix_cache_tokens)
    # a fleet's ports are never listened on; they only have to be distinct (kvpools below 20000)
    generation = (tuple(dataclasses.replace(gen, name=f"gen{i}", port=20000 + i) for i in range(nodes))
                  if nodes else tuple(dataclasses.replace(g, local_capacity_blocks=gen.local_capacity_blocks,
                                                          max_batch_tokens=gen.max_batch_tokens,
                                                          prefix_cache_tokens=gen.prefix_cache_tokens)
                                      for g in config.generation))
    m = memory_nodes or len(config.kvpools)
    total = shared_blocks or sum(k.capacity_blocks for k in config.kvpools[:m]) or pool.capacity_blocks * m
    kvpools = tuple(dataclasses.replace(pool, name=f"kv{i}", port=10000 + 2 * i, data_port=10001 + 2 * i,
                                        capacity_blocks=total // m + (1 if i < total % m else 0)) for i in range(m))
    return dataclasses.replace(config, generation=generation, kvpools=kvpools)


def trace_workload_of(config: ClusterConfig, trace: Path, time_scale: float) -> tuple[Workload, list[float] | None]:
    """A traffic trace as a workload, with its recorded send times (scaled) if it has them."""
    from tessera.benchmark.traffic import UnitTexts, read_traffic, trace_workload
    from tessera.engines.checkpoint import resolve
    from tessera.engines.tokenizer import load_tokenizer

    if not trace.is_file():
        raise ConfigError(f"--trace {trace} does not exist")
    requests = read_traffic(trace)
    wl = trace_workload(trace.stem, requests, UnitTexts(load_tokenizer(resolve(config.model)).encode_plain))
    recorded = [r.arrival_s for r in requests if r.arrival_s is not None]
    if len(recorded) != len(requests):
        return wl, None
    return wl, [(t - recorded[0]) * time_scale for t in recorded]


def _system_rates(specs: tuple[str, ...]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for spec in specs:
        name, sep, rates = spec.partition("=")
        if not sep or name.strip() not in SYSTEMS:
            raise options.OptionError(f"--rates-for takes SYSTEM=R1,R2 with SYSTEM one of {', '.join(SYSTEMS)}; "
                                      f"got {spec!r}")
        out[name.strip()] = options.floats(rates, "--rates-for")
    return out


def calibrate_cpu(config: ClusterConfig, opts: SimulateOptions) -> None:
    """Measure each role's CPU per request on the config's real cluster (one run per ``--rates`` rate)
    and write it, with this machine's cores, into the cost model file (which ``--calibrate`` wrote)."""
    import os

    from tessera.benchmark.runner import system_config
    from tessera_lab.simulate.hostcpu import fit_role_cpu, measure_roles
    from tessera_lab.simulate.incluster import fit_host_slowdown
    from tessera_lab.simulate.workload import render, unit_texts

    path = Path(opts.cost_model) if opts.cost_model else DEFAULT_COST_MODEL
    if not path.is_file():
        raise ConfigError(f"--calibrate-cpu adds to a cost model file: {path} does not exist; write it first with "
                          f"tessera simulate --calibrate --cost-model {path}")
    model = load_cost_model(str(path))
    wl = opts.load.select_workload()
    runs = []
    for rate in options.floats(opts.load.rates, "--rates"):
        run = measure_roles(config, wl, rate, opts.load.warmup, seed=opts.load.seed)
        runs.append(run)
        roles = ", ".join(f"{role} {v['other_s'] * 1e3:.1f} / {v['engine_s'] * 1e3:.1f} ms"
                          for role, v in run["by_role"].items())
        say(f"[{rate:g} req/s] {run['ok']}/{run['requests']} measured requests in {run['wall_s']:.1f}s; CPU per "
            f"request outside / in the engine threads: {roles}")
    per_request, background = fit_role_cpu(runs)
    cores = len(os.sched_getaffinity(0))
    model = dataclasses.replace(model, cpu_per_request_s={r: round(v, 6) for r, v in per_request.items()},
                                host_cores=cores, host_background_cores=round(background, 4))
    # the engine threads' measured CPU per request fixes the steps' in-cluster stretch
    tessera = system_config(config, "tessera")
    requests = render(tessera, wl, unit_texts(tessera, wl))
    slowdown = fit_host_slowdown(tessera, model, requests, runs, opts.load.warmup, opts.load.seed)
    step_source = model.source.split("; in-cluster")[0]  # a second --calibrate-cpu replaces the first's note
    model = dataclasses.replace(model, host_slowdown=slowdown,
                                source=f"{step_source}; in-cluster step stretch with 1..k engines busy "
                                       f"{', '.join(f'{x:.2f}' for x in slowdown)} and the roles' CPU per request "
                                       f"from tessera simulate --calibrate-cpu at {opts.load.rates} req/s")
    model.save(path)
    say(f"wrote {path}: {cores} cores, background {model.host_background_cores:.3f} cores, CPU per request "
        + ", ".join(f"{r} {v * 1e3:.1f} ms" for r, v in model.cpu_per_request_s.items())
        + f"; in-cluster step stretch with 1..k engines busy {', '.join(f'{x:.2f}' for x in slowdown)}")
    (path.parent / f"{path.stem}-cpu-runs.json").write_text(json.dumps(runs, indent=1))


def run_command(config: ClusterConfig, opts: SimulateOptions) -> None:
    if opts.calibrate:
        from tessera_lab.simulate.calibrate import calibrate

        path = Path(opts.cost_model) if opts.cost_model else DEFAULT_COST_MODEL
        model = calibrate(config, name=path.stem)
        model.save(path)
        say(f"wrote cost model {path}: {model.source}")
        say(json.dumps(dataclasses.asdict(model)))
        return
    if opts.calibrate_cpu:
        calibrate_cpu(config, opts)
        return
    costs = load_cost_model(opts.cost_model or str(DEFAULT_COST_MODEL))
    systems = options.names(opts.load.systems)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ConfigError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    if not 0 <= opts.load.warmup < 1 or opts.load.requests < 2 or opts.load.time_scale <= 0:
        raise ConfigError("--warmup must be in [0, 1), --requests >= 2 and --time-scale > 0")
    cfg = fleet(config, opts.nodes, opts.memory_nodes, opts.local_blocks, opts.shared_blocks, opts.max_batch_tokens,
                opts.prefix_cache_tokens)
    arrivals = None
    if opts.load.trace is not None:
        wl, arrivals = trace_workload_of(cfg, opts.load.trace, opts.load.time_scale)
    else:
        wl = opts.load.select_workload()
    load = opts.load
    sim = SimOptions(systems=systems, rates=options.floats(load.rates, "--rates"), max_tokens=load.max_tokens,
                     warmup_frac=load.warmup, unloaded_requests=load.unloaded, seed=load.seed,
                     drain_warmup=load.drain_warmup, system_rates=_system_rates(load.rates_for), arrivals=arrivals,
                     out_dir=opts.out)
    say(f"tessera simulate: {wl.name}, {len(cfg.generation)} generation node(s), {len(cfg.kvpools)} memory node(s) "
        f"({sum(k.capacity_blocks for k in cfg.kvpools)} shared blocks), cost model {costs.name}", err=True)
    report = run_simulation(cfg, wl, costs, sim)
    for line in format_report(report):
        say(line)
    say("")
    say(report["cluster_table"])
    if opts.compare is not None:
        from tessera_lab.simulate.validate import compare_runs, comparison_table, plot_comparison

        if not opts.compare.is_file():
            raise ConfigError(f"--compare {opts.compare} does not exist; pass the bench.json tessera bench wrote")
        rows = compare_runs(report, json.loads(opts.compare.read_text()))
        say(f"\nsimulated vs measured ({opts.compare}):")
        say(comparison_table(rows))
        if opts.out is not None:
            (opts.out / "validation.json").write_text(json.dumps(rows, indent=1))
            say(f"plot: {plot_comparison(rows, opts.out / 'validation.png')}")
    for name, sysrep in report["systems"].items():
        for r in sysrep["runs"]:
            if len(r.get("by_stream", {})) > 1:
                say(f"[{name}] {r['rate']:g} req/s mean TTFT by stream: "
                    + ", ".join(f"{s} {t:.3f}s" for s, t in r["by_stream"].items()))
