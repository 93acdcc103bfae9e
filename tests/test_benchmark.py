"""Bench workloads, summaries and the target comparison (pure logic), and the analyze CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cluster import child_env
from helpers.http import serving

from tessera.benchmark.client import Result
from tessera.benchmark.report import compare, summarize, sustained_rate, table
from tessera.benchmark.workloads import DATA_DIR, Zipf, locomo_workload, rag_workload, synthetic_workload


def test_zipf_prefers_low_ranks_over_a_fixed_permutation() -> None:
    """Zipf draws favour the permutation's first rank by far; draw_distinct never repeats."""
    z = Zipf(50, 1.2, random.Random(1))
    draws = z.draw(4000)
    top = z.order[0]
    assert draws.count(top) > draws.count(z.order[-1]) * 10
    picked = z.draw_distinct(5)
    assert len(set(picked)) == 5


def test_synthetic_workload_is_deterministic_and_recurs_out_of_order() -> None:
    """One seed gives one workload, and records recur at positions other than their first."""
    a, b = synthetic_workload(30, seed=4), synthetic_workload(30, seed=4)
    assert [r.context_units for r in a.requests] == [r.context_units for r in b.requests]
    seen: set[str] = set()
    moved = 0
    for r in a.requests:
        moved += any(u in seen for u in r.context_units[1:])
        seen.update(r.context_units)
    assert moved > 0  # some records come back at a later position than first


@pytest.mark.skipif(not (DATA_DIR / "locomo" / "locomo10.json").is_file(), reason="../shared/data is absent")
def test_locomo_scopes_are_conversations_and_questions_keep_their_order() -> None:
    """LoCoMo: one scope per conversation, categories 1-4 with answers, top-6 retrieval."""
    w = locomo_workload(0, conversations=2)
    scopes = {u.scope for u in w.corpus}
    assert scopes == {r.scope for r in w.requests} and len(scopes) == 2
    assert all(r.category in (1, 2, 3, 4) and r.answers for r in w.requests)
    assert all(r.retrieval is not None and r.retrieval["top_k"] == 6 for r in w.requests)


@pytest.mark.skipif(not (DATA_DIR / "musique" / "musique_s.json").is_file(), reason="../shared/data is absent")
def test_rag_corpus_is_deduplicated_passages() -> None:
    """MuSiQue passages appear once in the corpus, truncated to unit_words."""
    w = rag_workload(10, unit_words=20)
    texts = [u.text for u in w.corpus]
    assert len(texts) == len(set(texts)) and all(len(t.split()) <= 20 for t in texts)


def results(ttfts: list[float]) -> list[Result]:
    out = []
    for i, t in enumerate(ttfts):
        r = Result(i, float(i), ttft=t, latency=t, status=200,
                   usage={"prompt_tokens": 10, "tessera": {"local_tokens": 3, "computed_unit_tokens": 1}})
        out.append(r)
    return out


def test_summary_excludes_the_warm_up_share() -> None:
    """The summary measures only the requests after the warm-up share, hit rates included."""
    s = summarize(results([9.0, 9.0, 1.0, 3.0]), 0.5, 1.0)
    assert s["requests"] == 2 and s["mean"] == pytest.approx(2.0)
    assert s["hit_rate"]["local"] == pytest.approx(0.75)


def _served(index: int, *units: tuple[str, int, str]) -> Result:
    """A reply whose per-unit receipt lists (unit id, tokens, source)."""
    per_unit = [{"unit_id": u, "tokens": n, "source": src, "recomputed_tokens": 0} for u, n, src in units]
    return Result(index, float(index), ttft=0.1, latency=0.2, status=200,
                  usage={"prompt_tokens": 100, "tessera": {"receipt": {"per_unit": per_unit}}})


def test_reuse_efficiency_is_cached_unit_tokens_over_those_an_earlier_request_already_carried() -> None:
    """Next to each TTFT, how close the serving came to what the trace allows. Units
    first seen in the warm-up count as reusable in the window; a unit's first appearance is
    not reusable; a reusable unit computed again counts against the serving."""
    results = [
        _served(0, ("a", 100, "computed")),                       # warm-up: a seen
        _served(1, ("a", 100, "local"), ("b", 50, "computed")),   # a reusable and reused; b new
        _served(2, ("b", 50, "remote"), ("a", 100, "computed")),  # both reusable; a computed again
        Result(3, 3.0, status=503, error="no node"),              # failed: adds nothing
    ]
    summary = summarize(results, 0.25, 1.0)
    assert summary["reusable_unit_tokens"] == 250
    assert summary["reuse_efficiency"] == pytest.approx(150 / 250)
    assert summarize(results[:1], 0.0, 1.0)["reuse_efficiency"] is None  # nothing was reusable


