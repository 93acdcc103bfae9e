"""``tessera simulate``: the real control plane over simulated nodes, deterministic per seed."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers.cluster import REPO, cluster_config, write_config

from tessera.benchmark.runner import system_config
from tessera.benchmark.workloads import synthetic_workload
from tessera.config import ClusterConfig
from tessera.control.router import N, Router, register_router
from tessera.errors import ConfigError
from tessera.generation.batching import take_batch
from tessera.generation.scheduler import ENGINE_THREAD
from tessera_lab.simulate.calibrate import CalibrationPlan, calibrate, fit
from tessera_lab.simulate.command import fleet
from tessera_lab.simulate.costs import CostModel, StepItem, builtin_models, load_cost_model
from tessera_lab.simulate.engine import Host, SimEngine, Work
from tessera_lab.simulate.events import EventLoop
from tessera_lab.simulate.hostcpu import ProcessCpu, fit_role_cpu, process_cpu
from tessera_lab.simulate.hostcpu import per_request as per_request_cpu
from tessera_lab.simulate.run import SimOptions, run_simulation, simulate_run
from tessera_lab.simulate.validate import compare_runs, comparison_table
from tessera_lab.simulate.workload import render, unit_texts

COSTS = CostModel("test", "hand-written for the tests", base_s=0.02, per_token_s=0.002, per_attn_s=0.0005,
                  per_decode_s=0.001, place_per_token_s=1e-5, kv_bytes_per_token=23040, link_latency_s=5e-4,
                  link_bytes_per_s=2e9, request_overhead_s=0.01)


def _work(tokens: int, decode: bool = False) -> Work:
    return Work(tokens, tokens, decode, lambda: None)


def _deterministic(report: dict[str, object]) -> str:
    """The report without the plane's measured CPU times (real perf_counter readings)."""
    def strip(x: object) -> object:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not k.startswith("plane_cpu") and k != "cluster_table"}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return json.dumps(strip(report), sort_keys=True)


def test_a_batch_takes_every_decode_then_extends_before_unit_prefills_within_the_budget() -> None:
    """The scheduler's batching rule, shared by the real node and the simulated one."""
    decodes, extends, prefills = deque([_work(1, True)] * 2), deque([_work(300), _work(300)]), deque([_work(50)])
    batch = take_batch(decodes, extends, prefills, 512)
    assert [w.tokens for w in batch] == [1, 1, 300] and len(extends) == 1 and len(prefills) == 1
    assert [w.tokens for w in take_batch(decodes, extends, prefills, 512)] == [300, 50]


def test_an_item_larger_than_the_budget_still_runs_alone_with_the_decodes() -> None:
    decodes, extends = deque([_work(1, True)]), deque([_work(900), _work(10)])
    assert [w.tokens for w in take_batch(decodes, extends, deque(), 512)] == [1, 900]


def test_max_prompts_caps_the_extends_and_unit_prefills_a_batch_takes_but_never_its_decodes() -> None:
    decodes = deque([_work(1, True)] * 3)
    extends, prefills = deque([_work(100), _work(100)]), deque([_work(50)])
    assert [w.tokens for w in take_batch(decodes, extends, prefills, 512, max_prompts=1)] == [1, 1, 1, 100]
    assert [w.tokens for w in take_batch(decodes, extends, prefills, 512, max_prompts=1)] == [100]
    assert [w.tokens for w in take_batch(decodes, extends, prefills, 512, max_prompts=1)] == [50]
    extends = deque([_work(100)] * 3)
    assert len(take_batch(deque(), extends, deque(), 512, max_prompts=2)) == 2 and len(extends) == 1


def test_the_same_seed_gives_the_same_simulated_report() -> None:
    """Determinism: two runs of one sweep agree on every figure but the plane's measured CPU time."""
    wl = synthetic_workload(16, n_units=20, seed=1)
    opts = SimOptions(["prefix", "tessera"], [1.0, 3.0], unloaded_requests=2, seed=1)
    first = run_simulation(cluster_config(), wl, COSTS, opts, progress=False)
    second = run_simulation(cluster_config(), wl, COSTS, opts, progress=False)
    assert _deterministic(first) == _deterministic(second)
    assert first["systems"]["tessera"]["runs"][0]["ttfts"] != first["systems"]["tessera"]["runs"][1]["ttfts"]


