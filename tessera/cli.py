"""Command line: ``tessera run | up | bench | analyze | eval | verify``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tessera.benchmark.report import format_demo, format_report
from tessera.benchmark.workloads import WorkloadName, select_workload
from tessera.config import ClusterConfig, Role
from tessera.config_file import load_config
from tessera.errors import ConfigError

app = typer.Typer(
    name="tessera",
    help="Tessera: retrieval as the control plane for KV-cache reuse in RAG and agent-memory serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root() -> None:
    """Tessera: retrieval as the control plane for KV-cache reuse."""


ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="Cluster config (TOML). Default: the embedded single-machine cluster."),
]


def _load(config: Path | None) -> ClusterConfig:
    from tessera.roles import check_registered

    try:
        cfg = load_config(config)
        check_registered(cfg)
        return cfg
    except ConfigError as exc:
        typer.echo(f"tessera: config error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command()
def run(
    role: Annotated[Role, typer.Option("--role", "-r", help="Which role this process plays.")],
    config: ConfigOpt = None,
    node: Annotated[
        str | None,
        typer.Option("--node", "-n", help="Node name from the config ([[kvpools]] or [[generation]] name). "
                     "Required for kvpool and generation roles when the config has several."),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Run one role (retrieval, kvpool or generation) as a single asyncio process."""
    from tessera.roles import main_for
    from tessera.runtime import configure_logging

    cfg = _load(config)
    configure_logging(log_level)
    raise typer.Exit(main_for(role.value, cfg, node))


@app.command()
def up(
    config: ConfigOpt = None,
    log_dir: Annotated[Path | None,
                       typer.Option("--log-dir", help="Where each role's log goes (default: a temp dir).")] = None,
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", help="Where units and indexes persist (default: retrieval.data_dir, else "
        "$XDG_DATA_HOME/tessera/default or ~/.local/share/tessera/default).")] = None,
) -> None:
    """Start every role of the config on this machine (retrieval, kvpool, generation) and wait for Ctrl-C."""
    import dataclasses
    import os
    import signal

    from tessera.launcher import ClusterError, LocalCluster

    cfg = _load(config)
    if data_dir is not None or not cfg.retrieval.data_dir:
        # a store you ingest into survives `tessera up` twice in a row
        home = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
        chosen = data_dir or home / "tessera" / "default"
        cfg = dataclasses.replace(cfg, retrieval=dataclasses.replace(cfg.retrieval, data_dir=str(chosen)))
    typer.echo(f"tessera up: units persist in {cfg.retrieval.data_dir}")
    cluster = LocalCluster(cfg, log_dir=log_dir)
    try:
        cluster.start()
    except ClusterError as exc:
        typer.echo(f"tessera up: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"tessera is up: OpenAI-compatible API at {cfg.retrieval_url}/v1/chat/completions "
               f"(metrics at {cfg.retrieval_url}/metrics). Ctrl-C stops every role.")
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        # a role that exits is started again (with backoff); only Ctrl-C/SIGTERM stops the cluster
        cluster.supervise(lambda: stop)
    finally:
        typer.echo("stopping tessera (draining in-flight requests)...", err=True)
        cluster.stop()


@app.command()
def analyze(
    trace: Annotated[Path, typer.Argument(help="JSONL trace: {stream, tokens, units} per request.")],
    per_stream: Annotated[bool, typer.Option("--per-stream", help="Also print each stream's numbers.")] = False,
) -> None:
    """Classify unit tokens of a trace as prefix-covered, non-prefix repeats or new (paper §3.1)."""
    from tessera.benchmark.trace import analyze as run_analysis
    from tessera.benchmark.trace import read_trace
    from tessera.errors import BadRequest

    if not trace.is_file():
        typer.echo(f"tessera analyze: {trace} does not exist", err=True)
        raise typer.Exit(2)
    try:
        result = run_analysis(read_trace(trace))
    except BadRequest as exc:
        typer.echo(f"tessera analyze: {exc}", err=True)
        raise typer.Exit(2) from None
    t = result["total"]
    typer.echo(f"requests: {t['requests']}, injected unit tokens: {t['unit_tokens']}")
    typer.echo(f"  non-prefix repeat: {t['non_prefix_repeat']:.1%}   prefix-covered: {t['prefix_covered']:.1%}   "
               f"new: {t['new']:.1%}")
    typer.echo(f"  requests with >= half their unit tokens non-prefix repeats: {t['requests_mostly_repeat']:.1%}")
    typer.echo(f"  non-prefix repeats as a share of all prompt tokens: {t['repeat_share_of_prompt_tokens']:.1%}")
    if per_stream:
        for name, s in result["streams"].items():
            typer.echo(f"  {name}: repeat {s['non_prefix_repeat']:.1%} prefix {s['prefix_covered']:.1%} "
                       f"new {s['new']:.1%} of prompt {s['repeat_share_of_prompt_tokens']:.1%} ({s['requests']} req)")


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        typer.echo(f"tessera: {what} must be comma-separated numbers, got {text!r}", err=True)
        raise typer.Exit(2) from None
    if not values or any(v <= 0 for v in values):
        typer.echo(f"tessera: {what} must be positive numbers, got {text!r}", err=True)
        raise typer.Exit(2)
    return sorted(values)


