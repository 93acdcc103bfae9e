"""Control-plane throughput and plan latency, in process, on one core.

Each request retrieves 10 distinct units drawn from a Zipf popularity over a unit universe.
The cluster is :class:`tessera.control.simulated.SimulatedCluster`, the one the plane tests
drive: the real control plane on a simulated clock, generation nodes that reported in (a
node is routable only once heard) and follow their plans exactly (drop ``local_evict``,
insert what is retained locally as far as their capacity allows, publish their grants,
release their leases, send the ResidencyReport). A fixed number of requests stay in flight.
The first 10% of requests (cold start) are not counted.

Measured per request: route + finalize + complete, in process (the plan latency);
"plans/s" is requests / sum of plan latencies. The whole-loop rate also counts the
simulated node traffic (snapshot, publish, release, residency report). The latency max
includes any cyclic-GC collection that lands in a measured step.

    PYTHONPATH=. flock /tmp/tessera-cpu.lock python bench/control_plane.py [--requests N] [--nodes N] [--units U]

Instructions per plan (stable where seconds are not, on a shared machine): ``--callgrind``
calls the measured steps of the warm requests through ``operator.call``, so callgrind,
told to count only inside that C function, counts exactly route + finalize + complete:

    PYTHONPATH=. valgrind --tool=callgrind --collect-atstart=no --toggle-collect=_operator_call \
        --callgrind-out-file=/tmp/cp.out python bench/control_plane.py --requests 5000 --callgrind
    callgrind_annotate /tmp/cp.out | head   # "PROGRAM TOTALS" Ir / the warm requests printed

Garbage collections during the loop are timed (``gc.callbacks``: wall and CPU time) and
reported per generation: a full collection scans every tracked object not frozen before the
loop (the setup and the workload are frozen, as a role freezes what it loaded at start-up).
After the loop the bench counts those objects and times one full collection: the pause the
loop's own state would cost whenever a full collection comes.

Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import operator
import os
import time
from collections import deque
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import numpy as np

from tessera.config import ClusterConfig, ControlConfig, GenerationNodeConfig, KVPoolNodeConfig
from tessera.control.simulated import SimulatedCluster


def build(args: argparse.Namespace) -> SimulatedCluster:
    gens = tuple(GenerationNodeConfig(f"gen{i}", port=9600 + i, local_capacity_blocks=args.local_blocks)
                 for i in range(args.nodes))
    pools = (KVPoolNodeConfig("kv0", port=9500, data_port=9501, capacity_blocks=args.shared_blocks),)
    control = ControlConfig(admission=args.admission, routing=args.routing, assist_min_tokens=args.assist_min_tokens)
    return SimulatedCluster(ClusterConfig(block_tokens=16, control=control, kvpools=pools, generation=gens))


def workload(args: argparse.Namespace) -> tuple[list[list[tuple[str, int]]], list[str]]:
    rng = np.random.default_rng(args.seed)
    ranks = np.arange(1, args.units + 1, dtype=np.float64)
    p = ranks ** -args.zipf
    p /= p.sum()
    sizes = rng.integers(48, 257, size=args.units)
    names = [f"{i:032x}" for i in range(args.units)]
    # oversample, then keep the first per_request distinct draws of each request
    draws = rng.choice(args.units, size=(args.requests, args.per_request * 4), p=p).tolist()
    requests = []
    for row in draws:
        picks = list(dict.fromkeys(row))
        while len(picks) < args.per_request:
            picks = list(dict.fromkeys(picks + rng.choice(args.units, size=args.per_request, p=p).tolist()))
        requests.append([(names[u], int(sizes[u])) for u in picks[: args.per_request]])
    return requests, [f"r{i}" for i in range(args.requests)]


P = ParamSpec("P")
R = TypeVar("R")


def counted(f: Callable[P, R]) -> Callable[P, R]:
    """``f`` called through ``operator.call``: the C function callgrind is told to count inside."""
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        return operator.call(f, *args, **kwargs)
    return call


class GcTimes:
    """Each cyclic-GC collection by generation: wall time, and this thread's CPU time (a
    ``gc.callbacks`` hook). On a shared machine the wall time of a collection includes any
    preemption that hit it; the CPU time is the collection's own work."""

    def __init__(self) -> None:
        self.wall: dict[int, list[int]] = {0: [], 1: [], 2: []}
        self.cpu: dict[int, list[int]] = {0: [], 1: [], 2: []}
        self._start = self._start_cpu = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start, self._start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        else:
            g = info["generation"]
            self.cpu[g].append(time.thread_time_ns() - self._start_cpu)
            self.wall[g].append(time.perf_counter_ns() - self._start)

    def line(self, elapsed_s: float) -> str:
        total = sum(sum(p) for p in self.wall.values()) / 1e9
        return ", ".join(f"gen{g} {len(p)} (max {max(p, default=0) / 1e6:.2f} ms, "
                         f"cpu max {max(self.cpu[g], default=0) / 1e6:.2f} ms)"
                         for g, p in self.wall.items()) + f"; {total:.2f} s of the loop's {elapsed_s:.2f} s"


