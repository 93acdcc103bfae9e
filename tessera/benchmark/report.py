"""Summaries, tables and plots of bench runs (no I/O except writing the PNGs)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.benchmark.client import Result
from tessera.benchmark.extras import pyplot


def summarize(results: Sequence[Result], warmup_frac: float, rate: float) -> dict[str, Any]:
    """Stats over the measured part (after the warm-up share of the sequence).

    A coalesced unit (one that joined another request's in-flight prefill on its node) is a
    tier of its own: it is not in ``computed`` nor in ``computed_share_of_prompt``, which count
    each forward pass once, and it counts as reused in ``reuse_efficiency`` (see :func:`reuse`).
    """
    start = int(len(results) * warmup_frac)
    measured = results[start:]
    ok = [r for r in measured if r.ok]
    ttfts = np.array([r.ttft for r in ok], dtype=np.float64)
    tiers = {"prefix": 0, "local": 0, "remote": 0, "computed": 0, "coalesced": 0, "recomputed": 0, "prompt": 0}
    coalesced_units = 0
    for r in ok:
        t = r.usage.get("tessera", {})
        # an OpenAI-compatible server's prefix cache hits, where it reports them
        cached = (r.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        tiers["prefix"] += t.get("prefix_cached_tokens", cached if not t else 0)
        tiers["local"] += t.get("local_tokens", 0)
        tiers["remote"] += t.get("remote_tokens", 0)
        tiers["computed"] += t.get("computed_unit_tokens", 0)
        tiers["coalesced"] += t.get("coalesced_unit_tokens", 0)
        tiers["recomputed"] += t.get("recomputed_tokens", 0)
        tiers["prompt"] += r.usage.get("prompt_tokens", 0)
        coalesced_units += t.get("coalesced_units", 0)
    unit_tokens = tiers["local"] + tiers["remote"] + tiers["computed"] + tiers["coalesced"]
    reusable, reused = reuse(results, start)
    exact, receipted = exact_units(ok)
    span = 0.0
    if ok:
        first = min(r.sent_at for r in ok)
        last = max(r.sent_at + (r.latency or 0.0) for r in ok)
        span = max(last - first, 1e-9)
    out: dict[str, Any] = {
        "rate": rate,
        "requests": len(measured),
        "ok": len(ok),
        "failed": len(measured) - len(ok),
        "errors": sorted({r.error[:120] or f"HTTP {r.status}" for r in measured if not r.ok})[:5],
        "throughput": len(ok) / span if span else 0.0,
        "hit_rate": {
            "prefix": tiers["prefix"] / max(tiers["prompt"], 1),
            "local": tiers["local"] / max(unit_tokens, 1),
            "remote": tiers["remote"] / max(unit_tokens, 1),
            "computed": tiers["computed"] / max(unit_tokens, 1),
            "coalesced": tiers["coalesced"] / max(unit_tokens, 1),
        },
        # the prompt tokens an engine ran a forward pass over for these requests, each pass once
        "computed_share_of_prompt": (tiers["recomputed"] + tiers["computed"]) / max(tiers["prompt"], 1),
        # the prompt tokens whose state a cache served (usage.prompt_tokens_details.cached_tokens)
        "cached_share_of_prompt": (tiers["prefix"] + tiers["local"] + tiers["remote"]) / max(tiers["prompt"], 1),
        "coalesced_units": coalesced_units,
        # unit tokens served from a cache (or a joined prefill) over those whose unit an earlier
        # request already had
        # (the trace's ceiling in the measured window); None without per-unit receipts
        "reuse_efficiency": reused / reusable if reusable else None,
        "reusable_unit_tokens": reusable,
        # unit tokens served exactly from a cache (inside the exact-prefix hit) over all unit
        # tokens, from the receipts; None without receipts
        "exact_unit_share": exact / receipted if receipted else None,
        "mean_prompt_tokens": tiers["prompt"] / max(len(ok), 1),
    }
    if len(ttfts):
        out.update({
            "mean": float(ttfts.mean()),
            "p50": float(np.percentile(ttfts, 50)),
            "p90": float(np.percentile(ttfts, 90)),
            "p99": float(np.percentile(ttfts, 99)),
            "ttfts": [float(x) for x in ttfts],
        })
    return out


# a receipt's sources whose state the engine did not compute again for the request; a coalesced
# unit's was computed once, for the request whose prefill it joined
REUSED_SOURCES = ("prefix", "local", "remote", "coalesced")


def reuse(results: Sequence[Result], start: int) -> tuple[int, int]:
    """(reusable, reused) unit tokens of the requests from ``start`` on, in sequence order.

    Reusable: the tokens of every unit that an earlier request of the sequence (warm-up
    included) already carried, the ceiling any cache could reach in the window. Reused: those
    of them served from the prefix cache, the local or the remote tier, or by joining another
    request's in-flight prefill of the unit (coalesced: the engine did not compute it again for
    this request). Read from the replies' per-unit receipts (``return_layout``); a request
    without one (failed, or a server that gives none) adds nothing, and its units count as unseen.
    """
    seen: set[str] = set()
    reusable = reused = 0
    for i, r in enumerate(results):
        receipt = (r.usage.get("tessera") or {}).get("receipt") or {}
        units = receipt.get("per_unit") or ()
        if i >= start:
            for u in units:
                if u["unit_id"] in seen:
                    reusable += u["tokens"]
                    reused += u["tokens"] if u["source"] in REUSED_SOURCES else 0
        seen.update(u["unit_id"] for u in units)
    return reusable, reused


def exact_units(results: Sequence[Result]) -> tuple[int, int]:
    """(exact, all) unit tokens of the replies' receipts: those inside the exact-prefix hit, and all."""
    exact = total = 0
    for r in results:
        receipt = (r.usage.get("tessera") or {}).get("receipt") or {}
        if "unit_tokens" in receipt:
            exact += receipt["unit_tokens"].get("prefix", 0)
            total += sum(receipt["unit_tokens"].values())
    return exact, total


