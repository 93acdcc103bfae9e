"""Command line: ``tessera run | up | bench | report | simulate | analyze | eval | verify``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from tessera.benchmark.load_flags import with_load_flags
from tessera.benchmark.options import LoadOptions, OptionError
from tessera.benchmark.workloads import DataMissing, WorkloadName
from tessera.config import ClusterConfig, Role
from tessera.config_file import load_config
from tessera.errors import BadRequest, ConfigError
from tessera.launcher import ClusterError

app = typer.Typer(
    name="tessera",
    help="Tessera: retrieval as the control plane for KV-cache reuse in RAG and agent-memory serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from tessera import __version__

        typer.echo(f"tessera {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Tessera: retrieval as the control plane for KV-cache reuse."""


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="Cluster config (TOML). Default: the embedded single-machine cluster."),
]


def _load(config: Path | None, role: Role | None = None) -> ClusterConfig:
    """The config, its policy names checked (those ``role`` uses; every one without a role)."""
    from tessera.roles import check_registered

    try:
        cfg = load_config(config)
        check_registered(cfg, role)
        return cfg
    except ConfigError as exc:
        typer.echo(f"tessera: config error: {exc}", err=True)
        raise typer.Exit(2) from None


@contextmanager
def _usage(command: str) -> Iterator[None]:
    """A bad option value, config value or input file of ``command``: one line on stderr, exit 2."""
    try:
        yield
    except OptionError as exc:  # names its flag
        typer.echo(f"tessera: {exc}", err=True)
        raise typer.Exit(2) from None
    except DataMissing as exc:
        offer = "; or --workload synthetic, which needs no data" if command in ("bench", "verify") else ""
        typer.echo(f"tessera {command}: {exc}{offer}", err=True)
        raise typer.Exit(2) from None
    except (ConfigError, BadRequest) as exc:
        typer.echo(f"tessera {command}: {exc}", err=True)
        raise typer.Exit(2) from None
    except ClusterError as exc:  # a cluster that did not start (a busy port, a role that exited)
        typer.echo(f"tessera {command}: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def run(
    role: Annotated[Role, typer.Option("--role", "-r", help="Which role this process plays.")],
    config: ConfigOpt = None,
    node: Annotated[
        str | None,
        typer.Option("--node", "-n", help="Node name from the config ([[kvpools]] or [[generation]] name). "
                     "Required for kvpool and generation roles when the config has several. For the "
                     "retrieval role: the replica, r0 .. r<ha.replicas - 1> (default r0)."),
    ] = None,
    log_level: Annotated[LogLevel, typer.Option("--log-level", help="Log level.")] = LogLevel.info,
) -> None:
    """Run one role (retrieval, kvpool or generation) as a single asyncio process."""
    from tessera.roles import main_for
    from tessera.runtime import configure_logging

    cfg = _load(config, role)
    configure_logging(log_level.value)
    raise typer.Exit(main_for(role.value, cfg, node))


