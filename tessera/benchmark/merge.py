"""``tessera report``: several ``tessera bench`` runs of one workload as one report.

A sweep that has to be extended (a system swept again past its crossing, with its warm-up
sent faster) leaves two or more ``bench.json`` files whose runs belong on one curve. This
module joins them: each system's measured runs from every file, its unloaded reference from
one of them, and the targets (:func:`~tessera.benchmark.report.compare`) computed once over
the union, so the combined figures come from a command instead of a hand-written script.

Files join only when what makes their rows comparable is the same: the workload, the
requests per run, the warm-up share, the output length, and each system's cluster settings.
Two files that both measured one system at one rate (or both have its unloaded reference)
are refused unless ``keep`` says which one counts: the earlier file (``first``) or the later
(``last``). Every merged row records the file it came from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError

KEEP_CHOICES = ("error", "first", "last")  # --keep: refuse a row two files have, or take the first's / last's
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
                          f"--keep last to say which one counts, or leave one file out")
    return held  # merge order already puts the file that wins first


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
