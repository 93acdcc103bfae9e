"""``tessera verify``: the options of a fidelity run, the settings they name, thresholds and calibration.

Scoring itself is :mod:`tessera.benchmark.verify`; this module picks the prompts and the
settings from the command-line options, checks the configured setting against ``--max-kl`` /
``--min-agreement``, calibrates (a calibration record per scored setting for the fidelity gate,
and the cheapest setting meeting a target, written as a config overlay), optionally plots the
speed-fidelity frontier, and writes the JSON report.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tessera.benchmark import extras, options
from tessera.benchmark import verify as vf
from tessera.benchmark.options import say
from tessera.benchmark.workloads import WorkloadName, select_workload
from tessera.composition.calibration import Fingerprint, records_dir, write_record
from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.errors import ConfigError


@dataclass(frozen=True)
class VerifyOptions:
    """``tessera verify``'s options as given (see ``tessera verify --help`` for each one's meaning)."""

    workload: WorkloadName
    prompts: Path | None
    samples: int
    policies: str  # comma-separated composition policies
    ks: str  # comma-separated epic k
    fractions: str  # comma-separated epic recompute fractions
    inline_shares: str  # comma-separated epic inline shares ("": the config's)
    budgets: str  # comma-separated recompute budgets of query and deviation ("": the config's)
    leads: str  # comma-separated: none, lead ("": the configured lead)
    threads: int  # torch threads of the scoring engine (0: every core this process may use)
    answer_tokens: int
    kl_positions: int
    max_kl: float | None
    min_agreement: float | None
    calibrate: bool
    target_kl: float | None
    target_agreement: float | None
    overlay: Path
    out: Path
    top_k: int | None
    unit_words: int
    placement: str
    conversations: int
    data_dir: Path | None
    seed: int
    frontier: bool
    config_path: Path | None  # the --config file, named as the overlay's base


def _numbers(text: str, flag: str, default: list[float]) -> list[float]:
    """The comma-separated numbers of ``flag``, in order (``default`` when it names none)."""
    try:
        return [float(x) for x in text.split(",") if x.strip()] or default
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def _settings(config: ClusterConfig, opts: VerifyOptions) -> tuple[vf.Setting, list[vf.Setting]]:
    """The configured setting and every setting to score (the configured one first), each a valid policy."""
    lead_of = {"none": "", "lead": config.composition.unit_lead or vf.LEAD}
    lead_names = options.names(opts.leads) or ["lead" if config.composition.unit_lead else "none"]
    if not lead_names or any(x not in lead_of for x in lead_names) or opts.answer_tokens < 1 or opts.kl_positions < 1:
        raise ConfigError("--leads takes none and/or lead; --answer-tokens and --kl-positions must be >= 1")
    fracs = _numbers(opts.fractions, "--fractions", [])
    shares = _numbers(opts.inline_shares, "--inline-shares", [config.composition.inline_share])
    budgets = _numbers(opts.budgets, "--budgets", [config.composition.recompute_budget])
    grid = vf.settings_grid(options.names(opts.policies), options.ints(opts.ks, "--ks"), fracs,
                            [lead_of[x] for x in lead_names], shares, config.composition.unit_bos, budgets)
    configured = vf.Setting.of(config.composition)
    settings = list(dict.fromkeys([configured, *grid]))
    for s in settings:
        policy_from_config(s.composition(config.composition))  # a known policy, valid k and fraction
    return configured, settings


def _records(config: ClusterConfig, model: str, rows: list[vf.Row], source: str, prompts: int) -> Path:
    """A calibration record per scored setting, for this serving fingerprint (the fidelity gate reads them)."""
    directory = records_dir(config.composition)
    for r in rows:
        fp = Fingerprint.of(r.setting.composition(config.composition), model, config.model.dtype, config.kv_dtype,
                            config.model.engine)
        write_record(directory, fp, dataclasses.asdict(r.kl), dataclasses.asdict(r.prefix), prompts, source)
    return directory


def _calibrate(rows: list[vf.Row], mine: vf.Row, opts: VerifyOptions, report: dict[str, object],
               gate: Limits | None = None) -> vf.Row | None:
    """Write the cheapest setting meeting the targets as an overlay; None if none meets them.

    Without ``--target-*`` the target is what the config serves today (no worse on either
    measure), or ``gate`` (the thresholds) when the configured setting fails them."""
    target_kl, target_agreement = opts.target_kl, opts.target_agreement
    if target_kl is None and target_agreement is None:
        target_kl, target_agreement = gate if gate is not None else (mine.kl.mean, mine.prefix.mean)
    best = vf.cheapest(rows, target_kl, target_agreement)
    if best is None:
        say(f"calibration: no setting meets KL <= {target_kl} and agreement >= {target_agreement}; "
            "add larger --ks or more policies", err=True)
        return None
    opts.overlay.parent.mkdir(parents=True, exist_ok=True)
    base = "default" if opts.config_path is None else str(opts.config_path.resolve())
    opts.overlay.write_text(vf.overlay_toml(best.setting, base))
    report["calibrated"] = best.as_dict()
    say(f"calibration: {best.setting.label} ({best.cost:.1f} recomputed unit tokens per prompt, "
        f"KL {best.kl}, agreement {best.prefix}); overlay written to {opts.overlay}")
    return best


Limits = tuple[float | None, float | None]  # (max mean KL, min greedy agreement)


def _limits(config: ClusterConfig, opts: VerifyOptions) -> tuple[Limits, str] | None:
    """The thresholds a run is judged by, and whose they are: the flags', or with ``--calibrate``
    the fidelity gate's; None when there are none."""
    if opts.max_kl is not None or opts.min_agreement is not None:
        return (opts.max_kl, opts.min_agreement), ""
    if opts.calibrate:
        return ((config.composition.max_kl, config.composition.min_agreement),
                " (the fidelity gate's: composition.max_kl / min_agreement)")
    return None