@app.command()
def up(
    config: ConfigOpt = None,
    host: Annotated[str | None, typer.Option(
        "--host", help="Host of the public API (retrieval.host; beyond loopback it needs API keys).")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port of the public API (retrieval.port).")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="What to serve (model.source): smollm2, a checkpoint directory, a .gguf file "
        "or random:<shape>.")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="The model name clients send and /v1/models lists (model.served_name; "
        "default tessera); other names get 404.")] = None,
    log_level: Annotated[LogLevel, typer.Option("--log-level", help="Log level of every role.")] = LogLevel.info,
    log_dir: Annotated[Path | None,
                       typer.Option("--log-dir", help="Where each role's log goes (default: a temp dir).")] = None,
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", help="Where units and indexes persist (default: retrieval.data_dir, else "
        "$XDG_DATA_HOME/tessera/default or ~/.local/share/tessera/default).")] = None,
    replicas: Annotated[int | None, typer.Option(
        "--replicas", help="Retrieval replicas (ha.replicas); more than one elects a leader on etcd and keeps "
        "units in PostgreSQL, each started here unless --ha-etcd / --store-dsn name one.")] = None,
    ha_etcd: Annotated[str | None, typer.Option("--ha-etcd", help="etcd endpoint host:port (ha.etcd).")] = None,
    store_dsn: Annotated[str | None, typer.Option(
        "--store-dsn", help="PostgreSQL DSN of the unit store (retrieval.postgres_dsn; sets retrieval.store = "
        "postgres).")] = None,
) -> None:
    """Start every role of the config on this machine (retrieval, kvpool, generation) and wait for Ctrl-C."""
    from tessera.ha.local import replicated
    from tessera.launcher import serve, with_overrides, with_persistent_data

    try:
        cfg = with_overrides(_load(config), host=host, port=port, model=model, served_name=served_model_name)
        with replicated(with_persistent_data(cfg, data_dir), replicas, ha_etcd, store_dsn) as cfg:
            code = serve(cfg, log_dir, log_level=log_level.value)
    except ConfigError as exc:
        typer.echo(f"tessera up: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def analyze(
    trace: Annotated[Path, typer.Argument(help="JSONL trace: traffic format (messages, units, ...; see "
                                          "docs/bench/traces.md) or rendered prompts ({stream, tokens, units} per "
                                          "line).")],
    per_stream: Annotated[bool, typer.Option("--per-stream", help="Also print each stream's numbers.")] = False,
    config: ConfigOpt = None,
) -> None:
    """Classify a trace's unit tokens (prefix-covered, non-prefix repeat, new; paper §3) and print the ceiling:
    the best-case prefill saving of composition over prefix caching."""
    from tessera.benchmark.trace import run_analyze

    cfg = _load(config)
    with _usage("analyze"):
        run_analyze(trace, per_stream, cfg)


trace_app = typer.Typer(help="Write traffic traces (the format tessera analyze and tessera bench --trace read).",
                        no_args_is_help=True)
app.add_typer(trace_app, name="trace")


@trace_app.command("from-workload")
def trace_from_workload(
    out: Annotated[Path, typer.Option(help="The traffic trace to write (JSONL).")],
    workload: Annotated[WorkloadName, typer.Option(help="rag, locomo or synthetic.")] = WorkloadName.synthetic,
    requests: Annotated[int, typer.Option(help="Requests (locomo: 0 = all).")] = 60,
    rate: Annotated[float, typer.Option(help="Poisson arrival times at this rate (req/s); 0: no times.")] = 0.0,
    private: Annotated[bool, typer.Option("--private", help="Units as {id, tokens}: no text in the trace.")] = False,
    top_k: Annotated[int | None, typer.Option(help="Units per request.")] = None,
    unit_words: Annotated[int, typer.Option(help="Truncate units to this many words (0: keep).")] = 0,
    placement: Annotated[str, typer.Option(help="locomo: user or system placement.")] = "user",
    conversations: Annotated[int, typer.Option(help="locomo: the first N conversations (0: all).")] = 0,
    data_dir: Annotated[Path | None, typer.Option(help="Folder with musique/ and locomo/.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the workload and the arrivals.")] = 0,
    config: ConfigOpt = None,
) -> None:
    """A bench workload's requests, with the units retrieval would give them, as a traffic trace."""
    from tessera.benchmark.traffic_run import write_workload_trace

    cfg = _load(config)
    with _usage("trace"):
        write_workload_trace(cfg, workload, out, requests=requests, rate=rate, private=private, top_k=top_k,
                             unit_words=unit_words, placement=placement, conversations=conversations,
                             data_dir=data_dir, seed=seed)


@trace_app.command("from-rendered")
def trace_from_rendered(
    rendered: Annotated[Path, typer.Argument(help="Rendered prompts ({stream, tokens, units} per line).")],
    out: Annotated[Path, typer.Option(help="The traffic trace to write (JSONL).")],
    private: Annotated[bool, typer.Option("--private", help="Units as {id, tokens}: no text in the trace.")] = False,
    config: ConfigOpt = None,
) -> None:
    """Tessera's rendered traces (--trace-only, --dump-trace, return_layout) as a traffic trace; the config's
    tokenizer must be the one that rendered them."""
    from tessera.benchmark.traffic_run import write_rendered_trace

    cfg = _load(config)
    with _usage("trace"):
        write_rendered_trace(cfg, rendered, out, private=private)