def test_a_coalesced_unit_is_reused_not_computed_in_the_summary() -> None:
    """Two requests share one prefill of unit a: the one that ran it computed it, the one that
    joined it did not, so the computed shares count the forward pass once and the joined unit
    counts as reused (the engine did not compute it again for that request)."""
    def reply(index: int, source: str, tiers: dict[str, int]) -> Result:
        r = _served(index, ("a", 40, source))
        r.usage = {"prompt_tokens": 50, "tessera": {**tiers, "recomputed_tokens": 10, **r.usage["tessera"]}}
        return r

    ran = reply(0, "computed", {"computed_unit_tokens": 40, "computed_units": 1})
    joined = reply(1, "coalesced", {"coalesced_unit_tokens": 40, "coalesced_units": 1})
    s = summarize([ran, joined], 0.0, 1.0)
    assert s["hit_rate"]["computed"] == pytest.approx(0.5) and s["hit_rate"]["coalesced"] == pytest.approx(0.5)
    assert s["computed_share_of_prompt"] == pytest.approx((10 + 40 + 10) / 100)
    assert s["coalesced_units"] == 1
    assert (s["reusable_unit_tokens"], s["reuse_efficiency"]) == (40, pytest.approx(1.0))
    row = table({"systems": {"tessera": {"runs": [s]}}}).splitlines()
    assert "coalesced units" in row[0] and "| 0%/0%/50% | 1 | - | 100% |" in row[2]


def test_the_exact_unit_share_is_the_prefix_hits_unit_tokens_over_all_from_the_receipts() -> None:
    """Unit tokens inside the exact-prefix hit (receipt source ``prefix``) over every unit token
    of the measured replies; a reply without a receipt (another server) adds nothing."""
    def reply(index: int, prefix: int, local: int) -> Result:
        r = _served(index, ("a", prefix, "prefix"), ("b", local, "local"))
        r.usage["tessera"]["receipt"]["unit_tokens"] = {"prefix": prefix, "local": local, "computed": 0}
        return r

    other = Result(2, 2.0, ttft=0.1, latency=0.2, status=200, usage={"prompt_tokens": 100})
    s = summarize([reply(0, 30, 70), reply(1, 60, 40), other], 0.0, 1.0)
    assert s["exact_unit_share"] == pytest.approx(90 / 200)
    assert summarize([other], 0.0, 1.0)["exact_unit_share"] is None
    assert table({"systems": {"tessera": {"runs": [s]}}}).splitlines()[2].endswith("| 45% |")


def test_the_table_shows_each_runs_share_of_the_peak_and_the_nodes_failed_writebacks() -> None:
    """Goodput past the peak and lost writebacks are columns, not something to dig out of logs."""
    def run(rate: float, throughput: float, failed: float) -> dict[str, object]:
        s = summarize([_served(0, ("a", 40, "local"))], 0.0, rate)
        return {**s, "throughput": throughput, "nodes": {"writebacks_failed": failed}}

    rows = table({"systems": {"tessera": {"runs": [run(1, 1.0, 0), run(2, 2.0, 0), run(4, 1.5, 33)]}}}).splitlines()
    assert "throughput (of peak)" in rows[0] and "failed writebacks" in rows[0]
    assert "| 2.00 (100%) |" in rows[3] and "| 1.50 (75%) |" in rows[4]
    assert rows[4].split("|")[-4].strip() == "33" and rows[2].split("|")[-4].strip() == "0"


def test_sustained_rate_interpolates_the_crossing() -> None:
    """The sustained rate interpolates where mean TTFT crosses the bound, clamped to the swept rates."""
    assert sustained_rate([1, 2, 3], [1.0, 1.5, 3.0], 2.0) == pytest.approx(2 + 1 / 3)
    assert sustained_rate([1, 2], [1.0, 1.2], 2.0) == 2
    assert sustained_rate([1, 2], [5.0, 6.0], 2.0) == 1