@app.command()
def bench(
    workload: Annotated[WorkloadName,
                        typer.Option(help="rag (MuSiQue), locomo (agent memory) or synthetic.")] = WorkloadName.rag,
    systems: Annotated[str,
                       typer.Option(help="Comma-separated: prefix, C+S, C+S+R, C+S+A, tessera.")] = "prefix,tessera",
    rates: Annotated[str, typer.Option(help="Comma-separated aggregate request rates (req/s).")] = "0.1,0.2,0.4",
    rates_for: Annotated[list[str] | None, typer.Option(
        help="SYSTEM=R1,R2,...: this system's own rates instead of --rates (repeatable), e.g. "
             "tessera=1.5,2,2.5,3 to sweep each system where its curve bends.")] = None,
    requests: Annotated[int, typer.Option(help="Requests per run (the first --warmup share warms up).")] = 60,
    warmup: Annotated[float, typer.Option(help="Share of each run's requests excluded as warm-up.")] = 0.5,
    unloaded: Annotated[int, typer.Option(help="Requests measured one at a time for the unloaded TTFT (0: skip).")] = 5,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 1,
    zipf: Annotated[float, typer.Option(help="Zipf exponent of query/unit popularity.")] = 1.0,
    top_k: Annotated[int | None,
                     typer.Option(help="Units per request (default: rag 5, locomo 6, synthetic 5).")] = None,
    unit_words: Annotated[int,
                          typer.Option(help="Truncate units to this many words (0: keep; synthetic: length).")] = 0,
    placement: Annotated[str, typer.Option(help="locomo: user (OpenViking style) or system (Mem0 style).")] = "user",
    conversations: Annotated[int, typer.Option(help="locomo: use the first N conversations (0: all 10).")] = 0,
    data_dir: Annotated[Path | None,
                        typer.Option(help="Folder with musique/ and locomo/ (default ../shared/data).")] = None,
    out: Annotated[Path, typer.Option(help="Output folder for bench.json and the plots.")] = Path("results/bench"),
    dump_trace: Annotated[bool, typer.Option("--dump-trace",
                                             help="Write each run's rendered prompts as JSONL traces.")] = False,
    trace_only: Annotated[bool, typer.Option(
        "--trace-only", help="Only render the workload's prompts (retrieval included, no serving) into "
                             "OUT/trace-WORKLOAD.jsonl for tessera analyze.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the workload and the arrivals.")] = 0,
    drain_warmup: Annotated[bool, typer.Option(help="Start the measured requests once the warm-up requests have "
                                               "finished (steady state, no cold-start backlog).")] = True,
    saturation: Annotated[float, typer.Option(help="Skip a system's higher rates once its mean TTFT exceeds this × "
                                              "its unloaded TTFT (0: run every rate).")] = 10.0,
    fidelity: Annotated[int, typer.Option(help="Score N of the measured requests offline against full prefill "
                                          "(tessera verify's metrics) and report them next to TTFT (0: skip).")] = 0,
    config: ConfigOpt = None,
) -> None:
    """Open-loop Poisson load against fresh local clusters; prints and plots TTFT per system and rate."""
    import asyncio

    from tessera.benchmark.runner import SYSTEMS, BenchOptions, run_bench

    cfg = _load(config)
    names = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        typer.echo(f"tessera bench: unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}", err=True)
        raise typer.Exit(2)
    if not 0 <= warmup < 1 or requests < 2 or saturation < 0:
        typer.echo("tessera bench: --warmup must be in [0, 1), --requests >= 2 and --saturation >= 0", err=True)
        raise typer.Exit(2)
    try:
        wl = select_workload(workload, requests, data_dir, zipf, top_k, unit_words, placement, seed, conversations)
    except ConfigError as exc:
        typer.echo(f"tessera bench: {exc}", err=True)
        raise typer.Exit(2) from None
    if trace_only:
        from tessera.benchmark.render import write_traces

        path = out / f"trace-{wl.name}.jsonl"
        n = write_traces(cfg, wl, path)
        typer.echo(f"wrote {n} rendered prompts to {path}; classify them with: tessera analyze {path}")
        return
    system_rates: dict[str, list[float]] = {}
    for spec in rates_for or []:
        system, sep, values = spec.partition("=")
        if not sep or system.strip() not in names:
            typer.echo(f"tessera bench: --rates-for {spec!r}: expected SYSTEM=R1,R2,... with SYSTEM one of "
                       f"--systems ({', '.join(names)})", err=True)
            raise typer.Exit(2)
        system_rates[system.strip()] = _floats(values, f"--rates-for {system.strip()}")
    opts = BenchOptions(systems=names, rates=_floats(rates, "--rates"), max_tokens=max_tokens, warmup_frac=warmup,
                        unloaded_requests=unloaded, out_dir=out, dump_trace=dump_trace, seed=seed,
                        drain_warmup=drain_warmup, saturation_factor=saturation, system_rates=system_rates)
    report = asyncio.run(run_bench(cfg, wl, opts))
    for line in format_report(report):
        typer.echo(line)
    if fidelity > 0:
        import json

        from tessera.benchmark.verify import format_fidelity, measured_fidelity

        report["fidelity"] = measured_fidelity(cfg, wl, fidelity, warmup, seed=seed)
        (out / "bench.json").write_text(json.dumps(report, indent=1))
        typer.echo(format_fidelity(report["fidelity"]))