data_app = typer.Typer(help="The data sets bench, verify and eval read (docs/data.md): fetch and check them.",
                       no_args_is_help=True)
app.add_typer(data_app, name="data")
DestOpt = Annotated[Path | None, typer.Option(
    "--dest", help="The data directory (default: ../shared/data beside the repository, where bench, verify and "
                   "eval look without --data-dir).")]
OnlyOpt = Annotated[list[str] | None, typer.Option("--only", help="Only this data set (repeatable): locomo, musique.")]


@data_app.command("fetch")
def data_fetch(
    dest: DestOpt = None,
    only: OnlyOpt = None,
    base_url: Annotated[str | None, typer.Option(
        "--base-url", help="A mirror laid out like the data directory (URL/locomo/locomo10.json, ...) instead of "
                           "the public sources.")] = None,
) -> None:
    """Download each data file, verify its SHA-256 and move it into place; files already right are skipped."""
    from tessera.benchmark.datasets import run_fetch

    with _usage("data"):
        code = run_fetch(dest, only, base_url)
    raise typer.Exit(code)


@data_app.command("check")
def data_check(dest: DestOpt = None, only: OnlyOpt = None) -> None:
    """Say which data files are present with their published SHA-256 (exit 1 if any is missing or changed)."""
    from tessera.benchmark.datasets import run_check

    with _usage("data"):
        code = run_check(dest, only)
    raise typer.Exit(code)


@app.command()
@with_load_flags(WorkloadName.rag)
def bench(
    load: LoadOptions,
    warmup_rate: Annotated[float, typer.Option(help="Send the warm-up share at this rate (req/s) instead of each "
                                               "run's own (0: the run's rate); the measured share starts "
                                               "once it has drained.")] = 0.0,
    out: Annotated[Path, typer.Option(help="Output folder for bench.json and the plots.")] = Path("results/bench"),
    dump_trace: Annotated[bool, typer.Option("--dump-trace",
                                             help="Write each run's rendered prompts as JSONL traces.")] = False,
    trace_only: Annotated[bool, typer.Option(
        "--trace-only", help="Only render the workload's prompts (retrieval included, no serving) into "
                             "OUT/trace-WORKLOAD.jsonl for tessera analyze.")] = False,
    saturation: Annotated[float, typer.Option(help="Skip a system's higher rates once its mean TTFT exceeds this × "
                                              "its unloaded TTFT (0: run every rate).")] = 10.0,
    fidelity: Annotated[int, typer.Option(help="Score N of the measured requests offline against full prefill "
                                          "(tessera verify's metrics) and report them next to TTFT (0: skip).")] = 0,
    arrivals: Annotated[str, typer.Option(help="--trace: recorded (its arrival_s), poisson (at --rates), or auto "
                                          "(recorded when the trace has times).")] = "auto",
    url: Annotated[list[str] | None, typer.Option(
        help="[NAME=]URL of a running endpoint to drive instead of fresh clusters (repeatable): Tessera, or any "
             "OpenAI-compatible server (units rendered into the prompt as text). Loopback only unless "
             "--allow-host.")] = None,
    allow_host: Annotated[list[str] | None, typer.Option(
        help="A non-loopback host --url may drive (repeatable; compared as written, never resolved).")] = None,
    api: Annotated[str, typer.Option(help="--url: tessera, openai, or auto (ask GET /v1/models).")] = "auto",
    api_key: Annotated[str, typer.Option(envvar="TESSERA_API_KEY", help="Bearer key sent to --url endpoints.")] = "",
    max_concurrency: Annotated[int, typer.Option(help="Requests in flight at most; a request waiting for a slot "
                                                 "counts the wait in its TTFT (0: no bound).")] = 256,
    timeout: Annotated[float, typer.Option(help="Seconds one request may take before it counts as failed.")] = 3600.0,
    overload_control: Annotated[bool, typer.Option(
        "--overload-control", help="Keep the config's control.max_queue_wait_s (off by default: a 429 has no "
                                   "TTFT); refused requests count as failed and throughput is goodput.")] = False,
    config: ConfigOpt = None,
) -> None:
    """Open-loop load (Poisson, or a trace's recorded times) against fresh local clusters or running endpoints;
    prints and plots TTFT per system and rate."""
    from tessera.benchmark.sweep import SweepOptions, run_sweep

    cfg = _load(config)
    opts = SweepOptions(load=load, out=out, dump_trace=dump_trace, trace_only=trace_only, saturation=saturation,
                        fidelity=fidelity, arrivals=arrivals, urls=tuple(url or ()),
                        allow_hosts=tuple(allow_host or ()), api=api, api_key=api_key,
                        max_concurrency=max_concurrency, timeout_s=timeout, warmup_rate=warmup_rate,
                        overload_control=overload_control)
    with _usage("bench"):
        run_sweep(cfg, opts)


