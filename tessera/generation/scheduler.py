"""Continuous batching over one engine, plus the engine's single worker thread.

Every engine call runs on one dedicated thread (:class:`EngineWorker`), so the event loop
keeps serving HTTP, transfers and other requests while a forward pass runs. The
:class:`Scheduler` loop is the node's step, in the spirit of nano-vllm's six lines:

    batch = take pending decodes + extend work up to the token budget
    run the batch as ONE engine.step()
    resolve each item's future

Unit prefills (internal requests for missing units) and requests' final extends join the
same batches, the extends first (a request whose units are ready is one step from its first
token); a request that waits for its unit states is simply not in the queue yet, so
it never blocks anyone. An extend that prefills its own missing units (an engine that
``fuses_unit_prefills``) queues with the unit prefills, not before them.

Late starts: a request may carry a :class:`StartDeadline`, what was left of
``control.max_queue_wait_s`` when its plan was sent. If none of its work has begun when the
deadline passes and the engine has meanwhile formed a batch without it, it is refused with
``Overloaded`` before it costs a step. The plane's admission only estimates queueing; this
check holds the bound where the estimate was wrong. A request whose work has begun is never
refused for time.

The waiting room (:mod:`tessera.generation.waiting`): a request with units to compute waits
in arrival order until its work would go into the next batch, and only then decides how to
get them; its waiting work counts in ``queued_tokens``, so load reports and routing see it.

The scheduler is the executor's only way to the engine; every call runs on the engine thread.

Hops: every awaited engine call queues behind the running forward, so each call a request
makes before its extend can cost it a whole forward under load. So a request makes one:
``begin`` takes the slots and matches the prefix; the unit states it gathers ride on the
extend (``extend(place=...)``) and are placed right before the batch's forward. A state
that cannot be placed fails only its own request's extend (:class:`UnplacedUnits`), and the
request computes that unit instead. The prefix-cache insert rides on the extend too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tessera.composition.layout import Placement
from tessera.engines.base import EngineAdapter, Extend, KVSlots, UnitFeed, UnitPrefill, UnitState
from tessera.engines.offline import place_units
from tessera.errors import Overloaded, PlacementError
from tessera.generation.batching import take_batch
from tessera.generation.waiting import Ticket, WaitingRoom
from tessera.generation.work import FirstTokenWork

log = logging.getLogger(__name__)
T = TypeVar("T")
ENGINE_THREAD = "tessera-engine"  # the engine thread's OS name (/proc/PID/task/TID/comm, at most 15 bytes)


def _name_os_thread() -> None:
    """Give the calling thread the OS name :data:`ENGINE_THREAD` (Linux; elsewhere nothing).

    Python's thread names stay inside Python; the OS name is what ``top -H`` and
    ``tessera simulate --calibrate-cpu`` see, which tells the engine's CPU from the rest of
    the node's (its event loop, copies, checksums)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, ENGINE_THREAD.encode(), 0, 0, 0)  # PR_SET_NAME


class EngineWorker:
    """The one thread that may touch the engine."""

    def __init__(self, engine: EngineAdapter) -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine", initializer=self._first)
        # the engine thread's CPU and wall seconds by call (step, place_units, match_prefix, ...):
        # what a node's engine time goes to, and how much of it waits (for a core, for the GIL),
        # for /metrics; written on the engine thread only
        self.cpu_s: dict[str, float] = {}
        self.wall_s: dict[str, float] = {}

    def _first(self) -> None:
        """On the engine thread, before its first call: its OS name, then the engine's own set-up
        of the thread that runs its forwards (:meth:`EngineAdapter.on_engine_thread`)."""
        _name_os_thread()
        self.engine.on_engine_thread()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn(*args)`` on the engine thread now (calls run in the order submitted)."""
        return asyncio.get_running_loop().run_in_executor(self._pool, self.timed, getattr(fn, "__name__", "call"),
                                                          fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the engine thread, not timed as a whole: ``fn`` times its engine
        calls itself (:meth:`timed`), so each is counted under its own name."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def timed(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        """On the engine thread: ``fn(*args)``, its CPU and wall time counted under ``name``."""
        t, w = time.thread_time(), time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + time.thread_time() - t
            self.wall_s[name] = self.wall_s.get(name, 0.0) + time.perf_counter() - w

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@dataclass(slots=True)
class StartDeadline:
    """When a request's first engine step must begin (``time.monotonic()``); shared by its jobs."""

    at: float
    started_at: float | None = None  # time.monotonic() when one of its jobs entered a batch (queueing ended)

    @property
    def started(self) -> bool:
        """One of its jobs entered a batch: it is no longer queued."""
        return self.started_at is not None


