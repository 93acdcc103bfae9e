"""Simulated vs measured: a ``tessera simulate`` report against a ``tessera bench`` one.

Runs are matched by (system, rate), the unloaded reference included; the error is
(simulated - measured) / measured mean TTFT, flagged beyond ``ERROR_BOUND``: beyond it the cost
model or the simulated node misses something the real one does, or the measured run saw
another machine than the calibration did; the first requests of each run (sent to a drained
cluster, before any queue) tell the two apart. Knows nothing of how either report was made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessera.benchmark.extras import pyplot

ERROR_BOUND = 0.20
IDLE_START = 4  # a run's first requests: sent to a drained cluster, they time the machine, not the load


def _runs(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for name, sysrep in report["systems"].items():
        if "unloaded" in sysrep and "mean" in sysrep["unloaded"]:
            out[(name, "unloaded")] = sysrep["unloaded"]
        for r in sysrep["runs"]:
            if "mean" in r:
                out[(name, f"{r['rate']:g}")] = r
    return out


def compare_runs(simulated: dict[str, Any], measured: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run both reports have: measured and simulated mean / p90 TTFT, hit rates, the error."""
    sim, real = _runs(simulated), _runs(measured)
    rows = []
    for key in real:
        if key not in sim:
            continue
        s, m = sim[key], real[key]
        rows.append({"system": key[0], "rate": key[1], "measured": m["mean"], "simulated": s["mean"],
                     "measured_p90": m["p90"], "simulated_p90": s["p90"],
                     "measured_computed": m["hit_rate"]["computed"], "simulated_computed": s["hit_rate"]["computed"],
                     "error": (s["mean"] - m["mean"]) / m["mean"], "idle_start": _idle_start(m, s)})
    return rows


def _idle_start(measured: dict[str, Any], simulated: dict[str, Any]) -> float | None:
    """Measured / simulated TTFT of the run's first requests, which meet a drained cluster.

    Both sides send the same requests in the same order, so this reads the machine's speed
    during the run against the cost model's: near 1 when the run saw the calibrated machine,
    well above it when the shared host was slower then (its queueing cannot explain it yet)."""
    m, s = measured.get("ttfts") or [], simulated.get("ttfts") or []
    n = min(IDLE_START, len(m), len(s))
    return sum(m[:n]) / sum(s[:n]) if n and sum(s[:n]) > 0 else None


def comparison_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| system | rate (req/s) | measured mean TTFT (s) | simulated | error | measured / simulated p90 "
             f"| unit tokens computed, measured / simulated | first {IDLE_START} requests, measured / simulated |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flag = "" if abs(r["error"]) <= ERROR_BOUND else " **(> ±20%)**"
        idle = "–" if r.get("idle_start") is None else f"{r['idle_start']:.2f}"
        lines.append(f"| {r['system']} | {r['rate']} | {r['measured']:.3f} | {r['simulated']:.3f} | "
                     f"{r['error']:+.0%}{flag} | {r['measured_p90']:.3f} / {r['simulated_p90']:.3f} | "
                     f"{r['measured_computed']:.0%} / {r['simulated_computed']:.0%} | {idle} |")
    if rows:
        worst = max(rows, key=lambda r: abs(r["error"]))
        mean_abs = sum(abs(r["error"]) for r in rows) / len(rows)
        lines.append(f"\nmean |error| {mean_abs:.0%}; worst {worst['error']:+.0%} ({worst['system']} at "
                     f"{worst['rate']}); {sum(abs(r['error']) > ERROR_BOUND for r in rows)} of {len(rows)} runs "
                     f"outside ±{ERROR_BOUND:.0%}")
    return "\n".join(lines)


def plot_comparison(rows: list[dict[str, Any]], path: Path) -> Path:
    """Measured (solid) and simulated (dashed) mean TTFT against the rate, per system."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for system in dict.fromkeys(r["system"] for r in rows):
        runs = [r for r in rows if r["system"] == system and r["rate"] != "unloaded"]
        rates = [float(r["rate"]) for r in runs]
        line = ax.plot(rates, [r["measured"] for r in runs], marker="o", label=f"{system} measured")[0]
        ax.plot(rates, [r["simulated"] for r in runs], marker="x", ls="--", color=line.get_color(),
                label=f"{system} simulated")
    ax.set(xlabel="request rate (req/s)", ylabel="mean TTFT (s)", title="tessera simulate vs tessera bench")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