def _interp_rate_at(rates: Sequence[float], means: Sequence[float], level: float) -> float | None:
    """Lowest rate at which mean TTFT reaches ``level`` (linear interpolation), None if never."""
    for i in range(1, len(rates)):
        if means[i] >= level > means[i - 1]:
            f = (level - means[i - 1]) / (means[i] - means[i - 1])
            return rates[i - 1] + f * (rates[i] - rates[i - 1])
    if means and means[0] >= level:
        return rates[0]
    return None


def _interp_mean_at(rates: Sequence[float], means: Sequence[float], rate: float) -> float | None:
    if not rates or rate < rates[0] or rate > rates[-1]:
        return None
    return float(np.interp(rate, rates, means))


def sustained_rate(rates: Sequence[float], means: Sequence[float], bound: float) -> float:
    """Highest measured rate whose mean TTFT stays within ``bound`` (interpolated to the crossing)."""
    crossing = _interp_rate_at(rates, means, bound)
    if crossing is None:
        return rates[-1] if rates and means[-1] < bound else 0.0
    return crossing


def compare(report: dict[str, Any], baseline: str = "prefix", system: str = "tessera") -> dict[str, Any]:
    """The issue's two targets, computed from the sweep (printed, never asserted)."""
    out: dict[str, Any] = {}
    systems = report["systems"]
    if baseline not in systems or system not in systems:
        return out

    def curve(name: str) -> tuple[list[float], list[float], float]:
        runs = [r for r in systems[name]["runs"] if "mean" in r]
        rates, means = [r["rate"] for r in runs], [r["mean"] for r in runs]
        serial = systems[name].get("unloaded")
        if serial and "mean" in serial:
            # the serial reference is the curve at rate 0: a system swept only at high rates is
            # interpolated from it. Mean TTFT is convex in the rate, so the straight line
            # overstates TTFT (and understates the sustained rate) below the first measured rate.
            return [0.0, *rates], [serial["mean"], *means], float(serial["mean"])
        # without a serial reference, the lowest rate stands in for "unloaded"
        return rates, means, float(runs[0]["mean"]) if runs else float("nan")

    b_rates, b_means, b_unloaded = curve(baseline)
    s_rates, s_means, s_unloaded = curve(system)
    knee = _interp_rate_at(b_rates, b_means, 3 * b_unloaded)
    out["baseline_unloaded_ttft"] = b_unloaded
    out["system_unloaded_ttft"] = s_unloaded
    out["rate_baseline_at_3x_unloaded"] = knee
    if knee is not None:
        b_at = _interp_mean_at(b_rates, b_means, knee)
        s_at = _interp_mean_at(s_rates, s_means, knee)
        out["baseline_mean_at_knee"] = b_at
        out["system_mean_at_knee"] = s_at
        if b_at and s_at:
            out["ttft_reduction_at_knee"] = b_at / s_at
    elif measured := [r for r in systems[baseline]["runs"] if "mean" in r]:
        # no knee in the rates swept: how far the baseline got, at its highest measured rate
        top = max(measured, key=lambda r: r["rate"])
        out["baseline_top_rate"] = top["rate"]
        out["baseline_mean_at_top"] = top["mean"]
        out["system_mean_at_baseline_top"] = next(
            (r["mean"] for r in systems[system]["runs"] if r.get("rate") == top["rate"] and "mean" in r), None)
    b_sus = sustained_rate(b_rates, b_means, 2 * b_unloaded)
    s_sus = sustained_rate(s_rates, s_means, 2 * s_unloaded)
    out["baseline_sustained_rate"] = b_sus
    out["system_sustained_rate"] = s_sus
    out["sustained_rate_ratio"] = s_sus / b_sus if b_sus else None
    return out