class UnplacedUnits(Exception):
    """Reused unit states that an extend's batch could not place (unit id -> the engine's
    :class:`PlacementError`). The extend did not run; every other state it carried is in place."""

    def __init__(self, failed: dict[str, PlacementError]) -> None:
        super().__init__(", ".join(f"{uid}: {exc}" for uid, exc in failed.items()))
        self.failed = failed


# reused unit states an extend places before its forward: unit id -> (its spans, its state)
Placing = Mapping[str, tuple[Sequence[Placement], UnitState]]


@dataclass
class _Job:
    item: UnitPrefill | Extend
    future: asyncio.Future[Any]
    decode: bool
    deadline: StartDeadline | None = None
    batches_at_submit: int = 0  # batches formed before it was queued (late starts)
    # (token ids, namespace): the prefix to insert into the engine's prefix cache from this
    # extend's slots once its step has run, before the next batch (see Scheduler._loop)
    insert_prefix: tuple[Sequence[int], str] | None = None
    place: Placing | None = None  # placed into the extend's slots right before its batch's forward
    group: int = 0  # nonzero: unit prefills queued together that count as one prompt (batching)

    @property
    def tokens(self) -> int:
        return len(self.item.token_ids) if isinstance(self.item, UnitPrefill) else self.item.n_computed

    def cancelled(self) -> bool:
        """Its requester went away (client disconnected): the batch drops it."""
        return self.future.cancelled()


