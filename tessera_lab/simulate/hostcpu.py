"""``tessera simulate --calibrate-cpu``: each role's CPU per request outside the engine, measured.

The step cost model (:mod:`tessera_lab.simulate.calibrate`) times the engine alone. A real
cluster on one machine also spends CPU in everything else: the retrieval role (HTTP, search,
prompt building, tokenizing, the control plane), the memory node (serving and storing unit
states), the generation nodes' event loops (shared-memory copies, checksums, writebacks,
HTTP) and the load generator itself. On a host with fewer cores than busy threads that work
takes cores from the engine threads.

This module starts the config's cluster (the ``tessera`` system, as ``tessera bench`` does),
sends a workload's warm-up share, then reads every role process's CPU time (utime + stime of
``/proc/PID/stat``, the engine thread's from ``/proc/PID/task/TID/stat``, the thread the
scheduler names ``tessera-engine``) before and after the measured share, and the load
generator's own CPU over the same span. Per request and role:

    cpu_per_request_s[role] = (CPU of the role's processes - their engine threads' CPU) / requests

the engine threads' CPU is reported next to it (``engine_s``), and split by engine call (step,
place_units, match_prefix, insert_prefix, allocate, free) from each generation node's
``tessera_node_engine_cpu_seconds_total`` metric. Linux only (``/proc``).

This module knows nothing about the event loop or the simulated nodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from tessera.benchmark.client import ingest
from tessera.benchmark.runner import BenchOptions, embed_workload, run_phases, system_config
from tessera.benchmark.workloads import Workload
from tessera.config import ClusterConfig
from tessera.errors import ConfigError
from tessera.generation.scheduler import ENGINE_THREAD
from tessera.launcher import LocalCluster
from tessera.ports import on_free_ports

ENGINE_CPU_METRIC = "tessera_node_engine_cpu_seconds_total"  # a generation node's engine CPU by call
ENGINE_WALL_METRIC = "tessera_node_engine_wall_seconds_total"  # and its wall time (CPU plus waits)
LOAD_GENERATOR = "client"  # the role name the measuring (load-sending) process is reported under
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcessCpu:
    """CPU seconds a process has used so far: all threads, and its engine threads alone."""

    total_s: float
    engine_s: float


def _stat_cpu_s(path: Path) -> float:
    """utime + stime of one ``/proc/.../stat`` (fields 14 and 15, after the parenthesised name)."""
    fields = path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def process_cpu(pid: int, proc: Path = Path("/proc")) -> ProcessCpu:
    """The CPU ``pid`` has used, split into its engine threads' and the rest."""
    root = proc / str(pid)
    if not root.is_dir():
        raise ConfigError(f"no {root}: --calibrate-cpu reads Linux's /proc; run it on Linux")
    engine = 0.0
    for task in (root / "task").iterdir():
        try:
            if (task / "comm").read_text().strip() == ENGINE_THREAD:
                engine += _stat_cpu_s(task / "stat")
        except FileNotFoundError:  # a thread that ended between the listing and the read
            continue
    return ProcessCpu(_stat_cpu_s(root / "stat"), engine)


