"""``tessera report``: several ``tessera bench`` runs of one workload as one report.

A sweep that has to be extended (a system swept again past its crossing, with its warm-up
sent faster) leaves two or more ``bench.json`` files whose runs belong on one curve. This
module joins them: each system's measured runs from every file, its unloaded reference from
one of them, and the targets (:func:`~tessera.benchmark.report.compare`) computed once over
the union, so the combined figures come from a command instead of a hand-written script.

Files join only when what makes their rows comparable is the same: the workload, the
requests per run, the warm-up share, the output length, and each system's cluster settings.
Two files that both measured one system at one rate (or both have its unloaded reference)
are refused unless ``keep`` says which one counts: the earlier file (``first``), the later
(``last``), or all of them pooled (``pool``): repeats of one rate on fresh clusters, whose
per-request TTFTs become one sample (:func:`pool_runs`), so a crossing interpolated between
rates rests on every repeat rather than on whichever file came last. Every merged row records
the file it came from (a pooled row, all of them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.benchmark import extras
from tessera.errors import ConfigError

# --keep: refuse a row two files have, take the first's / last's, or pool them
KEEP_CHOICES = ("error", "first", "last", "pool")
# top-level fields that must agree for two files' rows to sit on one curve
SAME = ("workload", "requests", "warmup_frac", "max_tokens")


def read_report(path: Path) -> dict[str, Any]:
    """A ``bench.json`` (or the folder holding one), checked to look like a bench report."""
    file = path / "bench.json" if path.is_dir() else path
    try:
        report = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{file} does not exist; pass a tessera bench --out folder or its bench.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file} is not a readable bench report ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("systems"), dict) or any(
            k not in report for k in SAME):
        raise ConfigError(f"{file} is not a tessera bench report (no systems, or no {', '.join(SAME)})")
    report["_source"] = str(file)
    return report


def merge_reports(reports: Sequence[dict[str, Any]], keep: str = "error") -> dict[str, Any]:
    """One report from ``reports`` (as :func:`read_report` returns them), in the order given.

    The result has the first report's top-level fields, each system's rows from all of them
    sorted by rate (each with its ``source``), and ``merged_from``: every file with its
    warm-up rate and start time. ``comparison``, ``table`` and ``plots`` are left to the caller.
    """
    if not reports:
        raise ConfigError("nothing to merge: name at least one bench report")
    if keep not in KEEP_CHOICES:
        raise ConfigError(f"--keep takes {', '.join(KEEP_CHOICES)}, got {keep!r}")
    first = reports[0]
    for other in reports[1:]:
        for k in SAME:
            if other[k] != first[k]:
                raise ConfigError(f"cannot merge {other['_source']} into {first['_source']}: their {k} differs "
                                  f"({other[k]!r} vs {first[k]!r}); only runs of one sweep's settings share a curve")
    ordered = list(reports) if keep != "last" else list(reversed(reports))
    systems: dict[str, dict[str, Any]] = {}
    for report in ordered:
        for name, sysrep in report["systems"].items():
            merged = systems.setdefault(name, {"config": sysrep.get("config"), "runs": {}, "unloaded": None})
            if sysrep.get("config") != merged["config"]:
                raise ConfigError(f"cannot merge {name} of {report['_source']}: its cluster settings "
                                  f"{sysrep.get('config')} differ from {merged['config']} in another file")
            if "unloaded" in sysrep:
                merged["unloaded"] = _pick(merged["unloaded"], sysrep["unloaded"], report, keep,
                                           f"{name}'s unloaded reference")
            for run in sysrep.get("runs", []):
                if "skipped" in run or "mean" not in run:
                    # a rate the sweep skipped (saturated) or where nothing succeeded is no measurement;
                    # it stands only where no file measured that rate
                    merged["runs"].setdefault(run["rate"], {**run, "source": report["_source"]})
                    continue
                held = merged["runs"].get(run["rate"])
                if held is not None and "mean" not in held:
                    held = None
                merged["runs"][run["rate"]] = _pick(held, run, report, keep, f"{name} at {run['rate']:g} req/s")
    out: dict[str, Any] = {k: v for k, v in first.items()
                           if k not in ("systems", "comparison", "table", "plots", "_source", "fidelity")}
    out["rates"] = sorted({r for rep in reports for r in rep.get("rates", [])})
    out["systems"] = {}
    for name, merged in systems.items():
        sysrep = {"config": merged["config"], "rates": sorted(merged["runs"]),
                  "runs": [merged["runs"][r] for r in sorted(merged["runs"])]}
        if merged["unloaded"] is not None:
            sysrep["unloaded"] = merged["unloaded"]
        out["systems"][name] = sysrep
    fidelity = next((r for r in ordered if r.get("fidelity")), None)
    if fidelity is not None:
        out["fidelity"] = {**fidelity["fidelity"], "source": fidelity["_source"]}
    out["merged_from"] = [{"source": r["_source"], "warmup_rate": r.get("warmup_rate"), "started": r.get("started"),
                           "systems": {n: [run["rate"] for run in s.get("runs", []) if "mean" in run]
                                       for n, s in r["systems"].items()}}
                          for r in reports]
    return out


def _pick(held: dict[str, Any] | None, new: dict[str, Any], report: dict[str, Any], keep: str,
          what: str) -> dict[str, Any]:
    """The row that counts when ``held`` (from an earlier file in merge order) meets ``new``."""
    tagged = {**new, "source": report["_source"]}
    if held is None:
        return tagged
    if keep == "error":
        raise ConfigError(f"{what} is in both {held['source']} and {report['_source']}; pass --keep first or "
                          f"--keep last to say which one counts, --keep pool to pool them, or leave one file out")
    if keep == "pool":
        return pool_runs([held, tagged], what)
    return held  # merge order already puts the file that wins first


def pool_runs(runs: Sequence[dict[str, Any]], what: str = "the runs") -> dict[str, Any]:
    """One row from repeated measurements of one system at one rate (each a ``summarize`` row
    with its ``source``; a row pooled before may be one of them).

    Exact where the rows allow it: the TTFT mean and percentiles over every request's TTFT
    together, the request and coalesced-unit counts summed, the reuse efficiency over all
    reusable unit tokens, the computed share over all prompt tokens. The unit tokens' tier
    shares (local, remote, computed, coalesced) and the throughput are weighted by each row's
    successful requests: the rows keep neither their unit-token totals nor a common time span,
    so these two are averages of the repeats, not one measurement. Fields other than these are
    dropped unless every row has the same value.
    """
    # a row where nothing succeeded has no TTFTs to give, and needs none
    missing = [r.get("source", "?") for r in runs if "ttfts" not in r and r.get("ok", 0) > 0]
    if missing:
        raise ConfigError(f"cannot pool {what}: {', '.join(missing)} kept no per-request TTFTs (a report "
                          f"from before they were recorded); pass --keep first or --keep last instead")
    ttfts = np.array([t for r in runs for t in r.get("ttfts", [])], dtype=np.float64)
    ok = [int(r["ok"]) for r in runs]
    n_ok = max(sum(ok), 1)
    prompt = [r.get("mean_prompt_tokens", 0.0) * k for r, k in zip(runs, ok, strict=True)]
    reusable = [r.get("reusable_unit_tokens") or 0 for r in runs]
    sources = [s for r in runs for s in r.get("pooled", [r.get("source", "?")])]  # a pooled row brings its own
    out: dict[str, Any] = {k: v for k, v in runs[0].items() if all(r.get(k) == v for r in runs[1:])}
    out.update({
        "requests": sum(int(r["requests"]) for r in runs),
        "ok": sum(ok),
        "failed": sum(int(r["failed"]) for r in runs),
        "errors": sorted({e for r in runs for e in r.get("errors", [])})[:5],
        "throughput": sum(r["throughput"] * k for r, k in zip(runs, ok, strict=True)) / n_ok,
        "hit_rate": {tier: sum(r["hit_rate"].get(tier, 0.0) * k for r, k in zip(runs, ok, strict=True)) / n_ok
                     for tier in runs[0]["hit_rate"]},
        "mean_prompt_tokens": sum(prompt) / n_ok,
        "reusable_unit_tokens": sum(reusable),
        "reuse_efficiency": (sum((r.get("reuse_efficiency") or 0.0) * n for r, n in zip(runs, reusable, strict=True))
                             / sum(reusable)) if sum(reusable) else None,
        "source": " + ".join(sources),
        "pooled": sources,
    })
    if any("coalesced_units" in r for r in runs):  # absent from reports written before it was counted
        out["coalesced_units"] = sum(int(r.get("coalesced_units", 0)) for r in runs)
    if "computed_share_of_prompt" in runs[0]:
        out["computed_share_of_prompt"] = sum(r.get("computed_share_of_prompt", 0.0) * p
                                              for r, p in zip(runs, prompt, strict=True)) / max(sum(prompt), 1e-9)
    for k in ("mean", "p50", "p90", "p99", "ttfts"):
        out.pop(k, None)
    if len(ttfts):
        out.update({"mean": float(ttfts.mean()), "p50": float(np.percentile(ttfts, 50)),
                    "p90": float(np.percentile(ttfts, 90)), "p99": float(np.percentile(ttfts, 99)),
                    "ttfts": [float(x) for x in ttfts]})
    return out


def run_report(paths: Sequence[Path], out: Path | None, keep: str = "error") -> dict[str, Any]:
    """Read, merge and print ``paths``' reports; with ``out``, write its bench.json and plots there."""
    from tessera.benchmark.options import say
    from tessera.benchmark.report import compare, format_report, plot, table

    report = merge_reports([read_report(p) for p in paths], keep)
    report["comparison"] = compare(report)
    report["table"] = table(report)
    report["plots"] = []
    if out is not None:
        if any((p if p.is_dir() else p.parent).resolve() == out.resolve() for p in paths):
            raise ConfigError(f"--out {out} is one of the merged runs' folders; write the merge to a folder of its own")
        extras.require("tessera report --out", "matplotlib")
        out.mkdir(parents=True, exist_ok=True)
        report["plots"] = [str(p) for p in plot(report, out)]
        (out / "bench.json").write_text(json.dumps(report, indent=1))
    for m in report["merged_from"]:
        runs = "; ".join(f"{n} {', '.join(f'{r:g}' for r in rates) or '-'}" for n, rates in m["systems"].items())
        warm = f", warm-up at {m['warmup_rate']:g} req/s" if m.get("warmup_rate") else ""
        say(f"from {m['source']} (started {m.get('started') or '?'}{warm}): {runs}", err=True)
    for line in format_report(report):
        say(line)
    if report.get("fidelity"):
        from tessera.benchmark.verify import format_fidelity

        say(format_fidelity(report["fidelity"]) + f" (from {report['fidelity']['source']})")
    return report