@app.command(name="eval")
def evaluate_cmd(
    workload: Annotated[WorkloadName, typer.Option(help="rag (MuSiQue) or locomo.")] = WorkloadName.rag,
    questions: Annotated[int, typer.Option(help="Distinct questions to answer.")] = 50,
    policies: Annotated[str, typer.Option(help="Comma-separated composition policies.")] = "full,naive,epic",
    max_new_tokens: Annotated[int, typer.Option(help="Greedy answer length cap.")] = 24,
    top_k: Annotated[int | None, typer.Option(help="Units per question (default: rag 5, locomo 6).")] = None,
    unit_words: Annotated[int, typer.Option(help="Truncate units to this many words (0: keep).")] = 0,
    placement: Annotated[str, typer.Option(help="locomo: user or system placement.")] = "user",
    data_dir: Annotated[Path | None, typer.Option(help="Folder with musique/ and locomo/.")] = None,
    config: ConfigOpt = None,
) -> None:
    """Answer F1 of full / naive / epic composition on MuSiQue or LoCoMo (categories 1-4)."""
    from tessera.benchmark.evaluate import evaluate

    if workload is WorkloadName.synthetic:
        typer.echo("tessera eval: the synthetic workload has no gold answers; use rag or locomo", err=True)
        raise typer.Exit(2)
    cfg = _load(config)
    try:
        wl = select_workload(workload, 0 if workload is WorkloadName.locomo else 5000, data_dir, 0.0, top_k, unit_words,
                       placement, 0)
    except ConfigError as exc:
        typer.echo(f"tessera eval: {exc}", err=True)
        raise typer.Exit(2) from None
    names = [p.strip() for p in policies.split(",") if p.strip()]
    result = evaluate(cfg, wl, questions, names, max_new_tokens)
    typer.echo(f"{result['workload']}: {result['questions']} questions")
    for name, score in result["f1"].items():
        agree = result["agreement_with_full"].get(name)
        extra = f"  (answer F1 vs full: {agree:.1f})" if agree is not None else ""
        typer.echo(f"  {name:<6} F1 {score:5.1f}{extra}")


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        typer.echo(f"tessera: {what} must be comma-separated integers, got {text!r}", err=True)
        raise typer.Exit(2) from None
    return values


