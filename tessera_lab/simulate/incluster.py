"""The engine steps' stretch inside the real cluster, fitted to its measured engine CPU.

``tessera simulate --calibrate`` times each step alone, with at most a synthetic co-runner;
``--calibrate-cpu`` (:mod:`tessera_lab.simulate.hostcpu`) measures what the engine threads of a
real cluster spent per request. This module replays the same runs in the simulator (same
config, workload, rates, seeds, warm-up) and fits ``host_slowdown`` so the two agree:

    measured engine CPU per request  =  (W1 × s1 + W2 × s2 + ...) / requests

where ``Wk`` is the step work (seconds at the calibrated speed) the simulation ran while k
engines of the host were busy, and ``sk = host_slowdown[k - 1]``. The ``Wk`` depend on the
slowdowns themselves (slower steps overlap more), so the fit is repeated on a new replay
until it settles. Least squares over the runs; every ``sk`` at least 1.

This module knows nothing about how the measured figures were taken.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tessera.config import ClusterConfig
from tessera_lab.simulate.costs import CostModel
from tessera_lab.simulate.run import SimOptions, simulate_run
from tessera_lab.simulate.workload import SimRequest

ROUNDS = 4  # replays of the fit: each refits on the overlap the previous slowdowns produce


def measured_work(config: ClusterConfig, costs: CostModel, requests: Sequence[SimRequest], rate: float,
                  warmup_frac: float, seed: int) -> dict[int, float]:
    """Step work by busy engines (k -> seconds) of the measured share of one replayed run.

    The warm-up is replayed alone and subtracted: the simulation is deterministic and the
    measured share starts once the warm-up has drained, as in the real run."""
    split = int(len(requests) * warmup_frac)
    full = simulate_run(config, costs, requests, rate, SimOptions(["tessera"], [rate], warmup_frac=warmup_frac,
                                                                   seed=seed))
    warm = simulate_run(config, costs, requests[:split], rate, SimOptions(["tessera"], [rate], warmup_frac=0.0,
                                                                          seed=seed))
    out: dict[int, float] = {}
    for run, sign in ((full, 1.0), (warm, -1.0)):
        for host in run.cluster.hosts.values():
            for k, w in host.engine_work_by_busy.items():
                out[k] = out.get(k, 0.0) + sign * w
    return out


def fit_host_slowdown(config: ClusterConfig, costs: CostModel, requests: Sequence[SimRequest],
                      runs: Sequence[dict[str, Any]], warmup_frac: float, seed: int) -> tuple[float, ...]:
    """``host_slowdown`` such that the replayed runs' engine CPU per request is the measured one."""
    engines = max(sum(g.host == h for g in config.generation) for h in {g.host for g in config.generation})
    slowdown = tuple(costs.host_slowdown[:engines]) or (1.0,) * engines
    slowdown += (slowdown[-1],) * (engines - len(slowdown))
    for _ in range(ROUNDS):
        model = dataclasses.replace(costs, host_slowdown=slowdown)
        rows, y = [], []
        for r in runs:
            work = measured_work(config, model, requests, r["rate"], warmup_frac, seed)
            rows.append([work.get(k, 0.0) / r["requests"] for k in range(1, engines + 1)])
            y.append(sum(v["engine_s"] for v in r["by_role"].values()))
        a, b = np.array(rows), np.array(y)
        used = [k for k in range(engines) if a[:, k].any()]
        coef, *_ = np.linalg.lstsq(a[:, used], b, rcond=None)
        fitted = list(slowdown)
        for k, c in zip(used, coef, strict=True):
            fitted[k] = max(1.0, float(c))
        slowdown = tuple(round(x, 4) for x in fitted)
    return slowdown