def test_compare_computes_both_targets() -> None:
    """compare finds the baseline's 3x-unloaded knee, the TTFT ratio there and both sustained rates."""
    def sysrep(unloaded: float, means: list[float]) -> dict:
        return {"unloaded": {"mean": unloaded},
                "runs": [{"rate": r, "mean": m} for r, m in zip([1, 2, 3], means, strict=True)]}

    report = {"systems": {"prefix": sysrep(1.0, [1.5, 3.0, 9.0]), "tessera": sysrep(0.5, [0.5, 0.6, 0.9])}}
    c = compare(report)
    assert c["rate_baseline_at_3x_unloaded"] == pytest.approx(2.0)
    assert c["ttft_reduction_at_knee"] == pytest.approx(3.0 / 0.6)
    assert c["baseline_sustained_rate"] == pytest.approx(1 + 0.5 / 1.5)
    assert c["system_sustained_rate"] == 3


def test_bench_systems_queue_instead_of_refusing_or_timing_out() -> None:
    """Regression: past saturation the 60 s first-token deadline ended prefix caching's queued
    requests with 503s (46 of 200 at 0.75 req/s); the bench measures the wait instead."""
    from tessera.benchmark.client import BENCH_CLIENT_TIMEOUT_S
    from tessera.benchmark.runner import system_config
    from tessera.config_file import load_config

    base = load_config()  # the embedded default cluster
    for system in ("prefix", "C+S", "tessera"):
        control = system_config(base, system).control
        assert control.max_queue_wait_s == 0.0
        assert control.first_token_timeout_s >= BENCH_CLIENT_TIMEOUT_S
        assert control.idle_timeout_s == base.control.idle_timeout_s  # a stalled stream still ends


def test_the_summary_states_each_workloads_own_targets() -> None:
    """Synthetic and LoCoMo print their issues' targets; a workload without one prints none."""
    from tessera.benchmark.report import format_report

    c = {"rate_baseline_at_3x_unloaded": 1.0, "ttft_reduction_at_knee": 2.0, "sustained_rate_ratio": 1.5}
    lines = {w: "\n".join(format_report({"table": "", "workload": w, "comparison": c}))
             for w in ("synthetic", "locomo", "rag")}
    assert "2.00x lower (target >= 4x)" in lines["synthetic"] and "1.50x (target >= 3x)" in lines["synthetic"]
    assert "2.00x lower (target >= 2.5x)" in lines["locomo"] and "1.50x (target >= 2x)" in lines["locomo"]
    assert "target" not in lines["rag"]


def test_compare_anchors_a_high_rate_sweep_at_the_unloaded_reference() -> None:
    """A system swept only above the knee is interpolated from its unloaded reference at rate 0."""
    # tessera swept only above prefix's knee: its TTFT there comes from (0, unloaded)
    report = {"systems": {
        "prefix": {"unloaded": {"mean": 1.0}, "runs": [{"rate": 1, "mean": 1.5}, {"rate": 2, "mean": 4.0}]},
        "tessera": {"unloaded": {"mean": 0.5}, "runs": [{"rate": 2, "mean": 0.8}, {"rate": 3, "mean": 1.2}]},
    }}
    c = compare(report)
    assert c["rate_baseline_at_3x_unloaded"] == pytest.approx(1.6)
    assert c["system_mean_at_knee"] == pytest.approx(0.5 + 0.3 * 1.6 / 2)
    assert c["system_sustained_rate"] == pytest.approx(2.5)
    assert c["sustained_rate_ratio"] == pytest.approx(2.5 / (1 + 0.5 / 2.5))


def test_saturation_skips_only_past_the_factor() -> None:
    """Higher rates are skipped only once the mean passes the factor times the unloaded TTFT."""
    from tessera.benchmark.report import table
    from tessera.benchmark.runner import _saturated

    sysrep = {"unloaded": {"mean": 2.0}, "runs": [{"rate": 1, "mean": 19.0}]}
    assert not _saturated(sysrep, {"mean": 19.0}, 10.0)
    assert _saturated(sysrep, {"mean": 21.0}, 10.0)
    assert not _saturated(sysrep, {"mean": 210.0}, 0.0)  # 0: never skip
    assert not _saturated(sysrep, {"ok": 0}, 10.0)  # every request failed: no mean, keep going
    # no serial reference: the first measured rate stands in
    assert _saturated({"runs": [{"rate": 1, "mean": 1.0}]}, {"mean": 10.5}, 10.0)
    rows = table({"systems": {"prefix": {"runs": [{"rate": 3, "requests": 0, "ok": 0, "skipped": "saturated at 2"}]}}})
    assert "| prefix | 3 | skipped (saturated at 2) |" in rows