@app.command()
def verify(
    workload: Annotated[WorkloadName, typer.Option(
        help="Prompts from rag (MuSiQue), locomo or synthetic.")] = WorkloadName.rag,
    prompts: Annotated[Path | None, typer.Option(help="JSONL of your own chat requests (API format, with "
                                                 "context_units and unit_placement) instead of a workload.")] = None,
    samples: Annotated[int, typer.Option(help="Prompts to score (0: all).")] = 40,
    policies: Annotated[str, typer.Option(help="Comma-separated composition policies.")] = "naive,epic,full",
    ks: Annotated[str, typer.Option(help="epic: comma-separated k (recompute_tokens).")] = "4,16",
    fractions: Annotated[str, typer.Option(help="epic: comma-separated recompute_fraction values.")] = "1.0",
    leads: Annotated[str, typer.Option(help="Comma-separated unit leads: none, lead (<|endoftext|>).")] = "none,lead",
    answer_tokens: Annotated[int, typer.Option(help="N: greedy answer tokens of full prefill to compare.")] = 16,
    kl_positions: Annotated[int, typer.Option(help="Answer positions the mean KL is taken over.")] = 8,
    max_kl: Annotated[float | None, typer.Option(
        help="Fail (exit 1) if the configured setting's mean KL is above.")] = None,
    min_agreement: Annotated[float | None, typer.Option(help="Fail (exit 1) if the configured setting's greedy "
                                                        "prefix agreement is below.")] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Pick the cheapest setting (fewest recomputed "
                                            "unit tokens) meeting --target-kl/--target-agreement (default: the "
                                            "configured setting's own KL and agreement); write an overlay.")] = False,
    target_kl: Annotated[float | None, typer.Option(help="Calibration target: mean KL at most this.")] = None,
    target_agreement: Annotated[float | None, typer.Option(
        help="Calibration target: greedy prefix agreement at least this.")] = None,
    overlay: Annotated[Path, typer.Option(
        help="Where --calibrate writes its config overlay.")] = Path("results/verify/calibrated.toml"),
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("results/verify/verify.json"),
    top_k: Annotated[int | None, typer.Option(
        help="Units per request (default: rag 5, locomo 6, synthetic 5).")] = None,
    unit_words: Annotated[int, typer.Option(
        help="Truncate units to this many words (0: keep; synthetic: length).")] = 0,
    placement: Annotated[str, typer.Option(help="locomo: user or system placement.")] = "user",
    conversations: Annotated[int, typer.Option(help="locomo: the first N conversations (0: all).")] = 0,
    data_dir: Annotated[Path | None, typer.Option(help="Folder with musique/ and locomo/.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the workload and the sample.")] = 0,
    frontier: Annotated[bool, typer.Option("--frontier", help="Also time each setting's composed prefill offline "
                                           "and plot the speed-fidelity frontier next to --out.")] = False,
    config: ConfigOpt = None,
) -> None:
    """Fidelity of composed prefill vs full prefill (KL, greedy agreement, top-1, 95% CIs) per setting."""
    import json

    from tessera.benchmark import verify as vf
    from tessera.composition.policies import policy_from_config
    from tessera.engines.reference import ReferenceEngine

    cfg = _load(config)
    lead_of = {"none": "", "lead": cfg.composition.unit_lead or vf.LEAD}
    lead_names = [x.strip() for x in leads.split(",") if x.strip()]
    if not lead_names or any(x not in lead_of for x in lead_names) or answer_tokens < 1 or kl_positions < 1:
        typer.echo("tessera verify: --leads takes none and/or lead; --answer-tokens and --kl-positions must be >= 1",
                   err=True)
        raise typer.Exit(2)
    try:
        fracs = [float(x) for x in fractions.split(",") if x.strip()]
    except ValueError:
        typer.echo(f"tessera verify: --fractions must be comma-separated numbers, got {fractions!r}", err=True)
        raise typer.Exit(2) from None
    grid = vf.settings_grid([p.strip() for p in policies.split(",") if p.strip()], _ints(ks, "--ks"), fracs,
                            [lead_of[x] for x in lead_names])
    configured = vf.Setting.of(cfg.composition)
    settings = list(dict.fromkeys([configured, *grid]))
    try:
        for s in settings:
            policy_from_config(s.composition(cfg.composition))  # a known policy, valid k and fraction
        engine = ReferenceEngine.from_config(cfg, prefix_cache_tokens=0)
        if prompts is not None:
            pool = vf.prompts_from_file(prompts, cfg)
        else:
            n = 0 if workload is WorkloadName.locomo else max(4 * samples, 200)
            wl = select_workload(workload, n, data_dir, 1.0, top_k, unit_words, placement, seed, conversations)
            pool = vf.prompts_from_workload(cfg, wl, engine.tokenizer)
    except ConfigError as exc:
        typer.echo(f"tessera verify: {exc}", err=True)
        raise typer.Exit(2) from None
    chosen_prompts = vf.sample(pool, samples, seed)
    scores = vf.verify(engine, engine.tokenizer, cfg, chosen_prompts, settings, answer_tokens=answer_tokens,
                       kl_positions=kl_positions, progress=True, timed=frontier)
    rows = vf.summarize(scores)
    source = str(prompts) if prompts is not None else workload.value
    typer.echo(f"{source}: {len(chosen_prompts)} prompts, reference = full prefill of the plain prompt, "
               f"answer {answer_tokens} tokens, KL over the first {kl_positions}")
    for line in vf.format_rows(rows, configured):
        typer.echo(line)
    report: dict[str, object] = {"source": source, "prompts": len(chosen_prompts), "answer_tokens": answer_tokens,
                                 "kl_positions": kl_positions, "configured": configured.label,
                                 "rows": [r.as_dict() for r in rows]}
    code = 0
    mine = next(r for r in rows if r.setting == configured)
    if not mine.meets(max_kl, min_agreement):
        typer.echo(f"FAIL: {configured.label} has mean KL {mine.kl.mean:.4f} and greedy agreement "
                   f"{mine.prefix.mean:.3f} (limits: max KL {max_kl}, min agreement {min_agreement})", err=True)
        code = 1
    if calibrate:
        if target_kl is None and target_agreement is None:  # no worse than what the config serves today
            target_kl, target_agreement = mine.kl.mean, mine.prefix.mean
        best = vf.cheapest(rows, target_kl, target_agreement)
        if best is None:
            typer.echo(f"calibration: no setting meets KL <= {target_kl} and agreement >= {target_agreement}; "
                       "add larger --ks or more policies", err=True)
            code = 1
        else:
            overlay.parent.mkdir(parents=True, exist_ok=True)
            overlay.write_text(vf.overlay_toml(best.setting, "default" if config is None else str(config.resolve())))
            report["calibrated"] = best.as_dict()
            typer.echo(f"calibration: {best.setting.label} ({best.cost:.1f} recomputed unit tokens per prompt, "
                       f"KL {best.kl}, agreement {best.prefix}); overlay written to {overlay}")
    if frontier:
        from tessera.benchmark.frontier import plot_frontier

        path = plot_frontier(rows, out.with_suffix(".frontier.png"),
                                f"{source}: speed vs fidelity ({len(chosen_prompts)} prompts)")
        report["frontier_plot"] = str(path)
        typer.echo(f"plot: {path}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    typer.echo(f"wrote {out}")
    raise typer.Exit(code)


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Output folder for bench.json and the plots.")] = Path("results/demo"),
    requests: Annotated[int, typer.Option(help="Requests per run (half warm up).")] = 24,
    rates: Annotated[str, typer.Option(help="Comma-separated request rates (req/s).")] = "0.5,1.0",
    config: ConfigOpt = None,
) -> None:
    """The main job: the embedded cluster under a short Poisson load, prefix caching vs Tessera (~5 min on 2 cores).

    Agent-memory style requests bring 4 records each, drawn Zipf-popular from 60 and in random
    order, so the same records recur at different positions: exact prefix caching reuses only
    the system prompt, Tessera reuses the records.
    """
    import asyncio

    from tessera.benchmark.runner import BenchOptions, run_bench
    from tessera.benchmark.workloads import synthetic_workload

    cfg = _load(config)
    wl = synthetic_workload(requests, n_units=60, unit_words=120, units_per_request=4, zipf_s=1.0, seed=0)
    opts = BenchOptions(systems=["prefix", "tessera"], rates=_floats(rates, "--rates"), max_tokens=1,
                        warmup_frac=0.5, unloaded_requests=0, out_dir=out, seed=0)
    typer.echo(f"tessera demo: {requests} requests per run at {rates} req/s, systems prefix and tessera; "
               f"each run starts a fresh cluster from the embedded config", err=True)
    report = asyncio.run(run_bench(cfg, wl, opts))
    for line in format_demo(report):
        typer.echo(line)