@app.command()
def report(
    runs: Annotated[list[Path], typer.Argument(help="tessera bench --out folders (or their bench.json), in order.")],
    out: Annotated[Path | None, typer.Option(help="Write the merged bench.json and plots here (default: only "
                                             "print).")] = None,
    keep: Annotated[str, typer.Option(help="When two runs measured one system at one rate (or both have its "
                                      "unloaded reference): error, first or last (which file counts), or pool (their "
                                      "requests pooled into one row).")] = "error",
) -> None:
    """Print one report over several tessera bench runs of one workload (a sweep and its extensions): each
    system's rows from every run, and the targets computed over their union."""
    from tessera.benchmark.merge import run_report

    with _usage("report"):
        run_report(runs, out, keep)


@app.command()
@with_load_flags(WorkloadName.synthetic)
def simulate(
    load: LoadOptions,
    out: Annotated[Path | None, typer.Option(help="Output folder for simulate.json and the plots.")] = None,
    cost_model: Annotated[str, typer.Option(
        help="A shipped cost model (llama3-8b-a100, llama3-8b-h100) or a JSON file; with --calibrate, the file "
             "to write. Default: results/cost-model.json.")] = "",
    calibrate: Annotated[bool, typer.Option(
        "--calibrate", help="Measure the configured engine's prefill, extend and decode step costs on this "
                            "machine and write the cost model.")] = False,
    calibrate_cpu: Annotated[bool, typer.Option(
        "--calibrate-cpu", help="Run the config's real cluster at each --rates rate on --workload and write each "
                                "role's CPU per request outside the engine threads, and this machine's cores, into "
                                "the --cost-model file (written by --calibrate).")] = False,
    nodes: Annotated[int, typer.Option(
        help="Generation nodes (copies of the first configured; 0: as configured).")] = 0,
    memory_nodes: Annotated[int, typer.Option(help="Memory nodes (0: as configured).")] = 0,
    local_blocks: Annotated[int, typer.Option(help="Local cache blocks per generation node (0: as configured).")] = 0,
    shared_blocks: Annotated[int, typer.Option(help="The shared tier's blocks, all memory nodes together "
                                               "(0: as configured).")] = 0,
    max_batch_tokens: Annotated[int, typer.Option(help="Batch token budget per node step (0: as configured).")] = 0,
    prefix_cache_tokens: Annotated[int, typer.Option(
        help="Exact prefix cache tokens per generation node (0: as configured).")] = 0,
    compare: Annotated[Path | None, typer.Option(
        help="A tessera bench report (bench.json) of the same workload and rates: print simulated vs measured "
             "mean TTFT and the error of each run.")] = None,
    config: ConfigOpt = None,
) -> None:
    """Discrete-event simulation of a cluster whose decisions are made by the real control plane;
    prints tessera bench's TTFT table, then load imbalance and the plane's CPU time per request."""
    from tessera_lab.simulate.command import SimulateOptions, run_command

    cfg = _load(config)
    opts = SimulateOptions(load=load, out=out, cost_model=cost_model, calibrate=calibrate, nodes=nodes,
                           memory_nodes=memory_nodes, local_blocks=local_blocks, shared_blocks=shared_blocks,
                           max_batch_tokens=max_batch_tokens, prefix_cache_tokens=prefix_cache_tokens,
                           compare=compare, calibrate_cpu=calibrate_cpu)
    with _usage("simulate"):
        run_command(cfg, opts)


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
    from tessera_lab.eval import EvalOptions, run_eval

    cfg = _load(config)
    opts = EvalOptions(workload=workload, questions=questions, policies=policies, max_new_tokens=max_new_tokens,
                       top_k=top_k, unit_words=unit_words, placement=placement, data_dir=data_dir)
    with _usage("eval"):
        run_eval(cfg, opts)


