"""The waiting room (tessera/generation/waiting.py): arrival order, one batch's worth admitted,
late starts refused, nobody left waiting."""

from __future__ import annotations

import asyncio
import time

import pytest

from tessera.errors import Overloaded
from tessera.generation.waiting import Ticket, WaitingRoom


class Queue:
    """A scheduler's queue as the room sees it: the next batch takes one prompt."""

    def __init__(self) -> None:
        self.jobs = 0
        self.batches = 0

    def full(self, prompts: int, tokens: int) -> bool:
        return self.jobs + prompts >= 1

    def take(self, room: WaitingRoom) -> None:
        """A batch takes the queued job."""
        self.jobs = 0
        self.batches += 1
        room.wake()


def room_over(queue: Queue) -> WaitingRoom:
    return WaitingRoom(queue.full, lambda: queue.batches)


async def _turn() -> None:
    """Let the loop run what is ready (a wake, then the admitted waiter through wait_for and shield)."""
    for _ in range(8):
        await asyncio.sleep(0)


async def test_requests_prepare_one_batch_at_a_time_in_arrival_order() -> None:
    queue = Queue()
    room = room_over(queue)
    first = await room.enter(10)  # nothing queued: straight in
    entered: list[int] = []

    async def wait(i: int) -> Ticket:
        ticket = await room.enter(5)
        entered.append(i)
        return ticket

    waiters = [asyncio.ensure_future(wait(i)) for i in range(3)]
    await _turn()
    assert entered == [] and room.waiting == 3 and room.tokens == 10 + 3 * 5
    first.release()
    queue.jobs = 1  # its job queued right after the release, before the loop turned
    await _turn()
    assert entered == [], "admitted while the next batch was already full"
    queue.take(room)
    await _turn()
    assert entered == [0]
    ticket = waiters[0].result()
    ticket.release()
    ticket.release()  # idempotent: one place given back
    queue.jobs = 1
    queue.take(room)
    await _turn()
    assert entered == [0, 1] and room.waiting == 1
    waiters[1].result().release()
    await _turn()
    assert entered == [0, 1, 2]  # a release without a job (the request failed) frees the place too
    waiters[2].result().release()
    assert room.waited == 3 and room.tokens == 0


async def test_a_request_past_its_deadline_is_refused_only_after_a_batch_passed_it_over() -> None:
    queue = Queue()
    room = room_over(queue)
    ahead = await room.enter(1)
    late = asyncio.ensure_future(room.enter(1, deadline_at=time.monotonic() + 0.02))
    await asyncio.sleep(0.1)
    assert not late.done(), "refused although nothing ran since it came"
    queue.jobs = 1
    queue.batches += 1  # a batch formed without it; the queue is still full
    with pytest.raises(Overloaded, match="queueing bound"):
        await asyncio.wait_for(late, 5)
    assert room.waiting == 0
    ahead.release()


async def one_in_and_two_waiting(room: WaitingRoom) -> tuple[Ticket, asyncio.Future[Ticket], asyncio.Future[Ticket]]:
    """One request admitted (its place fills the next batch) and two in line behind it."""
    ahead = await room.enter(1)
    first, second = (asyncio.ensure_future(room.enter(1)) for _ in range(2))
    await _turn()
    return ahead, first, second


async def test_a_cancelled_waiter_leaves_the_line_and_closing_fails_the_rest() -> None:
    room = room_over(Queue())
    ahead, gone, stays = await one_in_and_two_waiting(room)
    gone.cancel()
    await _turn()
    assert room.waiting == 1
    room.close(RuntimeError("generation node is shutting down"))
    with pytest.raises(RuntimeError, match="shutting down"):
        await stays
    ahead.release()
    await _turn()
    assert room.waiting == 0 and room.tokens == 0


async def test_a_waiter_admitted_as_it_is_cancelled_gives_its_place_back() -> None:
    room = room_over(Queue())
    ahead, waiter, after = await one_in_and_two_waiting(room)
    ahead.release()
    await asyncio.sleep(0)  # the release's wake runs: the waiter is admitted, not yet resumed
    waiter.cancel()
    await _turn()
    assert after.done(), "a cancelled admission kept its place"
    after.result().release()