@app.command()
def chaos(
    config: ConfigOpt = None,
    duration: Annotated[float, typer.Option(help="Seconds of Poisson load (faults stop with it).")] = 120.0,
    rate: Annotated[float, typer.Option(help="Requests per second.")] = 2.0,
    fault_every: Annotated[float, typer.Option(help="Seconds between two injected faults.")] = 8.0,
    max_tokens: Annotated[int, typer.Option(help="Greedy output tokens per request.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of arrivals, requests and faults.")] = 0,
    log_dir: Annotated[Path | None, typer.Option("--log-dir", help="Where each role's log goes.")] = None,
) -> None:
    """Faults under load, as real processes: kill -9 / SIGSTOP nodes, corrupt a block, restart retrieval.

    Every reply is verified against the offline composition.
    """
    from tessera.benchmark.chaos import ChaosOptions, ChaosRun

    cfg = _load(config)
    opts = ChaosOptions(duration_s=duration, rate=rate, fault_every_s=fault_every, max_tokens=max_tokens, seed=seed)
    typer.echo(f"tessera chaos: {duration:.0f}s at {rate} req/s, a fault every {fault_every:.0f}s", err=True)
    report = ChaosRun(cfg, opts, log_dir).run()
    typer.echo(report.render())
    if not report.ok:
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
