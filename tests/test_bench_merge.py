"""``tessera report``: a sweep and its extensions as one report (their combined figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.cluster import child_env

from tessera.benchmark.merge import merge_reports, read_report
from tessera.errors import ConfigError


def _run(rate: float, mean: float, **extra: Any) -> dict[str, Any]:
    return {"rate": rate, "requests": 10, "ok": 10, "failed": 0, "throughput": rate, "mean": mean, "p50": mean,
            "p90": mean, "p99": mean, "hit_rate": {"prefix": 0, "local": 0, "remote": 0, "computed": 0},
            "reuse_efficiency": None, **extra}


def _report(systems: dict[str, dict[str, Any]], *, warmup_rate: float | None = None,
            requests: int = 900, started: str = "2026-12-03 10:00:00") -> dict[str, Any]:
    return {"workload": "locomo", "workload_notes": {}, "requests": requests, "warmup_frac": 0.889,
            "warmup_rate": warmup_rate, "max_tokens": 1, "rates": sorted({r["rate"] for s in systems.values()
                                                                            for r in s["runs"]}),
            "systems": systems, "started": started}


def _sys(runs: list[dict[str, Any]], unloaded: float | list[float] | None = None,
         mode: str = "compose") -> dict[str, Any]:
    """A system's sweep; ``unloaded``: its reference's mean, or its requests' TTFTs (a list)."""
    out: dict[str, Any] = {"config": {"mode": mode}, "rates": [r["rate"] for r in runs], "runs": runs}
    if isinstance(unloaded, list):
        out["unloaded"] = _measured(0.0, unloaded)
    elif unloaded is not None:
        out["unloaded"] = _run(0.0, unloaded)
    return out


