"""A run's queueing against an ideal pooled queue fed its own service times (prints, never asserts).

    python bench/queue_model.py LOG_OR_RUN_DIR [...] [--last 200] [--nodes 2] [--requests 200000] [--seed 1]

Each argument is a retrieval role's access log (``retrieval-main.log``) or a folder holding
some below it (a ``tessera bench --out`` folder: one ``logs-SYSTEM-RATE`` per run). Of each
log's last ``--last`` requests it reads the generation node's split of the first token:
``node queued`` (arrival at the node to its first engine step) and the rest up to the first
token (the node's *service time*: placement, the forward, the reply), and their arrival rate
(requests over the span of their lines). It then simulates ``--nodes`` first-come-first-served
nodes fed Poisson arrivals at that rate, each request's service drawn from the measured ones
and sent to the node that frees first (a router that knows every node's remaining work), and
prints the measured mean queueing next to the model's.

Why: a sustained rate (mean TTFT within 2x of the unloaded one) is where queueing grows to
about one service time, and in such a model that happens at the same utilisation for any
service time of the same shape. If both systems queue the same multiple of the model, the
ratio of their sustained rates is the ratio of their service times under load, however the
routing or the scheduler is tuned (docs/bench/locomo.md, "What bounds the sustained ratio").
"""

from __future__ import annotations

import argparse
import heapq
import random
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

# the access line's tail (tessera/retrieval/access_log.py): "... node queued 0.012s, first token 0.350s"
LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* ttft ([\d.]+)s .*"
                  r"node queued ([\d.]+)s, first token ([\d.]+)s")


@dataclass(frozen=True)
class Run:
    name: str
    rate: float  # arrivals per second over the requests read
    ttft: list[float]
    queued: list[float]
    service: list[float]


def read_run(path: Path, last: int) -> Run | None:
    """The last ``last`` requests of an access log that carry the node split (None: fewer than 2)."""
    rows = [m.groups() for m in map(LINE.match, path.read_text(errors="replace").splitlines()) if m][-last:]
    if len(rows) < 2:
        return None
    stamps = [datetime.strptime(r[0], "%Y-%m-%d %H:%M:%S,%f").timestamp() for r in rows]
    span = stamps[-1] - stamps[0]
    if span <= 0:
        return None
    queued = [float(r[2]) for r in rows]
    return Run(path.parent.name, (len(rows) - 1) / span, [float(r[1]) for r in rows], queued,
               [float(r[3]) - q for r, q in zip(rows, queued, strict=True)])


def pooled_wait(service: Sequence[float], rate: float, nodes: int, requests: int, seed: int) -> float:
    """Mean wait before service of ``requests`` Poisson arrivals at ``rate`` over ``nodes`` FCFS
    nodes, each sent to the node that frees first, services drawn from ``service``. The first
    tenth warms the queue up and is not counted."""
    assert rate > 0 and nodes > 0 and requests > 10 and service, (rate, nodes, requests)
    rnd = random.Random(seed)
    free = [0.0] * nodes  # when each node is next free: a heap, the earliest first
    t = total = 0.0
    skip = requests // 10
    for i in range(requests):
        t += rnd.expovariate(rate)
        start = max(t, free[0])
        heapq.heapreplace(free, start + rnd.choice(service))
        if i >= skip:
            total += start - t
    return total / (requests - skip)


def logs(paths: Sequence[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out += sorted(p.rglob("retrieval-main.log"))
        elif p.is_file():
            out.append(p)
        else:
            raise SystemExit(f"{p}: no such file or folder (give access logs or tessera bench --out folders)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("paths", type=Path, nargs="+", help="access logs, or folders searched for retrieval-main.log")
    ap.add_argument("--last", type=int, default=200, help="requests read from the end of each log (a bench run's "
                                                           "measured share)")
    ap.add_argument("--nodes", type=int, default=2, help="generation nodes of the runs")
    ap.add_argument("--requests", type=int, default=200_000, help="simulated arrivals per run")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    if args.last < 2 or args.nodes < 1 or args.requests <= 10:
        ap.error("--last must be >= 2, --nodes >= 1 and --requests > 10")
    found = 0
    for path in logs(args.paths):
        run = read_run(path, args.last)
        if run is None:
            continue
        found += 1
        svc = statistics.fmean(run.service)
        cv2 = statistics.pvariance(run.service) / svc ** 2 if svc > 0 else 0.0
        model = pooled_wait(run.service, run.rate, args.nodes, args.requests, args.seed)
        measured = statistics.fmean(run.queued)
        times = f"{measured / model:.2f}x the model" if model > 0 else "model: no queueing"
        print(f"{run.name}: {len(run.service)} requests at {run.rate:.2f} req/s, service {svc:.3f} s "
              f"(cv2 {cv2:.3f}), utilisation {run.rate * svc / args.nodes:.2f}; queued {measured:.3f} s, "
              f"pooled model {model:.3f} s ({times}); mean TTFT {statistics.fmean(run.ttft):.3f} s")
    if not found:
        print("no access log with the node split (node queued ..., first token ...) in the paths given",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