def _engine_seconds(metrics: str, metric: str) -> dict[str, float]:
    """``metric{call="..."}`` samples of one node's /metrics text (engine seconds by call)."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith(metric + "{"):
            labels, _, value = line.rpartition(" ")
            out[labels.split('call="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def _self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def per_request(before: dict[str, ProcessCpu], after: dict[str, ProcessCpu], requests: int,
                roles: dict[str, str]) -> dict[str, dict[str, float]]:
    """CPU per request by role from two snapshots keyed by process (``roles``: process -> role)."""
    if requests <= 0:
        raise ConfigError("--calibrate-cpu needs at least one measured request")
    out: dict[str, dict[str, float]] = {}
    for key, b in before.items():
        a = after[key]
        role = out.setdefault(roles[key], {"other_s": 0.0, "engine_s": 0.0})
        role["other_s"] += ((a.total_s - a.engine_s) - (b.total_s - b.engine_s)) / requests
        role["engine_s"] += (a.engine_s - b.engine_s) / requests
    return out


async def _measure(config: ClusterConfig, workload: Workload, rate: float, warmup_frac: float,
                   log_dir: Path, seed: int) -> dict[str, Any]:
    split = int(len(workload.requests) * warmup_frac)
    if not 0 < split < len(workload.requests):
        raise ConfigError("--calibrate-cpu needs both warm-up and measured requests: --warmup in (0, 1)")
    embeddings = await asyncio.to_thread(embed_workload, workload)
    opts = BenchOptions(systems=["tessera"], rates=[rate], warmup_frac=0.0, out_dir=log_dir, progress=False,
                        seed=seed)
    # ports of its own, as tessera bench's fresh clusters: other clusters may run on this machine
    cluster = LocalCluster(on_free_ports(system_config(config, "tessera")), log_dir=log_dir, quiet=True)
    await asyncio.to_thread(cluster.start)
    try:
        url = cluster.config.retrieval_url
        await ingest(url, workload.corpus, progress=False, embeddings=embeddings)
        await run_phases(url, workload.requests[:split], rate, opts, drain=False, embeddings=embeddings)
        roles = {str(c.proc.pid): c.role for c in cluster.children}
        roles[LOAD_GENERATOR] = LOAD_GENERATOR

        gens = [c for c in cluster.children if c.role == "generation"]

        async def engine_calls() -> dict[str, float]:
            """The generation nodes' engine-thread CPU and wall time by call, summed (their /metrics)."""
            out: dict[str, float] = {}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                for child in gens:
                    async with http.get(f"{child.url}/metrics") as resp:
                        text = await resp.text()
                    for metric, suffix in ((ENGINE_CPU_METRIC, ""), (ENGINE_WALL_METRIC, " wall")):
                        for call, seconds in _engine_seconds(text, metric).items():
                            out[call + suffix] = out.get(call + suffix, 0.0) + seconds
            return out

        def snapshot() -> dict[str, ProcessCpu]:
            out = {str(c.proc.pid): process_cpu(c.proc.pid) for c in cluster.children}
            out[LOAD_GENERATOR] = ProcessCpu(_self_cpu_s(), 0.0)
            return out

        measured = workload.requests[split:]
        calls_before = await engine_calls()
        before = snapshot()
        t0 = time.monotonic()
        # the measured share's send times are tessera bench's second phase's (seed + 1), so a
        # simulation of the same run (tessera_lab.simulate.incluster) replays exactly these arrivals
        second = dataclasses.replace(opts, seed=opts.seed + 1)
        results = await run_phases(url, measured, rate, second, drain=False, embeddings=embeddings)
        wall = time.monotonic() - t0
        after = snapshot()
        calls_after = await engine_calls()
    finally:
        await asyncio.to_thread(cluster.stop)
    ttfts = [r.ttft for r in results if r.ttft is not None]
    ok = len(ttfts)
    return {"rate": rate, "requests": len(measured), "ok": ok, "wall_s": wall,
            "mean_ttft_s": sum(ttfts) / ok if ok else float("nan"),
            "served_per_s": ok / wall if wall > 0 else 0.0,
            "by_role": per_request(before, after, len(measured), roles),
            "engine_calls_per_request_s": {k: (v - calls_before.get(k, 0.0)) / len(measured)
                                           for k, v in sorted(calls_after.items())}}


def measure_roles(config: ClusterConfig, workload: Workload, rate: float, warmup_frac: float = 0.5,
                  log_dir: Path | None = None, seed: int = 0) -> dict[str, Any]:
    """One real run of ``workload`` at ``rate``: each role's CPU per measured request (see module doc)."""
    return asyncio.run(_measure(config, workload, rate, warmup_frac,
                                log_dir or Path(tempfile.mkdtemp(prefix="tessera-cpu-")), seed))




def fit_role_cpu(runs: list[dict[str, Any]]) -> tuple[dict[str, float], float]:
    """Per-request CPU of each role and the background cores, from runs at different rates.

    A role's CPU over a run is ``c × requests + b × seconds`` (``c`` per request, ``b`` its
    background: heartbeats, ticks, idle loops), so its CPU per request reads
    ``c + b × seconds / requests``. Least squares over the runs gives ``c`` and ``b`` per role
    (both clipped at 0); one run cannot tell them apart, and all of it is then ``c``.
    Returns ``({role: c}, the roles' b summed)``.
    """
    if not runs:
        raise ConfigError("--calibrate-cpu measured no run")
    x = np.array([r["wall_s"] / r["requests"] for r in runs])
    roles = sorted({role for r in runs for role in r["by_role"]})
    per_request: dict[str, float] = {}
    background = 0.0
    for role in roles:
        y = np.array([r["by_role"].get(role, {"other_s": 0.0})["other_s"] for r in runs])
        c, b = float(y.mean()), 0.0
        if len(runs) > 1 and float(np.ptp(x)) > 0:
            b, c = (float(v) for v in np.polyfit(x, y, 1))
            if b < 0:
                c, b = float(y.mean()), 0.0
            elif c < 0:
                c, b = 0.0, float((y @ x) / (x @ x))
        per_request[role] = c
        background += b
    return per_request, background
