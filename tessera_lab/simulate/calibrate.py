"""``tessera simulate --calibrate``: fit a cost model to the configured engine on this machine.

Runs the engine in process (the first generation node's settings: model, threads, batch
budget) and times, each the median of ``repeats``:

* unit prefills of n tokens from position 0 (a miss);
* extends of n tokens over a cached prefix of p tokens (a composed request's final pass,
  a chunk of a long prompt);
* decode batches of m requests at context c;
* placing a unit state of n tokens at an offset (RoPE at its real positions);
* with k - 1 more engines of the config's first host stepping in other processes (k up to
  its generation nodes, at most the cores), the unit prefills again: the median ratio to
  the lone times is ``host_slowdown[k - 1]`` (shared caches and memory bandwidth).

Every time is the step's CPU time on its thread (see :func:`_median`), so the model is the
engine's own cost whatever else the machine runs; the other roles' CPU on the same cores and
the engines' stretch inside the real cluster are measured apart, by ``--calibrate-cpu``
(:mod:`tessera_lab.simulate.hostcpu`, :mod:`tessera_lab.simulate.incluster`).

A least-squares fit of :class:`~tessera_lab.simulate.costs.CostModel`'s step formula to the
step samples gives ``base_s``, ``per_token_s``, ``per_attn_s`` and ``per_decode_s``
(clipped at 0); placement is fitted per token. Link figures are not measured here: memory
node transfers on one machine are shared-memory copies, modelled at ``link_latency_s`` and a
memcpy bandwidth measured on a state-sized tensor.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np
import torch

from tessera.config import ClusterConfig
from tessera.engines.base import EngineAdapter, Extend, UnitPrefill, load_engine
from tessera.engines.checkpoint import resolve
from tessera.engines.geometry import geometry_from_checkpoint
from tessera_lab.simulate.costs import CostModel, StepItem


@dataclass(frozen=True)
class CalibrationPlan:
    """What to measure; the defaults span the bench's batches (up to ``max_batch_tokens`` = 512)."""

    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512)
    extend: tuple[tuple[int, int], ...] = ((16, 256), (64, 512), (128, 768), (256, 256), (512, 512))
    decode: tuple[tuple[int, int], ...] = ((1, 256), (4, 256), (16, 512))
    place_tokens: tuple[int, ...] = (64, 256)
    repeats: int = 3
    request_overhead_s: float = 0.01  # HTTP hops and retrieval outside the node (stated, not measured)
    link_latency_s: float = 0.0005
    contention: bool = True  # measure host_slowdown with the host's other engines busy

    def smaller(self) -> CalibrationPlan:
        """A quick plan (tests): tiny sizes, one repeat."""
        return CalibrationPlan((8, 32), ((8, 32), (16, 16)), ((1, 16), (2, 16)), (16,), 1,
                               self.request_overhead_s, self.link_latency_s, self.contention)


def _median(fn: Callable[[], None], repeats: int) -> float:
    """Median CPU seconds of ``fn`` on this thread (a one-thread engine computes on the caller's thread).

    CPU time, not wall time: on a machine shared with other work, wall time also counts the
    time slices others took, which says nothing about the engine; CPU time does not count them.
    """
    fn()  # warm
    samples = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        samples.append(time.thread_time() - t)
    return statistics.median(samples)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source)


def _tokens(n: int, salt: int = 0) -> list[int]:
    return [(17 * i + 101 + salt) % 20000 + 100 for i in range(n)]


def _prefill_s(engine: EngineAdapter, n: int, repeats: int) -> float:
    ids = _tokens(n)
    return _median(lambda: engine.step([UnitPrefill(ids)]), repeats)


def _extend_s(engine: EngineAdapter, n: int, p: int, repeats: int) -> float:
    """``n`` new tokens over ``p`` computed ones (the same slots each time: the positions are rewritten)."""
    slots = engine.allocate(p + n)
    engine.step([Extend(slots, _tokens(p), range(p))])
    ids = _tokens(n, 7)
    t = _median(lambda: engine.step([Extend(slots, ids, range(p, p + n))]), repeats)
    engine.free(slots)
    return t


def _decode_s(engine: EngineAdapter, m: int, c: int, repeats: int) -> float:
    """One decode batch of ``m`` requests at context ``c``."""
    all_slots = [engine.allocate(c + 1) for _ in range(m)]
    for s in all_slots:
        engine.step([Extend(s, _tokens(c), range(c))])
    t = _median(lambda: engine.step([Extend(s, [123], [c]) for s in all_slots]), repeats)
    for s in all_slots:
        engine.free(s)
    return t


def measure(engine: EngineAdapter, plan: CalibrationPlan) -> list[tuple[list[StepItem], float]]:
    """Timed engine steps: (the batch as the cost model sees it, seconds)."""
    r = plan.repeats
    return ([([StepItem(n, n)], _prefill_s(engine, n, r)) for n in plan.prefill_tokens]
            + [([StepItem(n, p + n)], _extend_s(engine, n, p, r)) for n, p in plan.extend]
            + [([StepItem(1, c + 1, decode=True)] * m, _decode_s(engine, m, c, r)) for m, c in plan.decode])


