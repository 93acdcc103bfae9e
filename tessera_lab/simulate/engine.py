"""A simulated generation node's engine thread: the real batching rule, timed by a cost model.

Work is queued as the node's :class:`~tessera.generation.scheduler.Scheduler` queues it
(decodes, requests' extends in chunks of ``max_batch_tokens``, unit prefills) and each batch
is taken with the same :func:`~tessera.generation.batching.take_batch`. Engines on one host
(:class:`Host`) stretch each other's steps as the cost model's ``host_slowdown`` says, and
share its ``host_cores`` with the other roles' CPU work. Per-request engine
calls (placing a unit's state) run between batches, in the order they were asked, as they do
on the node's single engine thread. A step's duration is the cost model's.

This module knows nothing about plans, caches or the control plane.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from tessera.generation.batching import take_batch
from tessera_lab.simulate.costs import CostModel, StepItem
from tessera_lab.simulate.events import EventLoop

Done = Callable[[], None]


@dataclass
class Work:
    """One batch item: ``tokens`` new tokens whose last attends to ``context`` positions, plus
    the lengths of the ``units`` an extend prefills in its own forward (each from position 0)."""

    tokens: int
    context: int
    decode: bool
    done: Done
    units: tuple[int, ...] = ()

    def cancelled(self) -> bool:
        return False  # simulated clients never go away

    @property
    def group(self) -> int:
        return 0  # every simulated item is a prompt of its own

    @property
    def items(self) -> list[StepItem]:
        """What the cost model charges for it: the extend, then each unit's own prefill."""
        return [StepItem(self.tokens - sum(self.units), self.context, self.decode),
                *(StepItem(n, n) for n in self.units)]


class _Running:
    __slots__ = ("done", "engine", "remaining", "since", "version")

    def __init__(self, remaining: float, since: float, done: Done, engine: bool) -> None:
        self.remaining = remaining  # seconds of work left at full speed, as of ``since``
        self.since = since
        self.done = done
        self.engine = engine  # an engine step (else another role's CPU work)
        self.version = 0  # end events of older versions are stale


class Host:
    """The machine some nodes' engines share, and the CPU work of the roles it runs.

    With k engine steps and j other CPU jobs (:meth:`cpu`: a request's retrieval, memory
    node and event-loop work) running on a host of ``host_cores`` cores, ``host_background_cores``
    of them taken by the roles' idle work, each gets a share ``min(1, free cores / (k + j))``
    of a core (0 cores: no limit), and an engine step
    runs at ``share / host_slowdown[k - 1]`` of its speed alone (shared caches and memory
    bandwidth), a CPU job at ``share``.

    Processor sharing: when a job starts or ends and the speeds change, every running job's
    remaining work is advanced at the old speed and its end rescheduled at the new one (stale
    end events are ignored), so two jobs that overlap for part of their time are stretched
    for that part only. Without a slowdown and a core count (a GPU per node) nothing is
    ever rescheduled.
    """

    def __init__(self, loop: EventLoop, costs: CostModel) -> None:
        self.loop = loop
        self.costs = costs
        self._running: list[_Running] = []
        self.cpu_s = 0.0  # CPU seconds of other roles' work charged here (at full speed)
        self.engine_cpu_s = 0.0  # CPU seconds the engine steps took: their time on a core, stretch included
        self.engine_work_by_busy: dict[int, float] = {}  # k -> step seconds (at full speed) run while k were busy

    @property
    def busy(self) -> int:
        """Engine steps running now."""
        return sum(r.engine for r in self._running)

    def run(self, seconds: float, done: Done) -> None:
        """An engine step of ``seconds`` at full speed; ``done`` at its (stretched) end."""
        self._start(_Running(seconds, self.loop.now, done, True))

    def cpu(self, seconds: float, done: Done) -> None:
        """``seconds`` of another role's CPU work on this host; ``done`` once it has run."""
        self.cpu_s += seconds
        self._start(_Running(seconds, self.loop.now, done, False))

    def _speeds(self) -> tuple[float, float]:
        """(an engine step's speed, a CPU job's speed) with the jobs running now."""
        k = sum(r.engine for r in self._running)
        n, cores = len(self._running), self.costs.cores_free()
        share = min(1.0, cores / n) if cores > 0 and n else 1.0
        return share / self.costs.slowdown(k), share

    def _start(self, r: _Running) -> None:
        before = self._speeds()
        self._running.append(r)
        after = self._speeds()
        if after != before:
            self._reschedule(before, after)
        else:
            self._schedule(r, after)

    def _schedule(self, r: _Running, speeds: tuple[float, float]) -> None:
        r.version += 1
        self.loop.after(r.remaining / speeds[0 if r.engine else 1], partial(self._end, r, r.version))

    def _advance(self, r: _Running, speeds: tuple[float, float]) -> None:
        """``r``'s work done since ``r.since`` at ``speeds``; an engine step's CPU is its time times its core share."""
        now = self.loop.now
        done = min(r.remaining, (now - r.since) * speeds[0 if r.engine else 1])
        r.remaining -= done
        if r.engine:
            self.engine_cpu_s += (now - r.since) * speeds[1]  # speeds[1] is the core share
            k = sum(x.engine for x in self._running)
            self.engine_work_by_busy[k] = self.engine_work_by_busy.get(k, 0.0) + done
        r.since = now

    def _reschedule(self, old: tuple[float, float], new: tuple[float, float]) -> None:
        """The speeds changed: advance every job at its ``old`` speed, then schedule its end at the ``new`` one."""
        for r in self._running:
            self._advance(r, old)
            self._schedule(r, new)

    def _end(self, r: _Running, version: int) -> None:
        if version != r.version:
            return
        before = self._speeds()
        self._advance(r, before)
        self._running.remove(r)
        if self._running:
            after = self._speeds()
            if after != before:
                self._reschedule(before, after)
        r.done()