@app.command()
def verify(
    workload: Annotated[WorkloadName, typer.Option(
        help="Prompts from rag (MuSiQue), locomo or synthetic.")] = WorkloadName.rag,
    prompts: Annotated[Path | None, typer.Option(help="JSONL of your own prompts instead of a workload: chat "
                                                 "requests (API format, with context_units) or a traffic trace "
                                                 "(with units, docs/bench/traces.md).")] = None,
    samples: Annotated[int, typer.Option(help="Prompts to score (0: all).")] = 40,
    policies: Annotated[str, typer.Option(help="Comma-separated composition policies (full is the reference "
                                          "itself: add it to check that it scores exactly).")] = "naive,epic",
    ks: Annotated[str, typer.Option(help="epic, query, deviation: comma-separated k (recompute_tokens).")] = "4,16",
    fractions: Annotated[str, typer.Option(
        help="epic, query, deviation: comma-separated recompute_fraction values.")] = "1.0",
    inline_shares: Annotated[str, typer.Option(
        help="epic, query, deviation: comma-separated inline_share values (default: the config's).")] = "",
    budgets: Annotated[str, typer.Option(help="query, deviation: comma-separated recompute_budget values (default: the "
                                         "config's).")] = "",
    leads: Annotated[str, typer.Option(help="Comma-separated unit leads: none, lead (<|endoftext|>); default: "
                                       "the configured one (composition.unit_lead).")] = "",
    threads: Annotated[int, typer.Option(help="Torch threads of the scoring engine (0: every core this process "
                                         "may use).")] = 0,
    answer_tokens: Annotated[int, typer.Option(help="N: greedy answer tokens of full prefill to compare.")] = 16,
    kl_positions: Annotated[int, typer.Option(help="Answer positions the mean KL is taken over.")] = 8,
    max_kl: Annotated[float | None, typer.Option(
        help="Fail (exit 1) if the configured setting's mean KL is above (with --calibrate, default: "
             "composition.max_kl, the fidelity gate's).")] = None,
    min_agreement: Annotated[float | None, typer.Option(help="Fail (exit 1) if the configured setting's greedy "
                                                        "prefix agreement is below (with --calibrate, default: "
                                                        "composition.min_agreement).")] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Write a calibration record per scored setting "
                                            "(composition.calibration_dir; the fidelity gate reads them), and pick "
                                            "the cheapest setting (fewest recomputed unit tokens) meeting "
                                            "--target-kl/--target-agreement (default: the configured setting's own "
                                            "KL and agreement); write an overlay.")] = False,
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
    from tessera.benchmark.verify_run import VerifyOptions, run_verify

    cfg = _load(config)
    opts = VerifyOptions(workload=workload, prompts=prompts, samples=samples, policies=policies, ks=ks,
                         fractions=fractions, inline_shares=inline_shares, budgets=budgets, leads=leads,
                         threads=threads, answer_tokens=answer_tokens,
                         kl_positions=kl_positions,
                         max_kl=max_kl, min_agreement=min_agreement, calibrate=calibrate, target_kl=target_kl,
                         target_agreement=target_agreement, overlay=overlay, out=out, top_k=top_k,
                         unit_words=unit_words, placement=placement, conversations=conversations, data_dir=data_dir,
                         seed=seed, frontier=frontier, config_path=config)
    with _usage("verify"):
        code = run_verify(cfg, opts)
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
    from tessera.benchmark.sweep import run_demo

    cfg = _load(config)
    with _usage("demo"):
        run_demo(cfg, out, requests, rates)