def _write(folder: Path, report: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    (folder / "bench.json").write_text(json.dumps(report))
    return folder


def _tagged(report: dict[str, Any], source: str) -> dict[str, Any]:
    return {**report, "_source": source}


def test_a_sweep_and_its_extension_join_into_one_curve_per_system() -> None:
    """Each system's runs from both files, sorted by rate and tagged with their file; the first
    file's unloaded references; the targets computed over the union find the knee only the
    extension's high prefix rate reaches."""
    main = _tagged(_report({"prefix": _sys([_run(2, 0.6), _run(3, 1.2)], unloaded=0.5, mode="prefix"),
                            "tessera": _sys([_run(3, 0.4)], unloaded=0.3)}, warmup_rate=2.5), "main")
    ext = _tagged(_report({"prefix": _sys([_run(4, 2.4)], mode="prefix"),
                           "tessera": _sys([_run(4, 0.5), _run(5, 0.7)])}, warmup_rate=3), "ext")
    merged = merge_reports([main, ext])
    assert [r["rate"] for r in merged["systems"]["prefix"]["runs"]] == [2, 3, 4]
    assert [r["source"] for r in merged["systems"]["prefix"]["runs"]] == ["main", "main", "ext"]
    assert merged["systems"]["tessera"]["unloaded"]["mean"] == 0.3
    assert merged["systems"]["tessera"]["rates"] == [3, 4, 5]
    assert [(m["source"], m["warmup_rate"], m["systems"]["tessera"]) for m in merged["merged_from"]] == [
        ("main", 2.5, [3]), ("ext", 3, [4, 5])]

    from tessera.benchmark.report import compare

    c = compare(merged)
    assert c["rate_baseline_at_3x_unloaded"] == pytest.approx(3.25)  # 1.5 s between 1.2 at 3 and 2.4 at 4
    assert c["ttft_reduction_at_knee"] == pytest.approx(1.5 / 0.425)


def test_two_files_measuring_one_rate_are_refused_unless_keep_says_which_counts() -> None:
    a = _tagged(_report({"prefix": _sys([_run(3, 1.0)], unloaded=0.5, mode="prefix")}), "a")
    b = _tagged(_report({"prefix": _sys([_run(3, 2.0), _run(4, 3.0)], unloaded=0.6, mode="prefix")}), "b")
    with pytest.raises(ConfigError, match=r"prefix's unloaded reference is in both a and b; pass --keep"):
        merge_reports([a, b])
    first = merge_reports([a, b], keep="first")["systems"]["prefix"]
    last = merge_reports([a, b], keep="last")["systems"]["prefix"]
    assert [(r["rate"], r["mean"], r["source"]) for r in first["runs"]] == [(3, 1.0, "a"), (4, 3.0, "b")]
    assert [(r["rate"], r["mean"], r["source"]) for r in last["runs"]] == [(3, 2.0, "b"), (4, 3.0, "b")]
    assert (first["unloaded"]["mean"], last["unloaded"]["mean"]) == (0.5, 0.6)
    with pytest.raises(ConfigError, match="--keep takes error, first, last"):
        merge_reports([a, b], keep="newest")


def _measured(rate: float, ttfts: list[float], **extra: Any) -> dict[str, Any]:
    """A row as summarize writes it: its per-request TTFTs and the statistics over them."""
    arr = np.array(ttfts)
    return _run(rate, float(arr.mean()), requests=len(ttfts) + 1, ok=len(ttfts), failed=1,
                p50=float(np.percentile(arr, 50)), p90=float(np.percentile(arr, 90)),
                p99=float(np.percentile(arr, 99)), ttfts=ttfts, **extra)


def test_repeats_of_one_rate_pool_into_one_row_over_all_their_requests() -> None:
    """--keep pool: the TTFT statistics over every repeat's requests together, counts summed,
    reuse efficiency over all reusable tokens, tier shares and throughput weighted by
    successful requests; the crossing is interpolated on the pooled means."""
    a = _tagged(_report({"tessera": _sys([_measured(4, [0.2, 0.4], reuse_efficiency=1.0, reusable_unit_tokens=100,
                                                    mean_prompt_tokens=300.0, computed_share_of_prompt=0.5,
                                                    hit_rate={"local": 1.0, "remote": 0.0}, throughput=4.0,
                                                    errors=["HTTP 503"], coalesced_units=2),
                                          _measured(5, [0.9, 1.1])], unloaded=[0.25])}), "a")
    b = _tagged(_report({"tessera": _sys([_measured(4, [0.6, 0.8, 1.0, 1.2], reuse_efficiency=0.5,
                                                    reusable_unit_tokens=300, mean_prompt_tokens=150.0,
                                                    computed_share_of_prompt=0.0,
                                                    hit_rate={"local": 0.25, "remote": 0.75}, throughput=3.0,
                                                    errors=["timeout"], coalesced_units=3)],
                                         unloaded=[0.35])}), "b")
    c = _tagged(_report({"tessera": _sys([_measured(4, [0.7, 0.7])], unloaded=[0.35])}), "c")
    merged = merge_reports([a, b, c], keep="pool")["systems"]["tessera"]
    four = merged["runs"][0]
    assert four["rate"] == 4 and four["ttfts"] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 0.7, 0.7]
    assert four["mean"] == pytest.approx(5.6 / 8)
    assert four["p50"] == pytest.approx(0.7) and four["p99"] == pytest.approx(np.percentile(four["ttfts"], 99))
    assert (four["requests"], four["ok"], four["failed"], four["coalesced_units"]) == (11, 8, 3, 2 + 3)
    assert four["errors"] == ["HTTP 503", "timeout"]
    assert four["reuse_efficiency"] == pytest.approx((100 * 1.0 + 300 * 0.5) / 400)  # c had no reusable tokens
    assert four["computed_share_of_prompt"] == pytest.approx(0.5 * 600 / (600 + 600 + 0))
    assert four["hit_rate"]["local"] == pytest.approx((2 * 1.0 + 4 * 0.25 + 2 * 0) / 8)
    assert four["throughput"] == pytest.approx((2 * 4.0 + 4 * 3.0 + 2 * 4) / 8)
    assert four["pooled"] == ["a", "b", "c"] and four["source"] == "a + b + c"
    assert merged["runs"][1]["source"] == "a" and "pooled" not in merged["runs"][1]
    assert merged["unloaded"]["mean"] == pytest.approx(0.95 / 3) and merged["unloaded"]["pooled"] == ["a", "b", "c"]

    from tessera.benchmark.report import compare

    both = merge_reports([_tagged(_report({"prefix": _sys([_measured(2, [0.8]), _measured(3, [3.0])],
                                                           unloaded=0.5, mode="prefix")}), "p"), a, c],
                         keep="pool")
    # tessera's bound: 2 x 0.3 s (a's and c's unloaded pooled) = 0.6 s, crossed between the
    # pooled 0.5 s at 4 req/s (a's and c's four requests) and a's 1.0 s at 5
    assert compare(both)["system_sustained_rate"] == pytest.approx(4.2)


def test_pooling_needs_each_rows_requests() -> None:
    """A row without its per-request TTFTs (rows written before they were kept) cannot be pooled."""
    a = _tagged(_report({"prefix": _sys([_run(3, 1.0)], mode="prefix")}), "a")
    b = _tagged(_report({"prefix": _sys([_measured(3, [2.0])], mode="prefix")}), "b")
    with pytest.raises(ConfigError, match="cannot pool prefix at 3 req/s: a kept no per-request TTFTs"):
        merge_reports([a, b], keep="pool")


def test_a_skipped_rate_gives_way_to_a_measured_one() -> None:
    """A rate one sweep skipped as saturated is no measurement: another file's run there counts."""
    a = _tagged(_report({"prefix": _sys([_run(3, 1.0), {"rate": 4, "requests": 0, "ok": 0,
                                                        "skipped": "saturated at 3"}], mode="prefix")}), "a")
    b = _tagged(_report({"prefix": _sys([_run(4, 3.0)], mode="prefix")}), "b")
    runs = merge_reports([a, b])["systems"]["prefix"]["runs"]
    assert [(r["rate"], r.get("mean"), r["source"]) for r in runs] == [(3, 1.0, "a"), (4, 3.0, "b")]
    alone = merge_reports([a])["systems"]["prefix"]["runs"]
    assert alone[1]["skipped"] == "saturated at 3"


