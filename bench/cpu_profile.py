"""Where the cycles go at saturation: CPU per request by role and by stage, prefix caching vs Tessera.

    python bench/cpu_profile.py --trace T.jsonl [--systems prefix,tessera] [--rate 6] [--warmup 0.5]
        [--request-line] [--sample-rate 100] [--config tessera.toml] [--out results/profile]

For each system a fresh cluster (the embedded default config unless ``--config``) replays the
traffic trace: the first ``--warmup`` share of its requests warms the caches, then the rest is
sent as Poisson arrivals at ``--rate`` (pick one above both systems' saturation, so the nodes
never idle) while `py-spy <https://github.com/benfred/py-spy>`_ samples every role's process.
A role's CPU is read from ``/proc`` (exact; the engine thread's apart, as ``tessera simulate
--calibrate-cpu`` reads it); py-spy's samples only split it into stages by the code on the
stack (:data:`CONTEXT` rules anywhere on the stack first, then :data:`STAGES` from the
innermost frame out). Prints, per system, the saturation throughput,
the prompt tokens computed per request, and each role's CPU milliseconds per request by stage;
then the throughput ratio against the ratio of computed prompt tokens (the issue's target:
>= 0.8 of it). ``OUT/profile.json`` keeps the figures, ``OUT/SYSTEM-ROLE.folded`` the raw stacks
(``flamegraph.pl`` or speedscope read them).

``--request-line`` adds a per-request line to each request's system message (a request id),
as production RAG traffic does with its per-request system-prompt block: it breaks every
prefix before the passages, so prefix caching can reuse only the shared template.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tessera.benchmark.client import Result, run_load
from tessera.benchmark.report import summarize
from tessera.benchmark.runner import SYSTEMS, system_config
from tessera.benchmark.traffic import TraceRequest, UnitTexts, read_traffic, trace_workload, write_traffic
from tessera.benchmark.workloads import Workload
from tessera.config_file import load_config
from tessera.engines.checkpoint import resolve
from tessera.engines.tokenizer import load_tokenizer
from tessera.generation.scheduler import ENGINE_THREAD
from tessera.launcher import LocalCluster
from tessera.ports import on_free_ports
from tessera_lab.simulate.hostcpu import process_cpu

# What a sample's stack was doing. A CONTEXT rule matches a frame anywhere on the stack and
# wins (the first rule that matches): the torch and rope calls under a placement are the
# placement's, not the model's. Otherwise, from the innermost frame out, the first frame some
# STAGES rule matches names the stage (rules tried in order on each frame). Library frames
# match no rule except HTTP's and the event loop's, so a library call counts toward the
# Tessera code that made it (torch in the model is the forward, hmac in a block seal the write).
CONTEXT: tuple[tuple[str, str], ...] = (
    ("placement", r"place_units|Engine\.place \("),
    ("prefix cache", r"match_prefix|insert_prefix"),
    # a unit written back to the KV pool (encode, seal: the blocks' MACs) or fetched from it
    ("writeback", r"KVPoolClient\.store|encode_unit|tessera/generation/retention|tessera/transport/writes"),
    ("fetch", r"KVPoolClient\.fetch|decode_unit|tessera/generation/pool_client"),
)
STAGES: tuple[tuple[str, str], ...] = (
    # generation side
    ("engine forward", r"tessera/engines/(?!tokenizer)|tessera/kernels/"),
    ("fetch", r"tessera/transport/"),
    ("local cache", r"tessera/generation/(unit_cache|memory)"),
    ("node scheduling", r"tessera/generation/(scheduler|batching|work|executor|prefills)"),
    ("node server", r"tessera/generation/"),
    # retrieval side
    ("tokenize", r"tessera/engines/tokenizer"),
    ("units+prompt", r"tessera/units|tessera/composition/|tessera/retrieval/(prompt|chat_layout)"),
    ("plan+route", r"tessera/control/"),
    ("parse+encode", r"tessera/(messages|wire)|tessera/retrieval/chat_request"),
    ("reply+receipt", r"tessera/retrieval/(receipt|reply|chat_response|chat_metrics|access_log)|prometheus_client"),
    ("retrieval driver", r"tessera/retrieval/"),
    ("auth", r"tessera/auth"),
    # anywhere
    ("http", r"aiohttp/|multidict|yarl|tessera/(http|listener)"),
    ("event loop", r"asyncio/|uvloop"),
)
_CONTEXT = [(stage, re.compile(p)) for stage, p in CONTEXT]
_COMPILED = [(stage, re.compile(p)) for stage, p in STAGES]


def stage_of(frames: list[str]) -> str:
    """The stage of one sample: frames are root first, as py-spy writes them."""
    for stage, pattern in _CONTEXT:
        if any(pattern.search(f) for f in frames):
            return stage
    for frame in reversed(frames):
        for stage, pattern in _COMPILED:
            if pattern.search(frame):
                return stage
    return "other"


def with_request_lines(requests: list[TraceRequest]) -> list[TraceRequest]:
    """Each request's system message (added if there is none) ends with a line of its own."""
    out = []
    for i, r in enumerate(requests):
        line = f"Request id: r{i:06d}."
        msgs = [dict(m) for m in r.messages]
        if msgs and msgs[0].get("role") == "system":
            msgs[0]["content"] = f"{msgs[0]['content']}\n{line}"
        else:
            msgs.insert(0, {"role": "system", "content": line})
        out.append(dataclasses.replace(r, messages=tuple(msgs)))
    return out