@app.command()
def chaos(
    config: ConfigOpt = None,
    duration: Annotated[float, typer.Option(help="Seconds of Poisson load (faults stop with it).")] = 120.0,
    rate: Annotated[float, typer.Option(help="Requests per second.")] = 2.0,
    fault_every: Annotated[float, typer.Option(help="Seconds between two injected faults.")] = 8.0,
    max_tokens: Annotated[int, typer.Option(help="Greedy output tokens per request.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of arrivals, requests and faults.")] = 0,
    log_dir: Annotated[Path | None, typer.Option("--log-dir", help="Where each role's log goes.")] = None,
    hosts: Annotated[int, typer.Option(help="Run on N hosts (network namespaces; needs root): the retrieval role, "
                                       "one memory node, N-2 generation nodes, network faults mixed in. "
                                       "0: every role on this host.")] = 0,
    replicas: Annotated[int, typer.Option(
        "--replicas", help="Retrieval replicas (ha.replicas; local etcd and PostgreSQL unless the config names "
        "them): the retrieval restart becomes leader kill -9 and leader SIGSTOP past its lease.")] = 1,
) -> None:
    """Faults under load, as real processes: kill -9 / SIGSTOP nodes, corrupt a block, restart retrieval.

    Every reply is verified against the offline composition. With --hosts, also partitions, a
    one-way heartbeat block and a slow link, and a checker of invariants over the run's history.
    """
    from tessera_lab.chaos.harness import ChaosOptions, ChaosRun

    cfg = _load(config)
    opts = ChaosOptions(duration_s=duration, rate=rate, fault_every_s=fault_every, max_tokens=max_tokens, seed=seed)
    typer.echo(f"tessera chaos: {duration:.0f}s at {rate} req/s, a fault every {fault_every:.0f}s", err=True)
    if hosts:
        from tessera_lab.hosts.chaos import run_on_hosts

        with _usage("chaos"):
            report = run_on_hosts(cfg, opts, log_dir, hosts)
    elif replicas > 1 or cfg.ha.replicas > 1:
        from tessera.ha.local import replicated
        from tessera_lab.chaos.replicas import ReplicatedChaosRun

        with _usage("chaos"), replicated(cfg, replicas if replicas > 1 else None) as ha_cfg:
            report = ReplicatedChaosRun(ha_cfg, opts, log_dir).run()
    else:
        report = ChaosRun(cfg, opts, log_dir).run()
    typer.echo(report.render())
    if not report.ok:
        raise typer.Exit(1)


hosts_app = typer.Typer(name="hosts", help="Every role on a host of its own (network namespaces; needs root).",
                        no_args_is_help=True, add_completion=False, rich_markup_mode=None)
app.add_typer(hosts_app)


@hosts_app.command(name="up")
def hosts_up(
    config: ConfigOpt = None,
    log_dir: Annotated[Path | None, typer.Option("--log-dir", help="Where each role's log goes.")] = None,
    api_port: Annotated[int, typer.Option(help="Loopback port the API is forwarded to (0: a free one).")] = 0,
) -> None:
    """Bring up one host per role of the config, print how to reach the API; Ctrl-C deletes the hosts."""
    from tessera_lab.hosts.up import serve_hosts

    raise typer.Exit(serve_hosts(_load(config), log_dir, api_port))


@hosts_app.command(name="clean")
def hosts_clean() -> None:
    """Delete the hosts a crashed `tessera hosts up` or chaos run left behind."""
    from tessera_lab.hosts.up import clean

    raise typer.Exit(clean())


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