class SimEngine:
    def __init__(self, loop: EventLoop, costs: CostModel, max_batch_tokens: int, host: Host | None = None,
                 max_batch_prompts: int = 0) -> None:
        self.loop = loop
        self.costs = costs
        self.host = host or Host(loop, costs)
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_prompts = max_batch_prompts
        self._decodes: deque[Work] = deque()
        self._extends: deque[Work] = deque()
        self._prefills: deque[Work] = deque()
        self._calls: deque[tuple[float, Done]] = deque()
        self.busy = False
        self.busy_s = 0.0  # engine time spent (steps and calls): the node's utilisation
        self.steps = 0
        self._recent_tokens = 0.0  # decayed sums over batches with prompt work (the load report's speed)
        self._recent_s = 0.0

    # --- submission (the Scheduler's verbs) ----------------------------------------------

    def extend(self, tokens: int, start: int, done: Done, units: tuple[int, ...] = ()) -> None:
        """``tokens`` new tokens from position ``start``, in chunks of ``max_batch_tokens`` (chunked
        prefill); ``units``: unit lengths prefilled in the first chunk's forward (an engine that
        fuses unit prefills)."""
        step = self.max_batch_tokens
        chunks = [(s, min(step, tokens - s)) for s in range(0, tokens, step)]

        def submit(i: int) -> None:
            s, n = chunks[i]
            last = i == len(chunks) - 1
            fed = units if i == 0 else ()
            # with its own unit prefills it queues with them, as on the real node's scheduler
            (self._prefills if fed else self._extends).append(
                Work(n + sum(fed), start + s + n, False, done if last else lambda: submit(i + 1), fed))
            self._wake()

        submit(0)

    def prefill_unit(self, tokens: int, done: Done) -> None:
        self._prefills.append(Work(tokens, tokens, False, done))
        self._wake()

    def decode(self, position: int, done: Done) -> None:
        self._decodes.append(Work(1, position + 1, True, done))
        self._wake()

    def call(self, seconds: float, done: Done) -> None:
        """A per-request engine call (placing a unit's state): runs between batches, FIFO."""
        self._calls.append((seconds, done))
        self._wake()

    @property
    def queued_tokens(self) -> int:
        return sum(w.tokens for w in self._extends) + sum(w.tokens for w in self._prefills) + len(self._decodes)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._recent_tokens / self._recent_s if self._recent_s > 0 else 0.0

    # --- the loop ------------------------------------------------------------------------

    def _wake(self) -> None:
        if not self.busy:
            self.busy = True
            self.loop.after(0.0, self._next)

    def _next(self) -> None:
        if self._calls:
            seconds, done = self._calls.popleft()
            self.busy_s += seconds
            self.loop.after(seconds, lambda: self._finish_call(done))
            return
        batch = take_batch(self._decodes, self._extends, self._prefills, self.max_batch_tokens,
                           self.max_batch_prompts)
        if not batch:
            self.busy = False
            return
        seconds = self.costs.step_s(item for w in batch for item in w.items)
        self.steps += 1
        # engines sharing a host's cores and memory bandwidth slow each other (CPU nodes)
        self.host.run(seconds, partial(self._finish_batch, batch, self.loop.now))

    def _finish_call(self, done: Done) -> None:
        done()
        self._next()

    def _finish_batch(self, batch: list[Work], started: float) -> None:
        seconds = self.loop.now - started
        self.busy_s += seconds
        if not all(w.decode for w in batch):
            self._recent_tokens = 0.8 * self._recent_tokens + sum(w.tokens for w in batch)  # units included
            self._recent_s = 0.8 * self._recent_s + seconds
        for w in batch:
            w.done()
        self._next()