def read_folded(path: Path) -> Counter[str]:
    """Samples per stage from a py-spy ``--format raw`` file (``frame;frame;... count`` lines)."""
    stages: Counter[str] = Counter()
    if not path.exists():
        return stages
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stages[stage_of(stack.split(";"))] += int(count)
    return stages


def stage_split(ms: float, samples: Counter[str]) -> dict[str, float]:
    """A process's CPU per request split in the proportions of its samples' stages."""
    n = sum(samples.values())
    return {stage: ms * c / n for stage, c in samples.most_common()} if n else {}


def restage(out: Path) -> list[dict[str, Any]]:
    """An earlier run's figures with its saved stacks staged again by the current :data:`STAGES`."""
    runs: list[dict[str, Any]] = json.loads((out / "profile.json").read_text())["runs"]
    for run in runs:
        for name, role in run["roles"].items():
            role["stages_ms_per_request"] = stage_split(role["cpu_ms_per_request"],
                                                  read_folded(out / f"{run['system']}-{name}.folded"))
    return runs


def computed_tokens(r: Result) -> int:
    """Prompt tokens this request computed: its final extend plus unit prefills on the node."""
    t = r.usage.get("tessera", {})
    return int(t.get("recomputed_tokens", 0)) + int(t.get("computed_unit_tokens", 0))


async def profile_system(system: str, base: Any, wl: Workload, args: argparse.Namespace) -> dict[str, Any]:
    cluster = LocalCluster(on_free_ports(system_config(base, system)), log_dir=args.out / f"logs-{system}",
                           quiet=True)
    await asyncio.to_thread(cluster.start)
    try:
        url = cluster.config.retrieval_url
        split = int(len(wl.requests) * args.warmup)
        print(f"[{system}] warm-up: {split} requests at {args.rate:g} req/s", file=sys.stderr, flush=True)
        await run_load(url, wl.requests[:split], args.rate, seed=args.seed, desc=f"{system} warm-up",
                       max_concurrency=args.max_concurrency)
        procs = {f"{c.role}-{c.node}": c.proc.pid for c in cluster.children}
        before = {name: process_cpu(pid) for name, pid in procs.items()}
        spies = {}
        for name, pid in procs.items():
            out = args.out / f"{system}-{name}.folded"
            out.unlink(missing_ok=True)
            # --nonblocking: sample without pausing the process (the profile must not slow it)
            spies[name] = subprocess.Popen(
                [args.py_spy, "record", "--pid", str(pid), "--rate", str(args.sample_rate), "--format", "raw",
                 "--nonblocking", "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        print(f"[{system}] measured: {len(wl.requests) - split} requests at {args.rate:g} req/s, profiled",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        results = await run_load(url, wl.requests[split:], args.rate, seed=args.seed + 1, desc=system,
                                 max_concurrency=args.max_concurrency)
        wall = time.perf_counter() - t0
        after = {name: process_cpu(pid) for name, pid in procs.items()}
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)
        for name, spy in spies.items():
            try:
                _, err = spy.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                err = b"timed out writing its profile"
            if spy.returncode not in (0, -signal.SIGINT):
                print(f"[{system}] py-spy on {name} exited {spy.returncode}: {err.decode(errors='replace')[-300:]}",
                      file=sys.stderr)
    finally:
        await asyncio.to_thread(cluster.stop)
    ok = [r for r in results if r.ok]
    failed = Counter(r.error[:100] or f"HTTP {r.status}" for r in results if not r.ok)
    if failed:
        print(f"[{system}] {sum(failed.values())} requests failed: {dict(failed)}", file=sys.stderr)
    if not ok:
        raise SystemExit(f"[{system}] no request succeeded: {sorted({r.error or r.status for r in results})}")
    roles: dict[str, Any] = {}
    for name in procs:
        total = after[name].total_s - before[name].total_s
        engine = after[name].engine_s - before[name].engine_s
        cpu = {ENGINE_THREAD: engine, "other threads": total - engine} if engine > 0 else {"all threads": total}
        samples = read_folded(args.out / f"{system}-{name}.folded")
        n = sum(samples.values())
        roles[name] = {
            "cpu_ms_per_request": 1000 * total / len(ok),
            "threads_ms_per_request": {t: 1000 * s / len(ok) for t, s in sorted(cpu.items(), key=lambda kv: -kv[1])},
            "samples": n,
            "stages_ms_per_request": stage_split(1000 * total / len(ok), samples),
        }
    prompt = sum(int(r.usage.get("prompt_tokens", 0)) for r in ok)
    return {"system": system, "requests": len(results), "ok": len(ok), "wall_s": wall,
            "throughput": summarize(results, 0.0, args.rate)["throughput"],
            "prompt_tokens_per_request": prompt / len(ok),
            "computed_tokens_per_request": sum(computed_tokens(r) for r in ok) / len(ok), "roles": roles}