class Scheduler:
    """Queues extend/decode work and runs it in batches on the engine worker."""

    def __init__(self, engine: EngineAdapter, max_batch_tokens: int, max_batch_prompts: int = 0) -> None:
        self.engine = engine
        self.worker = EngineWorker(engine)
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_prompts = max_batch_prompts
        self._extends: deque[_Job] = deque()  # requests' prompt extends (chunks of them)
        self._prefills: deque[_Job] = deque()  # unit prefills (internal requests)
        self._decodes: deque[_Job] = deque()
        self._groups = 0  # the last group id handed out (new_group)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0  # batches run: the idle memory trim tells spells of work apart by it
        self.prompt_batches = 0  # batches run with prompt work: heartbeats show the queue moving
        # prefill throughput over recent batches with extend work (decayed sums: tokens, seconds)
        self._prefill_tokens = 0.0
        self._prefill_s = 0.0
        self.work = FirstTokenWork()  # the executor reports each request's work to its first token
        self.batches = 0  # batches formed (late starts: was a job passed over?)
        self.late_refused = 0  # requests' jobs refused because their work could not start in time
        # requests with units to compute wait here for the next batch (tessera.generation.waiting)
        self.room = WaitingRoom(self._next_batch_full, lambda: self.batches)

    # --- submission ----------------------------------------------------------------------

    def deadline(self, budget_s: float | None) -> StartDeadline:
        """A start deadline ``budget_s`` from now, less the node's measured excess work under load
        (:mod:`tessera.generation.work`), so the queueing it allows and the slower work that
        follows still fit the promise (None: the request has no queueing bound, and the
        deadline only records when its work began)."""
        if budget_s is None:
            return StartDeadline(float("inf"))
        return StartDeadline(time.monotonic() + max(0.0, budget_s - self.work.excess_s()))

    def _submit(self, item: UnitPrefill | Extend, decode: bool, deadline: StartDeadline | None = None,
                insert_prefix: tuple[Sequence[int], str] | None = None,
                place: Placing | None = None, group: int = 0) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # an extend that still prefills a unit queues with the unit prefills, behind requests
        # whose units are all ready: as when the unit was a prefill of its own, a ready request
        # never waits behind another's missing unit (on CPU a batch shares little, and a
        # member waits for all of it)
        missing = isinstance(item, UnitPrefill) or bool(item.units)
        queue = self._decodes if decode else self._prefills if missing else self._extends
        queue.append(_Job(item, future, decode, deadline, self.batches, insert_prefix, place, group))
        self._wake.set()
        return future

    async def turn(self, tokens: int, deadline: StartDeadline | None = None) -> Ticket:
        """Wait until work of ``tokens`` tokens would go into the next batch (the waiting room);
        release the ticket once the request's job is queued, or when it fails. Raises
        ``Overloaded`` for a late start (above)."""
        try:
            return await self.room.enter(tokens, float("inf") if deadline is None else deadline.at)
        except Overloaded:
            self.late_refused += 1
            raise

    def _next_batch_full(self, prompts: int, tokens: int) -> bool:
        """Whether the queued prompt work, plus ``prompts`` items of ``tokens`` tokens about to
        be queued, fills the next batch (:func:`take_batch`'s budget)."""
        queued = len(self._extends) + len(self._prefills) + prompts
        if self.max_batch_prompts and queued >= self.max_batch_prompts:
            return True
        return self._prompt_tokens() + tokens >= self.max_batch_tokens

    def _prompt_tokens(self) -> int:
        """Tokens of the queued extends and unit prefills."""
        return sum(j.tokens for j in self._extends) + sum(j.tokens for j in self._prefills)

    async def prefill_unit(self, token_ids: Sequence[int], deadline: StartDeadline | None = None,
                           group: int = 0) -> UnitState:
        """Independent prefill of one unit from position 0 (an internal request); ``deadline``:
        the requesting request's (late starts); ``group`` (:meth:`new_group`): prefills queued
        together under it share one batch (:func:`take_batch`)."""
        state: UnitState = await self._submit(UnitPrefill(token_ids), decode=False, deadline=deadline, group=group)
        return state

    def new_group(self) -> int:
        """A group id for unit prefills that one caller queues together."""
        self._groups += 1
        return self._groups

    @property
    def fuses_unit_prefills(self) -> bool:
        """The engine prefills a request's missing units inside its extend (``extend(units=...)``)."""
        return self.engine.fuses_unit_prefills

    async def extend(self, slots: KVSlots, token_ids: Sequence[int], positions: Sequence[int],
                     deadline: StartDeadline | None = None, units: Sequence[UnitFeed] = (),
                     insert_prefix: tuple[Sequence[int], str] | None = None,
                     place: Placing | None = None) -> torch.Tensor:
        """Compute tokens at positions (ascending) over the request's slots; logits of the last position.

        ``place`` (unit id -> (spans, state)): reused states placed into the slots on the engine
        thread right before the (first chunk's) forward, instead of in calls of their own (see
        Hops above). If any of them cannot be placed, the extend does not run and raises
        :class:`UnplacedUnits`; the others are in place then.

        ``insert_prefix`` ((token ids, namespace)): once the (last chunk's) step has run, insert
        that prefix of the slots into the engine's prefix cache, on the engine thread before the
        next batch; as a call of its own it would queue behind the next batch and delay the
        first token by a whole forward under load. A failed insert is logged: it only costs
        later hits.

        ``units`` (an engine that :attr:`fuses_unit_prefills` only): units prefilled in the same
        forward as the first chunk and placed into the slots before its tokens attend; their
        states are in each :class:`UnitFeed` when this returns.

        With a ``deadline`` it raises ``Overloaded`` instead if the request is refused as a
        late start (above).

        A prompt longer than ``max_batch_tokens`` runs in chunks of that size, one batch each
        (chunked prefill): as one item, a ~7,000-token prompt held every other request's next
        token for its whole minute of prefill. Each chunk attends to the slots the chunks
        before it filled, so the result is the same computation in pieces.
        """
        step = self.max_batch_tokens
        assert len(token_ids) == len(positions) > 0, (len(token_ids), len(positions))
        logits: torch.Tensor | None = None
        assert not units or self.fuses_unit_prefills, "this engine does not prefill units inside an extend"
        for start in range(0, len(token_ids), step):
            chunk = Extend(slots, token_ids[start:start + step], positions[start:start + step],
                           units=units if start == 0 else ())
            last = start + step >= len(token_ids)
            logits = await self._submit(chunk, decode=False, deadline=deadline,
                                        insert_prefix=insert_prefix if last else None,
                                        place=place if start == 0 else None)
        assert logits is not None
        return logits

    async def decode(self, slots: KVSlots, token_id: int, position: int) -> torch.Tensor:
        logits: torch.Tensor = await self._submit(Extend(slots, [token_id], [position]), decode=True)
        return logits

    # --- per-request engine calls (on the engine thread, outside the batches) -------------

    async def begin(self, n_slots: int, lead: Sequence[int], namespace: str = "") -> tuple[KVSlots, int]:
        """A request's slots, and how many of ``lead``'s tokens the exact prefix cache copied into
        them, in one engine call (see Hops above). If the match fails the slots are freed."""
        return await self.worker.run(self._begin, n_slots, lead, namespace)

    def _begin(self, n_slots: int, lead: Sequence[int], namespace: str) -> tuple[KVSlots, int]:
        slots = self.worker.timed("allocate", self.engine.allocate, n_slots)
        if not lead:
            return slots, 0
        try:
            return slots, self.worker.timed("match_prefix", self.engine.match_prefix, slots, lead, namespace)
        except BaseException:
            self.engine.free(slots)
            raise

    async def free(self, slots: KVSlots) -> None:
        await self.worker.call(self.engine.free, slots)

    async def place(self, slots: KVSlots, spans: Sequence[Placement], states: dict[str, UnitState]) -> None:
        await self.worker.call(place_units, self.engine, slots, spans, states)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of generated tokens (the tokenizer only; safe beside a running forward)."""
        return self.engine.decode_tokens(token_ids)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens queued for the engine or waiting for their turn, plus pending decodes."""
        return self._prompt_tokens() + len(self._decodes) + self.room.tokens

    @property
    def prefill_tokens_per_s(self) -> float:
        """Tokens per second of the recent batches that computed prompts (0 until one ran)."""
        return self._prefill_tokens / self._prefill_s if self._prefill_s > 0 else 0.0

    def _measure(self, batch: list[_Job], seconds: float) -> None:
        """One batch's speed; only batches with prompt work count (a decode-only step is not a prefill)."""
        if all(j.decode for j in batch):
            return
        self.prompt_batches += 1
        self._prefill_tokens = 0.8 * self._prefill_tokens + sum(j.tokens for j in batch)
        self._prefill_s = 0.8 * self._prefill_s + seconds

    # --- the loop ------------------------------------------------------------------------

    def start(self) -> None:
        assert self._task is None
        self._task = asyncio.create_task(self._loop(), name="scheduler")

    async def stop(self) -> None:
        """Stop the loop, fail the work still queued, then shut the engine thread down."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for job in (*self._extends, *self._prefills, *self._decodes):
            if not job.future.done():
                job.future.set_exception(RuntimeError("generation node is shutting down"))
        self.room.close(RuntimeError("generation node is shutting down"))
        self._extends.clear()
        self._prefills.clear()
        self._decodes.clear()
        self.worker.close()

    def _next_batch(self) -> list[_Job]:
        now = time.monotonic()
        for queue in (self._extends, self._prefills):
            if any(self._late(j, now) for j in queue):
                self._refuse_late(queue, now)
        batch = take_batch(self._decodes, self._extends, self._prefills, self.max_batch_tokens,
                           self.max_batch_prompts)
        if batch:
            self.batches += 1
            for job in batch:
                d = job.deadline
                if d is not None and not d.started:
                    d.started_at = now
        self.room.wake()  # the queue is shorter: the next requests in line prepare now
        return batch

    def _late(self, job: _Job, now: float) -> bool:
        """Queued past its request's start deadline, none of the request's work begun, and
        passed over by a batch formed since it was queued."""
        d = job.deadline
        return (d is not None and not d.started and now > d.at and self.batches > job.batches_at_submit
                and not job.future.done())

    def _refuse_late(self, queue: deque[_Job], now: float) -> None:
        kept: deque[_Job] = deque()
        for job in queue:
            if not self._late(job, now):
                kept.append(job)
                continue
            assert job.deadline is not None
            self.late_refused += 1
            late = now - job.deadline.at
            job.future.set_exception(Overloaded(
                f"the request's work could not start within its queueing bound (control.max_queue_wait_s): "
                f"{late:.1f}s past it behind earlier work; retry later", retry_after_s=max(1.0, late)))
        queue.clear()
        queue.extend(kept)

    async def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = time.perf_counter()
            try:
                unplaced = await self.worker.run(self._run_batch, batch)
            except Exception as exc:
                log.exception("engine step failed for a batch of %d items", len(batch))
                for j in batch:
                    if not j.future.done():
                        j.future.set_exception(exc)
                continue
            self._measure(batch, time.perf_counter() - t0)
            self.steps += 1
            for i, failed in unplaced.items():
                if not batch[i].future.done():
                    batch[i].future.set_exception(failed)
            # prefix inserts are queued on the engine thread before any result is set: a woken
            # request's later calls (its free) run after them, and they run while its first
            # token goes out, before the next batch (which waits for them below)
            inserts = [(len(j.insert_prefix[0]), self.worker.submit(self.engine.insert_prefix, j.item.slots,
                                                                    *j.insert_prefix))
                       for j in batch
                       if j.insert_prefix is not None and isinstance(j.item, Extend) and not j.future.done()]
            for j in batch:
                if j.future.done():
                    continue
                if isinstance(j.item, UnitPrefill):
                    j.future.set_result(j.item.state)
                else:
                    j.future.set_result(j.item.logits)
            for n_tokens, insert in inserts:
                try:
                    await insert
                except Exception:
                    log.exception("prefix cache insert of %d tokens failed; later requests only miss it", n_tokens)

    def _run_batch(self, batch: list[_Job]) -> dict[int, Exception]:
        """On the engine thread: place the states the batch's extends carry, then run ONE
        engine step over every item whose states all went in. Returns the extends left out
        (index in the batch -> :class:`UnplacedUnits`, or the error placing raised)."""
        unplaced: dict[int, Exception] = {}
        for i, job in enumerate(batch):
            if job.place and isinstance(job.item, Extend):
                try:
                    failed = self.worker.timed("place_units", self._place, job.item.slots, job.place)
                except Exception as exc:  # a bug, not a state the engine refused: only its request fails
                    log.exception("placing the unit states of one extend failed")
                    unplaced[i] = exc
                    continue
                if failed:
                    unplaced[i] = UnplacedUnits(failed)
        items = [j.item for i, j in enumerate(batch) if i not in unplaced]
        if items:
            self.worker.timed("step", self.engine.step, items)
        return unplaced

    def _place(self, slots: KVSlots, placing: Placing) -> dict[str, PlacementError]:
        failed = {}
        for uid, (spans, state) in placing.items():
            try:
                place_units(self.engine, slots, spans, {uid: state})
            except PlacementError as exc:
                failed[uid] = exc
        return failed