def _verdict(row: vf.Row, limits: Limits, whose: str, prompts: int, what: str = "") -> bool:
    """Print the PASS / FAIL line of ``row`` against ``limits``; whether it passed."""
    passed = row.meets(*limits)
    say(f"{'PASS' if passed else 'FAIL'}: {row.setting.label}{what} on {prompts} prompts: mean KL "
        f"{row.kl.mean:.4f} (max {limits[0]}), greedy agreement {row.prefix.mean:.3f} (min {limits[1]}){whose}",
        err=not passed)
    return passed


def _threads(config: ClusterConfig, threads: int) -> ClusterConfig:
    """The config scored with ``threads`` torch threads (0: every core this process may use)."""
    if threads < 0:
        raise ConfigError(f"--threads must be >= 0, got {threads}")
    n = threads or len(os.sched_getaffinity(0))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, threads=n))


def run_verify(config: ClusterConfig, opts: VerifyOptions) -> int:
    """Score every setting, print the table, check thresholds, calibrate; the exit code (0 or 1)."""
    started = time.perf_counter()
    if opts.frontier:
        extras.require("tessera verify --frontier", "matplotlib")
    config = _threads(config, opts.threads)
    configured, settings = _settings(config, opts)
    # a bad --prompts file or a missing data set fails before the model loads
    pool = vf.prompts_from_file(opts.prompts, config) if opts.prompts is not None else None
    wl = None
    if pool is None:
        n = 0 if opts.workload is WorkloadName.locomo else max(4 * opts.samples, 200)
        wl = select_workload(opts.workload, n, opts.data_dir, 1.0, opts.top_k, opts.unit_words, opts.placement,
                             opts.seed, opts.conversations)
    engine, tokenizer = vf.configured_engine(config)
    if pool is None:
        assert wl is not None
        pool = vf.prompts_from_workload(config, wl, tokenizer)
    chosen_prompts = vf.sample(pool, opts.samples, opts.seed)
    scores = vf.verify(engine, tokenizer, config, chosen_prompts, settings, answer_tokens=opts.answer_tokens,
                       kl_positions=opts.kl_positions, progress=True, timed=opts.frontier)
    rows = vf.summarize(scores)
    source = str(opts.prompts) if opts.prompts is not None else opts.workload.value
    say(f"{source}: {len(chosen_prompts)} prompts, reference = full prefill of the plain prompt, "
        f"answer {opts.answer_tokens} tokens, KL over the first {opts.kl_positions}")
    for line in vf.format_rows(rows, configured):
        say(line)
    report: dict[str, object] = {"source": source, "prompts": len(chosen_prompts),
                                 "answer_tokens": opts.answer_tokens, "kl_positions": opts.kl_positions,
                                 "configured": configured.label, "rows": [r.as_dict() for r in rows]}
    graded = next((s.full_f1 for s in scores.values() if s.full_f1), None)
    if graded is not None:  # what the ratios divide by: a small F1 makes them noisy
        report["full_f1"] = float(sum(graded) / len(graded))
        say(f"full prefill's answer F1 on the {len(graded)} prompts with gold answers: {report['full_f1']:.3f}")
    mine = next(r for r in rows if r.setting == configured)
    judged = _limits(config, opts)
    passed = None if judged is None else _verdict(mine, *judged, len(chosen_prompts))
    code = 1 if passed is False else 0
    if opts.calibrate:
        directory = _records(config, engine.fingerprint.model, rows, source, len(chosen_prompts))
        report["records"] = str(directory)
        say(f"calibration records of {len(rows)} settings written to {directory}")
        failing = judged if passed is False else None  # then the overlay must pass instead
        best = _calibrate(rows, mine, opts, report, failing[0] if failing is not None else None)
        if best is None:
            code = 1
        elif failing is not None:
            passed = _verdict(best, *failing, len(chosen_prompts), " (the overlay)")
            code = 0 if passed else 1
    report["passed"] = passed
    if opts.frontier:
        from tessera.benchmark.frontier import plot_frontier

        path = plot_frontier(rows, opts.out.with_suffix(".frontier.png"),
                             f"{source}: speed vs fidelity ({len(chosen_prompts)} prompts)")
        report["frontier_plot"] = str(path)
        say(f"plot: {path}")
    report["seconds"] = time.perf_counter() - started
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2))
    say(f"wrote {opts.out} ({report['seconds']:.0f} s)")
    return code