def _place_s(engine: EngineAdapter, n: int, repeats: int) -> float:
    """Seconds to place a unit state of ``n`` tokens at offset 8 (RoPE at its real positions)."""
    prefill = UnitPrefill(_tokens(n, 3))
    engine.step([prefill])
    state = prefill.state
    assert state is not None
    slots = engine.allocate(n + 8)
    t = _median(lambda: engine.place(slots, 8, state), repeats)
    engine.free(slots)
    return t


def _keep_busy(config: ClusterConfig, tokens: int, ready: Any, stop: Any) -> None:
    """Another engine of the host, stepping unit prefills until told to stop (runs in its own process)."""
    engine = load_engine(config, config.generation[0].prefix_cache_tokens)
    ids = _tokens(tokens, 11)
    engine.step([UnitPrefill(ids)])
    ready.set()
    while not stop.is_set():
        engine.step([UnitPrefill(ids)])


BUSY_START_DEADLINE_S = 300.0  # a fresh interpreter loading the model on a loaded host


def _wait_ready(procs: Sequence[BaseProcess], readies: Sequence[Any]) -> None:
    """Until every busy engine says it runs; a dead or silent one stops the calibration, named."""
    deadline = time.monotonic() + BUSY_START_DEADLINE_S
    for proc, ready in zip(procs, readies, strict=True):
        while not ready.wait(0.5):
            if not proc.is_alive():
                raise RuntimeError(f"a busy engine process exited with code {proc.exitcode} before it ran")
            if time.monotonic() > deadline:
                raise RuntimeError(f"a busy engine process did not start within {BUSY_START_DEADLINE_S:.0f} s")


def host_slowdown(config: ClusterConfig, engine: EngineAdapter, plan: CalibrationPlan) -> tuple[float, ...]:
    """Step stretch with 1..k engines of the first host busy (k: its generation nodes, at most the cores)."""
    host = config.generation[0].host
    k_max = min(sum(g.host == host for g in config.generation), os.cpu_count() or 1)
    alone = [_prefill_s(engine, n, plan.repeats) for n in plan.prefill_tokens]
    out = [1.0]
    ctx = mp.get_context("spawn")
    for k in range(2, k_max + 1):
        stop = ctx.Event()
        readies = [ctx.Event() for _ in range(k - 1)]
        others = [ctx.Process(target=_keep_busy, args=(config, max(plan.prefill_tokens), r, stop), daemon=True)
                  for r in readies]
        for p in others:
            p.start()
        try:
            _wait_ready(others, readies)
            loaded = [_prefill_s(engine, n, plan.repeats) for n in plan.prefill_tokens]
        finally:
            stop.set()
            for p in others:
                p.join(60)
        out.append(statistics.median(b / a for a, b in zip(alone, loaded, strict=True)))
    return tuple(out)


def fit(samples: list[tuple[list[StepItem], float]]) -> tuple[float, float, float, float]:
    """Least squares of the step formula; coefficients clipped at 0 (then refitted without them)."""
    rows = [[1.0, sum(i.tokens for i in items), sum(i.tokens * i.context for i in items) / 1000.0,
             sum(1 for i in items if i.decode)] for items, _ in samples]
    a, y = np.array(rows), np.array([t for _, t in samples])
    keep = list(range(4))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (coef >= 0).all():
            break
        keep.pop(int(np.argmin(coef)))
    out = [0.0] * 4
    for k, c in zip(keep, coef, strict=True):
        out[k] = float(c)
    return out[0], out[1], out[2], out[3]


def calibrate(config: ClusterConfig, plan: CalibrationPlan | None = None, name: str = "calibrated") -> CostModel:
    """The fitted cost model of ``config``'s engine on this machine."""
    plan = plan or CalibrationPlan()
    node = config.generation[0]
    engine = load_engine(config, node.prefix_cache_tokens)
    samples = measure(engine, plan)
    base, per_token, per_attn, per_decode = fit(samples)
    place = [_place_s(engine, n, plan.repeats) / n for n in plan.place_tokens]
    geometry = geometry_from_checkpoint(resolve(config.model), config.kv_dtype, config.model.max_context)
    bytes_per_token = geometry.token_bytes  # what the memory node stores and a fetch moves
    copy = torch.empty(max(plan.place_tokens) * bytes_per_token, dtype=torch.uint8)
    target = torch.empty_like(copy)
    copy_s = _median(lambda: _copy(target, copy), plan.repeats)
    slowdown = host_slowdown(config, engine, plan) if plan.contention else ()
    worst = max(abs(CostModel("fit", "", base, per_token, per_attn, per_decode).step_s(items) - t) / t
                for items, t in samples)
    return CostModel(
        name=name,
        source=(f"tessera simulate --calibrate: {config.model.source} {config.model.dtype} on {config.model.device}, "
                f"{config.model.threads} thread(s), {len(samples)} step samples "
                f"(max fit error {worst:.0%}); {geometry.n_layers} layers; host slowdown with 1..k engines busy "
                f"{', '.join(f'{x:.2f}' for x in slowdown) or 'not measured'}"),
        base_s=base, per_token_s=per_token, per_attn_s=per_attn, per_decode_s=per_decode,
        place_per_token_s=statistics.median(place), kv_bytes_per_token=bytes_per_token,
        link_latency_s=plan.link_latency_s, link_bytes_per_s=copy.numel() / max(copy_s, 1e-9),
        request_overhead_s=plan.request_overhead_s, host_slowdown=slowdown,
    )