def full_collection() -> str:
    """What a full collection would cost now: the objects it scans (all tracked, not frozen) and its time."""
    tracked = len(gc.get_objects())  # the permanent (frozen) generation is not among them
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    gc.collect()
    c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
    return f"{tracked:,} tracked objects not frozen; a full collection takes {(t1 - t0) / 1e6:.2f} ms " \
           f"(cpu {(c1 - c0) / 1e6:.2f} ms)"


def run(args: argparse.Namespace) -> None:
    cluster = build(args)
    plane = cluster.plane
    requests, rids = workload(args)
    inflight: deque[str] = deque()
    lat = np.empty(len(requests), dtype=np.int64)
    pc = time.perf_counter_ns
    cold = len(requests) // 10  # the cold start: not counted
    route, finalize, complete = plane.route, plane.finalize, plane.complete
    digest = hashlib.sha256() if args.digest else None
    gc.collect()
    gc.freeze()
    gc_times = GcTimes()
    gc.callbacks.append(gc_times)
    start = pc()
    for i, (rid, units) in enumerate(zip(rids, requests, strict=True)):
        if args.callgrind and i == cold:  # from here on, callgrind counts inside operator.call only
            route, finalize, complete = counted(plane.route), counted(plane.finalize), counted(plane.complete)
        t0 = pc()
        node = route(rid, units)
        t1 = pc()
        held = cluster.snapshot(node, units)
        t2 = pc()
        plan = finalize(rid, node, held)
        t3 = pc()
        if digest is not None:  # outside the timed steps
            digest.update(repr(plan).encode())
        cluster.execute(plan, complete=False)
        inflight.append(rid)
        t4 = pc()
        if len(inflight) > args.inflight:
            complete(inflight.popleft())
        t5 = pc()
        lat[i] = (t1 - t0) + (t3 - t2) + (t5 - t4)
    elapsed = (pc() - start) / 1e9
    gc.callbacks.remove(gc_times)
    del plan
    after = full_collection()  # the plane's own heap, grown by the loop (the setup is frozen)
    while inflight:
        plane.complete(inflight.popleft())
    gc.unfreeze()
    warm = lat[cold:]
    s = plane.stats
    print(f"control plane: {args.nodes} generation nodes, {args.per_request} units/request, "
          f"{args.units} units Zipf({args.zipf}), admission={args.admission}, routing={args.routing}, "
          f"{args.inflight} in flight, cpu={sorted(os.sched_getaffinity(0))}")
    print(f"  plans/s (route+finalize+complete only): {len(warm) / (warm.sum() / 1e9):,.0f}")
    print(f"  plans/s (whole loop incl. simulated node traffic): {len(requests) / elapsed:,.0f}")
    print(f"  plan latency p50 {np.percentile(warm, 50) / 1e3:.1f} us, p99 {np.percentile(warm, 99) / 1e3:.1f} us, "
          f"max {warm.max() / 1e3:.1f} us")
    print(f"  GC collections in the loop: {gc_times.line(elapsed)}")
    print(f"  after the loop: {after}")
    if digest is not None:
        print(f"  plan digest (sha256 of every plan's repr, in order): {digest.hexdigest()}")
    if args.callgrind:
        print(f"  callgrind: measured steps of {len(warm)} warm requests (divide the collected Ir by this)")
    print(f"  preparations: local {s.local / s.units:.1%}, remote {s.remote / s.units:.1%}, "
          f"compute {s.compute / s.units:.1%}; retained local {s.keep_local}, shared {s.keep_shared}, "
          f"local evictions {s.local_evictions}, shared evictions {plane.shared.evictions}")
    loads = [len(c) for c in cluster.caches.values()]
    shown = loads if len(loads) <= 16 else f"min {min(loads)}, median {int(np.median(loads))}, max {max(loads)}"
    print(f"  local cache units per node: {shown}; shared entries {len(plane.directory)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--units", type=int, default=20_000, help="unit universe size")
    ap.add_argument("--per-request", type=int, default=10)
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of unit popularity")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--inflight", type=int, default=32, help="requests kept in flight")
    ap.add_argument("--local-blocks", type=int, default=4096, help="local capacity per node (blocks)")
    ap.add_argument("--shared-blocks", type=int, default=32768)
    ap.add_argument("--admission", default="demand")
    ap.add_argument("--routing", default="cache_aware")
    ap.add_argument("--assist-min-tokens", type=int, default=ControlConfig.assist_min_tokens,
                    help="control.assist_min_tokens (0: plans without assists)")
    ap.add_argument("--cpu", type=int, default=0, help="pin to this core (one core)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--callgrind", action="store_true",
                    help="call the warm requests' measured steps through operator.call (see the docstring)")
    ap.add_argument("--digest", action="store_true",
                    help="print a hash of every plan the loop issues (decisions unchanged across code changes)")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    run(args)


if __name__ == "__main__":
    main()