def table(report: dict[str, Any]) -> str:
    """One row per system and offered rate: TTFT, achieved throughput (and its share of the
    system's peak, so goodput past the peak shows), the prompt share served from a cache, the
    unit tokens' tiers, coalesced units, failed shared writebacks (the nodes' counters over
    the whole run; ``-`` where the server keeps none), reuse efficiency and the share of unit
    tokens served exactly from the prefix cache (receipts' ``prefix`` unit tokens)."""
    rows = ["| system | rate (req/s) | mean TTFT (s) | p50 | p90 | p99 | throughput (of peak) | ok/sent "
            "| cached share | unit tokens local/remote/computed | coalesced units | failed writebacks "
            "| reuse efficiency | exact unit share |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    dashes = " - |" * 11
    for name, sysrep in report["systems"].items():
        unloaded = [sysrep["unloaded"]] if "unloaded" in sysrep else []
        peak = max((r.get("throughput", 0.0) for r in sysrep["runs"]), default=0.0)
        for r in [*unloaded, *sysrep["runs"]]:
            if "skipped" in r:
                rows.append(f"| {name} | {r['rate']:g} | skipped ({r['skipped']}) |{dashes}")
                continue
            if "mean" not in r:
                rows.append(f"| {name} | {r['rate']:g} | - | - | - | - | - | {r['ok']}/{r['requests']} |"
                            + " - |" * 6)
                continue
            h = r["hit_rate"]
            is_unloaded = bool(unloaded) and r is unloaded[0]
            rate = "unloaded" if is_unloaded else f"{r['rate']:g}"
            of_peak = "" if is_unloaded or not peak else f" ({r['throughput'] / peak:.0%})"
            failed = r.get("nodes", {}).get("writebacks_failed")
            rows.append(
                f"| {name} | {rate} | {r['mean']:.3f} | {r['p50']:.3f} | {r['p90']:.3f} | {r['p99']:.3f} | "
                f"{r['throughput']:.2f}{of_peak} | {r['ok']}/{r['requests']} | "
                f"{_share(r.get('cached_share_of_prompt'))} | "
                f"{h['local']:.0%}/{h['remote']:.0%}/{h['computed']:.0%} | {r.get('coalesced_units', '-')} | "
                f"{'-' if failed is None else f'{failed:g}'} | {_share(r.get('reuse_efficiency'))} | "
                f"{_share(r.get('exact_unit_share'))} |")
    return "\n".join(rows)


def plot(report: dict[str, Any], out_dir: Path, cdf_rate: float | None = None) -> list[Path]:
    plt = pyplot()
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, sysrep in report["systems"].items():
        runs = [r for r in sysrep["runs"] if "mean" in r]
        ax.plot([r["rate"] for r in runs], [r["mean"] for r in runs], marker="o", label=name)
    paths.append(_finish(fig, ax, "request rate (req/s)", "mean TTFT (s)",
                         f"Mean TTFT vs rate — {report['workload']}", out_dir / "ttft_vs_rate.png"))

    measured = [[r for r in s["runs"] if r.get("ttfts")] for s in report["systems"].values()]
    common = sorted(set.intersection(*[{r["rate"] for r in runs} for runs in measured])) if measured else []
    everywhere = sorted({r["rate"] for runs in measured for r in runs})
    if everywhere:
        # one rate all systems ran at if there is one; otherwise (per-system sweeps) each system's run
        # nearest to it, labelled with its rate
        pool = common or everywhere
        rate = cdf_rate if cdf_rate in pool else pool[len(pool) // 2]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, runs in zip(report["systems"], measured, strict=True):
            if not runs:
                continue
            r = min(runs, key=lambda run: abs(run["rate"] - rate))
            xs = np.sort(np.array(r["ttfts"]))
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name if common else f"{name} at {r['rate']:g} req/s")
        title = f"TTFT CDF at {rate:g} req/s" if common else "TTFT CDF"
        paths.append(_finish(fig, ax, "TTFT (s)", "CDF", f"{title} — {report['workload']}", out_dir / "ttft_cdf.png"))
    return paths


def _finish(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    """Label, save and close one plot."""
    plt = pyplot()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# the project's stated targets per workload: (TTFT reduction at prefix caching's knee,
# sustained-rate ratio); the report prints each run against them (docs/bench/README.md)
TARGETS: dict[str, tuple[float, float]] = {"synthetic": (4.0, 3.0), "locomo": (2.5, 2.0)}


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def format_report(report: dict[str, Any]) -> list[str]:
    """``tessera bench``'s summary: the table, the target comparison, the plots."""
    lines = [report["table"]]
    c = report.get("comparison") or {}
    target = TARGETS.get(str(report.get("workload")))

    def goal(i: int) -> str:
        return f" (target >= {target[i]:g}x)" if target else ""

    if c:
        def f(x: object) -> str:
            return "n/a" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)

        lines.append(f"\nunloaded mean TTFT: prefix {f(c.get('baseline_unloaded_ttft'))}s, "
                     f"tessera {f(c.get('system_unloaded_ttft'))}s")
        if c.get("rate_baseline_at_3x_unloaded") is not None:
            lines.append(f"rate where prefix reaches 3x its unloaded TTFT: {f(c.get('rate_baseline_at_3x_unloaded'))} "
                         f"req/s; there prefix {f(c.get('baseline_mean_at_knee'))}s vs tessera "
                         f"{f(c.get('system_mean_at_knee'))}s -> {f(c.get('ttft_reduction_at_knee'))}x lower"
                         + goal(0))
        else:
            lines.append("rate where prefix reaches 3x its unloaded TTFT: " + _not_reached(c))
        lines.append(f"highest rate with mean TTFT <= 2x unloaded: prefix {f(c.get('baseline_sustained_rate'))}, "
                     f"tessera {f(c.get('system_sustained_rate'))} req/s -> {f(c.get('sustained_rate_ratio'))}x"
                     + goal(1))
    lines += [f"plot: {p}" for p in report.get("plots", [])]
    return lines


def _not_reached(c: dict[str, Any]) -> str:
    """The knee line when prefix caching never reached 3x its unloaded TTFT: how far it got."""
    top, mean, unloaded = c.get("baseline_top_rate"), c.get("baseline_mean_at_top"), c.get("baseline_unloaded_ttft")
    if top is None or mean is None or not unloaded:
        return "not measured (no measured prefix rate)"
    ours = c.get("system_mean_at_baseline_top")
    there = f"; tessera {ours:.2f}s there -> {mean / ours:.2f}x lower" if ours else ""
    return (f"not reached by {top:g} req/s, prefix's highest rate ({mean:.2f}s there, "
            f"{mean / unloaded:.1f}x its unloaded){there}; no knee figure")


def format_demo(report: dict[str, Any]) -> list[str]:
    """The table, then one line per rate: how much lower Tessera's mean TTFT is than prefix caching's."""
    lines = [report["table"]]
    means = {name: {r["rate"]: r["mean"] for r in rep["runs"] if "mean" in r}
             for name, rep in report["systems"].items()}
    for rate, base in means.get("prefix", {}).items():
        ours = means.get("tessera", {}).get(rate)
        if ours:
            lines.append(f"at {rate:g} req/s: prefix caching {base:.2f}s vs Tessera {ours:.2f}s mean TTFT "
                         f"-> {base / ours:.1f}x lower")
    lines += [f"plot: {p}" for p in report.get("plots", [])]
    return lines