def test_every_simulated_request_is_planned_by_the_real_control_plane() -> None:
    """The plane's own counters see each request's plan, and its LOCAL decisions are served from the node's cache."""
    config = system_config(cluster_config(), "tessera")
    wl = synthetic_workload(24, n_units=10, seed=2)
    requests = render(config, wl, unit_texts(config, wl))
    run = simulate_run(config, COSTS, requests, 2.0, SimOptions(["tessera"], [2.0]))
    stats = run.cluster.plane.stats.snapshot()
    assert stats["plans"] == 24 and stats["units"] == sum(len(r.unit_refs()) for r in requests)
    local = sum(r.usage["tessera"]["local_tokens"] for r in run.results)
    assert stats["local"] > 0 and local > 0
    assert run.cluster.timed.time.calls["route"] == run.cluster.timed.time.calls["complete"] == 24


class _FirstNode(Router):
    """Test router: always the node listed first."""

    def choose(self, nodes: Sequence[N], local_blocks: Sequence[int], block_s: float | None = None) -> N:
        return min(nodes, key=lambda n: n.index)


register_router("sim_test_first")(_FirstNode)


def test_the_configured_routing_policy_decides_where_simulated_requests_run() -> None:
    """A router registered with the plane sends every request to gen0: the simulator asks the plane, not itself."""
    config = system_config(cluster_config(nodes=3), "tessera")
    config = dataclasses.replace(config, control=dataclasses.replace(config.control, routing="sim_test_first"))
    wl = synthetic_workload(12, n_units=10, seed=3)
    run = simulate_run(config, COSTS, render(config, wl, unit_texts(config, wl)), 4.0, SimOptions(["tessera"], [4.0]))
    assert {n: node.served for n, node in run.cluster.nodes.items()} == {"gen0": 12, "gen1": 0, "gen2": 0}


def test_a_cost_model_survives_its_json_file(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    COSTS.save(path)
    assert load_cost_model(str(path)) == COSTS
    assert COSTS.step_s([StepItem(100, 1000)]) == pytest.approx(0.02 + 0.2 + 0.05)


def test_the_shipped_gpu_models_load_and_a_bad_file_says_what_is_wrong(tmp_path: Path) -> None:
    assert {"llama3-8b-a100", "llama3-8b-h100"} <= set(builtin_models())
    a100, h100 = load_cost_model("llama3-8b-a100"), load_cost_model("llama3-8b-h100")
    assert h100.step_s([StepItem(1000, 1000)]) < a100.step_s([StepItem(1000, 1000)])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**dataclasses.asdict(COSTS), "per_tokn_s": 1.0}))
    with pytest.raises(ConfigError, match="unknown keys"):
        load_cost_model(str(bad))
    with pytest.raises(ConfigError, match="shipped models are"):
        load_cost_model("no-such-model")


def test_the_fit_recovers_the_step_formula_from_exact_samples() -> None:
    truth = CostModel("t", "", base_s=0.01, per_token_s=0.001, per_attn_s=0.002, per_decode_s=0.003)
    batches = [[StepItem(n, c)] for n, c in [(16, 16), (64, 512), (256, 256), (512, 1024)]]
    batches += [[StepItem(1, 256, decode=True)] * m for m in (1, 4, 16)]
    coef = fit([(b, truth.step_s(b)) for b in batches])
    assert coef == pytest.approx((0.01, 0.001, 0.002, 0.003), rel=1e-6, abs=1e-9)


@pytest.mark.integration
def test_calibrate_measures_the_configured_engine(tiny_model: Path) -> None:
    """A quick calibration of the tiny model: non-negative coefficients, the pool's bytes per token."""
    config = cluster_config(str(tiny_model), nodes=1)
    model = calibrate(config, CalibrationPlan().smaller(), name="tiny")
    assert model.per_token_s + model.base_s > 0 and min(model.base_s, model.per_token_s, model.per_attn_s) >= 0
    assert model.kv_bytes_per_token > 0 and "step samples" in model.source