def by_role(run: dict[str, Any]) -> dict[str, dict[str, float]]:
    """A run's CPU ms per request by role (every node of a role summed) and stage, plus a total."""
    out: dict[str, dict[str, float]] = {}
    for name, r in run["roles"].items():
        role = out.setdefault(name.split("-")[0], {})
        for stage, ms in r["stages_ms_per_request"].items():
            role[stage] = role.get(stage, 0.0) + ms
        role["total"] = role.get("total", 0.0) + r["cpu_ms_per_request"]
    return out


def print_report(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        print(f"{run['system']}: {run['ok']}/{run['requests']} ok, saturation throughput "
              f"{run['throughput']:.2f} req/s, prompt {run['prompt_tokens_per_request']:.0f} tokens/request, "
              f"computed {run['computed_tokens_per_request']:.0f}")
    roles = {run["system"]: by_role(run) for run in runs}
    columns = [(system, role) for system, rs in roles.items() for role in rs if rs[role]["total"] >= 0.5]
    stages = sorted({st for system, role in columns for st in roles[system][role] if st != "total"},
                    key=lambda st: -sum(roles[sy][ro].get(st, 0.0) for sy, ro in columns))
    print("\nCPU ms per request, by stage (every node of a role summed):\n")
    print("| stage | " + " | ".join(f"{system} {role}" for system, role in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for stage in [*stages, "total"]:
        cells = [f"{roles[system][role].get(stage, 0.0):.1f}" for system, role in columns]
        name = f"**{stage}**" if stage == "total" else stage
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    for run in runs:
        for name, r in run["roles"].items():
            threads = ", ".join(f"{t} {ms:.1f}" for t, ms in list(r["threads_ms_per_request"].items())[:3])
            if threads:
                print(f"  {run['system']} {name} threads (ms/request): {threads}")
    by = {r["system"]: r for r in runs}
    if "prefix" in by and "tessera" in by:
        p, t = by["prefix"], by["tessera"]
        tput = t["throughput"] / p["throughput"]
        tokens = p["computed_tokens_per_request"] / max(t["computed_tokens_per_request"], 1e-9)
        print(f"\nsaturation throughput tessera/prefix {tput:.2f}x; computed prompt tokens prefix/tessera "
              f"{tokens:.2f}x; throughput ratio / token ratio {tput / tokens:.2f} (target >= 0.8)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, help="traffic trace (JSONL, docs/bench/traces.md)")
    ap.add_argument("--restage", action="store_true",
                    help="print OUT's earlier run again, its saved stacks staged by the current rules; runs nothing")
    ap.add_argument("--systems", default="prefix,tessera")
    ap.add_argument("--rate", type=float, default=6.0, help="Poisson rate (req/s), above both systems' saturation")
    ap.add_argument("--requests", type=int, default=0, help="replay only the trace's first N requests (0: all)")
    ap.add_argument("--max-concurrency", type=int, default=16,
                    help="requests in flight at most: enough to keep every node busy, few enough that the "
                         "plane's queue caps refuse none")
    ap.add_argument("--warmup", type=float, default=0.5, help="share of the trace's requests that warms up")
    ap.add_argument("--request-line", action="store_true", help="add a per-request line to every system message")
    ap.add_argument("--sample-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/profile"))
    args = ap.parse_args()
    if args.restage:
        print_report(restage(args.out))
        return
    if args.trace is None:
        raise SystemExit("--trace is required (or --restage to print an earlier run again)")
    args.py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(args.py_spy).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy (it samples the roles' processes)")
    if not 0 <= args.warmup < 1 or args.rate <= 0:
        raise SystemExit("--warmup must be in [0, 1) and --rate > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    base = load_config(args.config)
    requests = read_traffic(args.trace)
    if args.requests:
        requests = requests[:args.requests]
    if args.request_line:
        requests = with_request_lines(requests)
        # the trace as replayed, for `tessera analyze` (its ceiling: prefix-covered, repeat, new)
        write_traffic(args.out / "trace.jsonl", requests)
    wl = trace_workload(args.trace.stem, requests, UnitTexts(load_tokenizer(resolve(base.model)).encode_plain))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    runs = [asyncio.run(profile_system(s, base, wl, args)) for s in systems]
    (args.out / "profile.json").write_text(json.dumps({"trace": str(args.trace), "rate": args.rate,
                                                       "request_line": args.request_line, "runs": runs}, indent=1))
    print_report(runs)


if __name__ == "__main__":
    main()