async def test_drained_warm_up_finishes_before_the_first_measured_request() -> None:
    """With the drain, every warm-up request ends before the first measured one starts."""
    import asyncio
    import time

    from aiohttp import web

    from tessera.benchmark.runner import BenchOptions, run_phases

    spans: list[tuple[float, float]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        await request.read()
        await asyncio.sleep(0.3)  # slower than the arrivals: without the drain, the phases overlap
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        spans.append((t0, time.perf_counter()))
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(app) as port:
        load = synthetic_workload(8, n_units=10).requests
        opts = BenchOptions(systems=["tessera"], rates=[50.0], progress=False)
        results = await run_phases(f"http://127.0.0.1:{port}", load, 50.0, opts, drain=True)
        assert [r.index for r in results] == list(range(8)) and all(r.ok for r in results)
        spans.sort()
        warm_end = max(end for _, end in spans[:4])
        assert all(start >= warm_end for start, _ in spans[4:])
        spans.clear()
        await run_phases(f"http://127.0.0.1:{port}", load, 50.0, opts, drain=False)
        spans.sort()
        assert max(end for _, end in spans[:4]) > min(start for start, _ in spans[4:])  # the test can fail


class _PhaseRecorder:
    """Stands in for the load generator: records each phase's size, rate and arrivals, sends nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, float, list[float] | None]] = []

    async def __call__(self, url: str, requests: list, rate: float, **kw: object) -> list[Result]:
        arrivals = kw.get("arrivals")
        self.calls.append((len(requests), rate, None if arrivals is None else list(arrivals)))  # type: ignore[call-overload]
        return [Result(i, float(i), ttft=0.1, latency=0.1, status=200) for i in range(len(requests))]


async def test_warm_up_rate_sends_only_the_warm_up_share_at_its_own_rate(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """A warm-up long enough that the measured window's units were seen costs minutes
    at a low run rate; --warmup-rate sends the warm-up share (also the unloaded reference's) at
    its own rate, and the measured share at the run's rate, or its recorded times."""
    import dataclasses

    from tessera.benchmark import runner
    from tessera.benchmark.endpoints import Endpoint
    from tessera.benchmark.runner import BenchOptions, run_bench, run_phases
    from tessera.benchmark.targets import RunningEndpoint
    from tessera.config_file import load_config

    sent = _PhaseRecorder()
    monkeypatch.setattr(runner, "run_load", sent)
    load = synthetic_workload(10, n_units=10).requests
    opts = BenchOptions(systems=["tessera"], rates=[1.0], progress=False, warmup_frac=0.8, warmup_rate=5.0)
    results = await run_phases("http://fake", load, 1.0, opts, drain=True)
    assert sent.calls == [(8, 5.0, None), (2, 1.0, None)]
    assert [r.index for r in results] == list(range(10))
    sent.calls.clear()
    await run_phases("http://fake", load, 1.0, dataclasses.replace(opts, warmup_rate=0.0), drain=True)
    assert sent.calls == [(8, 1.0, None), (2, 1.0, None)]  # the default: the run's own rate
    sent.calls.clear()
    recorded = dataclasses.replace(opts, arrivals=[float(i) for i in range(10)])
    await run_phases("http://fake", load, 1.0, recorded, drain=True)
    assert sent.calls == [(8, 5.0, None), (2, 1.0, [0.0, 1.0])]  # the measured share keeps its spacing

    sent.calls.clear()
    wl = synthetic_workload(10, n_units=10)
    sweep = dataclasses.replace(opts, rates=[1.0, 2.0], unloaded_requests=2, out_dir=tmp_path)
    target = RunningEndpoint(Endpoint("tessera", "http://fake", "tessera"))  # opens no connection itself
    await run_bench(load_config(), wl, sweep, {"tessera": target})
    # unloaded reference: warm-up at 5 req/s, then 2 one at a time; then each rate's run
    assert sent.calls == [(8, 5.0, None), (2, 0.0, None), (8, 5.0, None), (2, 1.0, None), (8, 5.0, None),
                          (2, 2.0, None)]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tessera", *args], capture_output=True, text=True, env=child_env(),
                          timeout=120)


@pytest.mark.integration
def test_analyze_cli_prints_the_classification(tmp_path: Path) -> None:
    """`tessera analyze` classifies a trace's unit tokens into repeat / prefix-covered / new."""
    trace = tmp_path / "t.jsonl"
    lines = [{"stream": "s", "tokens": [9, 1, 2, 3], "units": [[1, 4]]},
             {"stream": "s", "tokens": [8, 1, 2, 3], "units": [[1, 4]]}]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = run_cli("analyze", str(trace))
    assert out.returncode == 0, out.stderr
    assert "non-prefix repeat 50.0%" in out.stdout and "new 50.0%" in out.stdout
    # prefix caching computes all 8 tokens; reusing the repeat saves its 3, epic recomputes 1 of them
    assert "best-case prefill saving over prefix caching: 37.5% (with epic k=16 f=0.25 inline=0.75: 25.0%)" \
        in out.stdout


@pytest.mark.integration
def test_cli_errors_are_clear_and_non_zero(tmp_path: Path) -> None:
    """Bad configs, paths and options exit with code 2 and a message naming the problem."""
    bad = tmp_path / "bad.toml"
    bad.write_text("block_tokens = 0\n[[generation]]\nname = 'g'\n")
    out = run_cli("run", "--role", "generation", "--config", str(bad))
    assert out.returncode == 2 and "block_tokens = 0" in out.stderr
    out = run_cli("analyze", str(tmp_path / "missing.jsonl"))
    assert out.returncode == 2 and "does not exist" in out.stderr
    out = run_cli("bench", "--systems", "vllm")
    assert out.returncode == 2 and "unknown system" in out.stderr
    out = run_cli("bench", "--workload", "synthetic", "--rates-for", "C+S=1,2")
    assert out.returncode == 2 and "expected SYSTEM=R1,R2" in out.stderr and "prefix, tessera" in out.stderr
    out = run_cli("run", "--help")
    assert out.returncode == 0 and "--role" in out.stdout


def test_plot_writes_rate_curve_and_cdf(tmp_path: Path) -> None:
    """plot writes the TTFT-vs-rate curve and the TTFT CDF as PNG files."""
    from tessera.benchmark.report import plot

    report = {"workload": "synthetic", "systems": {
        "prefix": {"runs": [{"rate": 0.5, "mean": 1.0, "ttfts": [0.9, 1.1]},
                            {"rate": 1.0, "mean": 3.0, "ttfts": [2.0, 4.0]}]},
        "tessera": {"runs": [{"rate": 0.5, "mean": 0.3, "ttfts": [0.2, 0.4]},
                             {"rate": 1.0, "mean": 0.4, "ttfts": [0.3, 0.5]}]},
    }}
    paths = plot(report, tmp_path, cdf_rate=1.0)
    assert [p.name for p in paths] == ["ttft_vs_rate.png", "ttft_cdf.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_handles_per_system_rates(tmp_path: Path) -> None:
    """Systems swept at different rates, with skipped runs, still plot."""
    from tessera.benchmark.report import plot

    report = {"workload": "synthetic", "systems": {
        "prefix": {"runs": [{"rate": 0.5, "mean": 1.0, "ttfts": [0.9, 1.1]}]},
        "tessera": {"runs": [{"rate": 1.5, "mean": 0.3, "ttfts": [0.2, 0.4]},
                             {"rate": 3.0, "requests": 0, "ok": 0, "skipped": "saturated at 1.5"}]},
    }}
    paths = plot(report, tmp_path)
    assert [p.name for p in paths] == ["ttft_vs_rate.png", "ttft_cdf.png"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_demo_summary_names_the_ttft_ratio_per_rate() -> None:
    """The demo's summary says how much lower Tessera's mean TTFT is at each rate."""
    from tessera.benchmark.report import format_demo

    report = {"table": "| table |", "plots": ["results/demo/ttft_vs_rate.png"], "systems": {
        "prefix": {"runs": [{"rate": 0.5, "mean": 2.0}, {"rate": 1.0, "mean": 4.0}]},
        "tessera": {"runs": [{"rate": 0.5, "mean": 1.0}, {"rate": 1.0, "mean": 0.5}]},
    }}
    out = format_demo(report)
    assert out[0] == "| table |"
    assert out[1] == "at 0.5 req/s: prefix caching 2.00s vs Tessera 1.00s mean TTFT -> 2.0x lower"
    assert out[2] == "at 1 req/s: prefix caching 4.00s vs Tessera 0.50s mean TTFT -> 8.0x lower"
    assert out[3] == "plot: results/demo/ttft_vs_rate.png"