def test_a_fleet_copies_the_first_nodes_and_splits_the_shared_tier() -> None:
    cfg = fleet(cluster_config(), nodes=5, memory_nodes=2, shared_blocks=1001, local_blocks=64)
    assert [g.name for g in cfg.generation] == [f"gen{i}" for i in range(5)]
    assert {g.local_capacity_blocks for g in cfg.generation} == {64}
    assert [k.capacity_blocks for k in cfg.kvpools] == [501, 500]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "tessera", "simulate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=240, check=False, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return done


@pytest.mark.integration
def test_the_cli_calibrates_then_simulates_a_tiny_synthetic_sweep(tiny_model: Path, tmp_path: Path) -> None:
    """`tessera simulate --calibrate` writes a cost model; `tessera simulate` prints the bench's table with it."""
    config: ClusterConfig = cluster_config(str(tiny_model), nodes=2)
    path = write_config(tmp_path, config)
    model = tmp_path / "cost.json"
    _cli("--calibrate", "--cost-model", str(model), "--config", str(path))
    assert load_cost_model(str(model)).name == "cost"
    out = tmp_path / "sim"
    done = _cli("--workload", "synthetic", "--requests", "8", "--rates", "1,2", "--unloaded", "2", "--cost-model",
                str(model), "--config", str(path), "--out", str(out))
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tessera | 2 |")]
    assert len(rows) == 2, done.stdout  # the TTFT table's row and the cluster table's
    assert (out / "simulate.json").is_file() and (out / "ttft_vs_rate.png").is_file()
    again = _cli("--workload", "synthetic", "--requests", "8", "--rates", "1,2", "--unloaded", "2", "--cost-model",
                 str(model), "--config", str(path), "--compare", str(out / "simulate.json"))
    assert "| tessera | unloaded |" in again.stdout and "0 of 6 runs outside ±20%" in again.stdout, again.stdout


@pytest.mark.integration
@pytest.mark.slow  # a real cluster at two rates
def test_the_cli_measures_each_roles_cpu_on_a_real_tiny_cluster(tiny_model: Path, tmp_path: Path) -> None:
    """`tessera simulate --calibrate-cpu`: a real cluster's roles' CPU per request and the engines' in-cluster
    stretch go into the cost model file; the engine thread's CPU is told apart and split by engine call."""
    config: ClusterConfig = cluster_config(str(tiny_model), nodes=2)
    path = write_config(tmp_path, config)
    model = tmp_path / "cost.json"
    _cli("--calibrate", "--cost-model", str(model), "--config", str(path))
    done = _cli("--calibrate-cpu", "--workload", "synthetic", "--requests", "8", "--rates", "2,4", "--cost-model",
                str(model), "--config", str(path))
    costs = load_cost_model(str(model))
    assert costs.host_cores == len(os.sched_getaffinity(0)) and len(costs.host_slowdown) == 2, done.stdout
    assert {"retrieval", "generation", "kvpool", "client"} == set(costs.cpu_per_request_s), costs.cpu_per_request_s
    assert min(costs.host_slowdown) >= 1.0 and "in-cluster step stretch" in costs.source
    runs = json.loads((tmp_path / "cost-cpu-runs.json").read_text())
    assert [r["rate"] for r in runs] == [2.0, 4.0] and all(r["ok"] == 4 for r in runs)
    assert all(r["by_role"]["generation"]["engine_s"] > 0 and r["engine_calls_per_request_s"]["step"] > 0
               for r in runs)