def test_runs_of_different_settings_do_not_merge() -> None:
    """Different requests per run, or a system on other cluster settings, put rows on another curve."""
    a = _tagged(_report({"tessera": _sys([_run(3, 0.4)])}), "a")
    with pytest.raises(ConfigError, match=r"their requests differs \(600 vs 900\)"):
        merge_reports([a, _tagged(_report({"tessera": _sys([_run(4, 0.5)])}, requests=600), "b")])
    with pytest.raises(ConfigError, match="cluster settings"):
        merge_reports([a, _tagged(_report({"tessera": _sys([_run(4, 0.5)], mode="prefix")}), "b")])
    with pytest.raises(ConfigError, match="nothing to merge"):
        merge_reports([])


def test_read_report_names_what_is_wrong_with_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist; pass a tessera bench --out folder"):
        read_report(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not a readable bench report"):
        read_report(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"systems": {}}))
    with pytest.raises(ConfigError, match="is not a tessera bench report"):
        read_report(tmp_path / "other.json")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tessera", *args], capture_output=True, text=True,
                          env=child_env(), timeout=120)


@pytest.mark.integration
def test_tessera_report_merges_runs_writes_the_merged_report_and_refuses_bad_input(tmp_path: Path) -> None:
    """The command docs/bench/locomo.md runs on its LoCoMo sweep: the table, the targets over the union
    (and the knee line when prefix never reached 3x), the merged bench.json and plots."""
    main = _write(tmp_path / "main", _report(
        {"prefix": _sys([_run(2, 0.6), _run(3, 1.0)], unloaded=0.5, mode="prefix"),
         "tessera": _sys([_run(3, 0.4)], unloaded=0.3)}, warmup_rate=2.5))
    ext = _write(tmp_path / "ext", _report({"tessera": _sys([_run(4, 0.5), _run(6, 0.7)])}, warmup_rate=4))
    out = _cli("report", str(main), str(ext / "bench.json"), "--out", str(tmp_path / "merged"))
    assert out.returncode == 0, out.stderr
    assert f"from {main / 'bench.json'} (started 2026-12-03 10:00:00, warm-up at 2.5 req/s): prefix 2, 3; " \
           "tessera 3" in out.stderr
    assert "| tessera | 6 | 0.700 |" in out.stdout
    # prefix tops out at 1.0 s = 2x its unloaded 0.5 s: no knee, said as such
    assert "not reached by 3 req/s, prefix's highest rate (1.00s there, 2.0x its unloaded); tessera 0.40s " \
           "there -> 2.50x lower; no knee figure" in out.stdout
    # prefix crosses its 1.0 s bound at 3 req/s; tessera's 0.6 s bound between 4 and 6 req/s
    assert "prefix 3.00, tessera 5.00 req/s -> 1.67x (target >= 2x)" in out.stdout
    merged = json.loads((tmp_path / "merged" / "bench.json").read_text())
    assert merged["comparison"]["system_sustained_rate"] == pytest.approx(5.0)
    assert (tmp_path / "merged" / "ttft_vs_rate.png").stat().st_size > 0

    again = _cli("report", str(main), str(main))
    assert again.returncode == 2 and "is in both" in again.stderr and "--keep" in again.stderr
    pooled = _cli("report", str(main), str(main), "--keep", "pool")  # these rows kept no per-request TTFTs
    assert pooled.returncode == 2 and "kept no per-request TTFTs" in pooled.stderr and "Traceback" not in pooled.stderr
    r1 = _write(tmp_path / "r1", _report({"tessera": _sys([_measured(4, [0.2, 0.4])], unloaded=[0.3])}))
    r2 = _write(tmp_path / "r2", _report({"tessera": _sys([_measured(4, [0.6, 0.8])], unloaded=[0.2])}))
    both = _cli("report", str(r1), str(r2), "--keep", "pool")
    assert both.returncode == 0, both.stderr
    assert "| tessera | unloaded | 0.250 |" in both.stdout and "| tessera | 4 | 0.500 |" in both.stdout
    assert "| 4/6 |" in both.stdout  # two repeats of 2 ok / 3 sent each
    into = _cli("report", str(main), "--out", str(main))
    assert into.returncode == 2 and "write the merge to a folder of its own" in into.stderr
    missing = _cli("report", str(tmp_path / "none"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    bad_keep = _cli("report", str(main), "--keep", "newest")
    assert bad_keep.returncode == 2 and "--keep takes error, first, last" in bad_keep.stderr