@pytest.mark.integration
def test_bench_scale_prints_a_row_per_fleet_size_and_the_shared_tier_sweep(tmp_path: Path) -> None:
    """`python bench/scale.py` (tiny fleets): one table row per fleet size, the tier sweep, scale.json and plots."""
    done = subprocess.run([sys.executable, "bench/scale.py", "--nodes", "2,4", "--requests-per-node", "4", "--units",
                           "30", "--tier-nodes", "2", "--tier-fractions", "0.5,1", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[:3] == ["nodes", "2", "4"], done.stdout  # the header, then one row per size
    saved = json.loads((tmp_path / "scale.json").read_text())
    assert [r["nodes"] for r in saved["nodes"]] == [2, 4] and len(saved["shared_tier"]) == 2
    assert (tmp_path / "scale_nodes.png").is_file() and (tmp_path / "scale_shared_tier.png").is_file()


def test_a_simulation_is_compared_run_by_run_with_a_bench_report() -> None:
    """--compare: runs matched by system and rate (unloaded too); the error is relative to the measured mean."""
    def run(rate: float, mean: float) -> dict[str, object]:
        return {"rate": rate, "mean": mean, "p90": mean, "hit_rate": {"computed": 0.1}}

    measured = {"systems": {"tessera": {"unloaded": run(0.0, 1.0), "runs": [run(1.0, 2.0), run(2.0, 4.0)]}}}
    simulated = {"systems": {"tessera": {"unloaded": run(0.0, 1.1), "runs": [run(1.0, 1.0)]}}}
    rows = compare_runs(simulated, measured)
    assert [(r["rate"], round(r["error"], 3)) for r in rows] == [("unloaded", 0.1), ("1", -0.5)]
    assert "1 of 2 runs outside ±20%" in comparison_table(rows)


def test_engines_of_one_host_stretch_each_others_steps_by_the_models_slowdown() -> None:
    """Two engines on one host step at once: each step takes host_slowdown[1] × its cost; alone, 1×."""
    costs = dataclasses.replace(COSTS, host_slowdown=(1.0, 2.0))
    loop = EventLoop()
    host = Host(loop, costs)
    engines = [SimEngine(loop, costs, 512, host) for _ in range(2)]
    done: list[float] = []
    t0 = loop.now
    engines[0].prefill_unit(100, lambda: done.append(loop.now - t0))
    engines[1].prefill_unit(100, lambda: done.append(loop.now - t0))
    loop.run()
    step = costs.step_s([StepItem(100, 100)])
    assert done == pytest.approx([step * 2.0, step * 2.0]) and host.busy == 0
    engines[0].prefill_unit(100, lambda: done.append(loop.now - t0))
    loop.run()
    assert done[-1] == pytest.approx(step * 3.0)  # alone: its plain cost after the first pair


@pytest.mark.integration
def test_a_simulation_replays_identically_under_another_string_hash_seed(tmp_path: Path) -> None:
    """Regression: units were prepared in set order, so a process with another PYTHONHASHSEED diverged."""
    ttfts = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        done = subprocess.run([sys.executable, "-m", "tessera", "simulate", "--workload", "synthetic", "--requests",
                               "80", "--nodes", "3", "--local-blocks", "64", "--shared-blocks", "256", "--cost-model",
                               "llama3-8b-a100", "--rates", "20", "--systems", "tessera", "--unloaded", "0", "--out",
                               str(out)], cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": seed})
        assert done.returncode == 0, done.stderr[-2000:]
        ttfts.append(json.loads((out / "simulate.json").read_text())["systems"]["tessera"]["runs"][0]["ttfts"])
    assert ttfts[0] == ttfts[1]


@pytest.mark.integration
def test_a_traffic_trace_replays_at_its_recorded_times() -> None:
    """`tessera simulate --trace`: one run per system at the trace's own send times, labelled with their mean rate."""
    done = _cli("--trace", "bench/traces/example.jsonl", "--cost-model", "llama3-8b-a100", "--unloaded", "0")
    rows = [line.split("|")[1:4] for line in done.stdout.splitlines() if line.startswith(("| prefix", "| tessera"))]
    labels = [(r[0].strip(), r[1].strip()) for r in rows[:2]]
    assert labels == [("prefix", "1.9048"), ("tessera", "1.9048")], done.stdout


def test_other_roles_cpu_shares_the_hosts_cores_with_the_engine_steps() -> None:
    """Two engine steps and one CPU job on two cores: each runs at 2/3 speed until the job ends."""
    costs = dataclasses.replace(COSTS, host_slowdown=(1.0, 1.0), host_cores=2)
    loop = EventLoop()
    host = Host(loop, costs)
    done: dict[str, float] = {}
    t0 = loop.now
    host.run(0.3, lambda: done.setdefault("step a", loop.now - t0))
    host.run(0.3, lambda: done.setdefault("step b", loop.now - t0))
    host.cpu(0.1, lambda: done.setdefault("job", loop.now - t0))
    loop.run()
    # 3 jobs on 2 cores: the job's 0.1 s takes 0.15 s, the steps then have 0.2 s left at full speed
    assert done == pytest.approx({"job": 0.15, "step a": 0.35, "step b": 0.35})
    assert host.cpu_s == pytest.approx(0.1) and host.busy == 0
    # the roles' idle load takes its cores first: one of two left, two steps each at half speed
    idle = dataclasses.replace(costs, host_background_cores=1.0)
    host, done = Host(loop, idle), {}
    t0 = loop.now
    host.run(0.3, lambda: done.setdefault("a", loop.now - t0))
    host.run(0.3, lambda: done.setdefault("b", loop.now - t0))
    loop.run()
    assert done == pytest.approx({"a": 0.6, "b": 0.6})


def test_without_a_core_count_the_roles_cpu_is_only_the_retrieval_roles_latency() -> None:
    """host_cores 0 (a GPU node): nothing is shared, the retrieval CPU still sits on the request's path."""
    config = system_config(cluster_config(), "tessera")
    wl = synthetic_workload(12, n_units=10, seed=4)
    requests = render(config, wl, unit_texts(config, wl))
    serial = SimOptions(["tessera"], [0.2])
    base = simulate_run(config, COSTS, requests[:6], 0.2, serial, serial=requests[6:])
    costly = dataclasses.replace(COSTS, cpu_per_request_s={"retrieval": 0.05, "generation": 0.2})
    slower = simulate_run(config, costly, requests[:6], 0.2, serial, serial=requests[6:])
    assert [b.ttft + 0.05 for b in base.results] == pytest.approx([s.ttft for s in slower.results])
    (host,) = slower.cluster.hosts.values()
    assert host.cpu_s == pytest.approx(12 * 0.25)  # charged, but with no core count it slows nothing


def test_the_roles_cpu_on_a_shared_host_slows_the_engines_under_load() -> None:
    """Two nodes on one 2-core host: the measured per-request CPU of the other roles raises the loaded TTFT."""
    config = system_config(cluster_config(), "tessera")
    wl = synthetic_workload(40, n_units=20, seed=5)
    requests = render(config, wl, unit_texts(config, wl))
    opts = SimOptions(["tessera"], [6.0])
    shared = dataclasses.replace(COSTS, host_slowdown=(1.0, 1.0), host_cores=2)
    alone = simulate_run(config, shared, requests, 6.0, opts)
    busy = dataclasses.replace(shared, cpu_per_request_s={"retrieval": 0.01, "generation": 0.15, "kvpool": 0.01,
                                                          "client": 0.01})
    loaded = simulate_run(config, busy, requests, 6.0, opts)
    mean = [sum(r.ttft for r in run.results if r.ttft is not None) / len(run.results) for run in (alone, loaded)]
    assert mean[1] > mean[0]
    (host,) = loaded.cluster.hosts.values()
    assert host.cpu_s == pytest.approx(40 * (0.01 + 0.15 + 0.01 + 0.01))  # every request's share, charged once


def test_a_cost_model_refuses_unknown_roles_and_more_background_than_cores() -> None:
    with pytest.raises(ConfigError, match="takes roles"):
        dataclasses.replace(COSTS, cpu_per_request_s={"gateway": 0.1})
    with pytest.raises(ConfigError, match="host_background_cores"):
        dataclasses.replace(COSTS, host_cores=2, host_background_cores=2.0)


def _stat(root: Path, utime: int, stime: int, comm: str = "python") -> None:
    root.mkdir(parents=True, exist_ok=True)
    fields = ["S", *["0"] * 10, str(utime), str(stime), *["0"] * 30]  # state, then fields 4..: 14, 15 = utime, stime
    (root / "stat").write_text(f"123 ({comm} x) " + " ".join(fields) + "\n")
    (root / "comm").write_text(comm + "\n")


def test_process_cpu_reads_proc_and_tells_the_engine_thread_from_the_rest(tmp_path: Path) -> None:
    """utime + stime in clock ticks; the thread named tessera-engine is the engine's share."""
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    _stat(tmp_path / "7", 300, 100)
    _stat(tmp_path / "7" / "task" / "7", 50, 10)
    _stat(tmp_path / "7" / "task" / "8", 200, 80, comm=ENGINE_THREAD)
    cpu = process_cpu(7, proc=tmp_path)
    assert cpu == ProcessCpu(pytest.approx(400 * tick), pytest.approx(280 * tick))
    with pytest.raises(ConfigError, match="/proc"):
        process_cpu(8, proc=tmp_path)


def test_the_engine_thread_carries_its_os_name_so_its_cpu_is_counted_apart() -> None:
    """A thread named by the scheduler's initializer spins 0.3 s of CPU: process_cpu counts it as engine."""
    import threading
    import time as _time

    from tessera.generation.scheduler import _name_os_thread

    before = process_cpu(os.getpid())
    # a finished thread leaves /proc/PID/task: read while the named one is still alive
    alive = threading.Event()
    stop = threading.Event()

    def named_spin() -> None:
        _name_os_thread()
        t = _time.thread_time()
        while _time.thread_time() - t < 0.3:
            pass
        alive.set()
        stop.wait(10)

    thread = threading.Thread(target=named_spin)
    thread.start()
    alive.wait(30)
    after = process_cpu(os.getpid())
    stop.set()
    thread.join()
    assert after.engine_s - before.engine_s >= 0.25


def test_the_role_cpu_fit_separates_per_request_from_background_cpu() -> None:
    """CPU per request reads c + b × seconds / requests: two rates give c and b back."""
    def run(rate: float) -> dict[str, object]:
        requests, wall = 30, 30 / rate
        return {"requests": requests, "wall_s": wall,
                "by_role": {"generation": {"other_s": 0.2 + 0.05 * wall / requests, "engine_s": 1.0},
                            "retrieval": {"other_s": 0.02, "engine_s": 0.0}}}

    per_request, background = fit_role_cpu([run(1.0), run(2.0)])
    assert per_request == pytest.approx({"generation": 0.2, "retrieval": 0.02})
    assert background == pytest.approx(0.05)
    assert fit_role_cpu([run(1.0)])[0]["generation"] == pytest.approx(0.25)  # one rate: all of it per request
    before = {"1": ProcessCpu(1.0, 0.5), "2": ProcessCpu(2.0, 0.0)}
    after = {"1": ProcessCpu(4.0, 2.5), "2": ProcessCpu(2.6, 0.0)}
    got = per_request_cpu(before, after, 2, {"1": "generation", "2": "kvpool"})
    assert got["generation"] == pytest.approx({"other_s": 0.5, "engine_s": 1.0})
    assert got["kvpool"] == pytest.approx({"other_s": 0.3, "engine_s": 0.0})


def test_the_engine_worker_counts_its_threads_cpu_by_call() -> None:
    """EngineWorker.cpu_s: the thread CPU of each call on the engine thread, keyed by the function's name."""
    import asyncio
    import time as _time
    from types import SimpleNamespace

    from tessera.generation.scheduler import EngineWorker

    def spin(seconds: float) -> float:
        t = _time.thread_time()
        while _time.thread_time() - t < seconds:
            pass
        return seconds

    def quick() -> None:
        return None

    async def main() -> tuple[dict[str, float], dict[str, float]]:
        # the calls below never touch the engine; the worker only tells it which thread is its own
        worker = EngineWorker(SimpleNamespace(on_engine_thread=lambda: None))  # type: ignore[arg-type]
        try:
            assert await worker.call(spin, 0.2) == 0.2
            await worker.call(quick)
            return dict(worker.cpu_s), dict(worker.wall_s)
        finally:
            worker.close()

    cpu, wall = asyncio.run(main())
    assert cpu["spin"] >= 0.19 and 0 <= cpu["quick"] < cpu["spin"]
    assert wall["spin"] >= cpu["spin"] * 0.99  # wall time holds the CPU time and any wait for a core


def test_the_in_cluster_stretch_is_fitted_back_from_the_engines_cpu_per_request() -> None:
    """Engine CPU per request made by a model with known slowdowns: the fit, started from none, finds them."""
    from tessera_lab.simulate.incluster import fit_host_slowdown, measured_work

    config = system_config(cluster_config(), "tessera")
    wl = synthetic_workload(40, n_units=20, seed=6)
    requests = render(config, wl, unit_texts(config, wl))
    truth = dataclasses.replace(COSTS, host_slowdown=(1.2, 1.5))
    runs = []
    for rate in (0.5, 16.0):  # mostly one engine busy, then (well past saturation) nearly always both
        work = measured_work(config, truth, requests, rate, 0.5, 0)
        cpu = sum(w * truth.slowdown(k) for k, w in work.items()) / 20
        runs.append({"rate": rate, "requests": 20, "by_role": {"generation": {"other_s": 0.0, "engine_s": cpu}}})
    fitted = fit_host_slowdown(config, dataclasses.replace(COSTS, host_slowdown=(1.0, 1.0)), requests, runs, 0.5, 0)
    assert fitted == pytest.approx((1.2, 1.5), rel=0.03)


def test_the_comparison_reads_each_runs_machine_speed_from_its_first_requests() -> None:
    """The first requests meet a drained cluster: their measured / simulated TTFT is the machine's speed, not load."""
    def run(rate: float, mean: float, ttfts: list[float]) -> dict[str, object]:
        return {"rate": rate, "mean": mean, "p90": mean, "hit_rate": {"computed": 0.2}, "ttfts": ttfts}

    measured = {"systems": {"tessera": {"runs": [run(1.0, 1.0, [0.5, 0.5, 1.0, 0.5, 3.0]),
                                                 run(2.5, 5.0, [0.65, 0.65, 1.3, 0.65, 9.0])]}}}
    simulated = {"systems": {"tessera": {"runs": [run(1.0, 1.0, [0.5, 0.5, 1.0, 0.5, 3.0]),
                                                  run(2.5, 2.5, [0.5, 0.5, 1.0, 0.5, 4.0])]}}}
    rows = compare_runs(simulated, measured)
    assert [round(r["idle_start"], 2) for r in rows] == [1.0, 1.3]
    assert "| 1.30 |" in comparison_table(rows)


def test_simulated_nodes_prefill_a_missing_unit_as_their_engine_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the reference engine a miss rides its request's extend (no prefill job of its own), as
    on the real node; on the paged engine, which does not fuse, it is a prefill job first."""
    jobs: list[int] = []
    real = SimEngine.prefill_unit

    def counted(self: SimEngine, tokens: int, done: object) -> None:
        jobs.append(tokens)
        real(self, tokens, done)  # type: ignore[arg-type]

    monkeypatch.setattr(SimEngine, "prefill_unit", counted)
    wl = synthetic_workload(24, n_units=10, seed=2)
    computed = {}
    for engine in ("reference", "paged"):
        config = system_config(cluster_config(), "tessera")
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, engine=engine))
        jobs.clear()
        run = simulate_run(config, COSTS, render(config, wl, unit_texts(config, wl)), 2.0,
                           SimOptions(["tessera"], [2.0]))
        assert all(node.fuse_units == (engine == "reference") for node in run.cluster.nodes.values())
        computed[engine] = sum(r.usage["tessera"]["computed_unit_tokens"] for r in run.results)
        assert computed[engine] > 0
        assert (len(jobs) == 0) == (engine == "reference")


@dataclasses.dataclass
class _Grouped:
    tokens: int
    group: int
    decode: bool = False

    def cancelled(self) -> bool:
        return False


def test_unit_prefills_of_one_group_count_as_one_prompt() -> None:
    """One request's (or one assist's) unit prefills queued together share a forward even with
    one prompt a batch; another group, or an ungrouped item, waits for the next batch."""
    prefills = deque([_Grouped(50, 7), _Grouped(60, 7), _Grouped(40, 8), _Grouped(30, 0), _Grouped(20, 0)])
    take = lambda: [w.tokens for w in take_batch(deque(), deque(), prefills, 512, 1)]  # noqa: E731
    assert take() == [50, 60]
    assert take() == [40]
    assert take() == [30]
    assert take() == [20]
    # the token budget still bounds a group
    prefills.extend([_Grouped(300, 9), _Grouped(300, 9)])
    assert take() == [300]
    assert take() == [300]
