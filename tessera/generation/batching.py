"""The continuous-batching rule of a generation node, as a pure function over its queues.

:func:`take_batch` is what the node's :class:`~tessera.generation.scheduler.Scheduler` runs
before every engine step, and what ``tessera simulate``'s simulated nodes run on a simulated
clock, so the two batch alike by construction:

    every pending decode (one token each), then
    requests' own extends, then unit prefills, in arrival order, while the token budget
    lasts and at most ``max_prompts`` of them (``generation.max_batch_prompts``; 0: no cap);
    an item larger than the budget still runs, alone with the decodes. Items queued one after
    another with the same nonzero ``group`` (the units one request, or one assist, prefills
    apart) count as one prompt: each forward has a fixed cost, and they are waited for together.

This module knows nothing about engines, futures or time.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, TypeVar


class Queued(Protocol):
    """One queued piece of work: its new tokens, whether it is a decode, whether it was dropped."""

    @property
    def tokens(self) -> int: ...

    @property
    def decode(self) -> bool: ...

    def cancelled(self) -> bool: ...

    @property
    def group(self) -> int:
        """Nonzero: items of one group, queued together, count as one prompt (module docstring)."""
        ...


J = TypeVar("J", bound=Queued)


def take_batch(decodes: deque[J], extends: deque[J], prefills: deque[J], max_batch_tokens: int,
               max_prompts: int = 0) -> list[J]:
    """Pop the next batch off the three queues (decodes are all taken; cancelled work is dropped).

    ``max_prompts`` (0: no limit) caps the extends and unit prefills one batch takes."""
    batch = [j for j in decodes if not j.cancelled()]
    decodes.clear()
    budget = max_batch_tokens - len(batch)
    prompts = 0
    last_group = 0
    # requests' own extends (their first token is next) before unit prefills: a request
    # whose units are ready must not wait behind the unit prefills of every request that
    # arrived after it (that made first tokens come late and in bursts under load)
    for queue in (extends, prefills):
        while queue:
            job = queue[0]
            if job.cancelled():
                queue.popleft()
                continue
            joins = job.group != 0 and job.group == last_group
            if prompts and (job.tokens > budget or (prompts == max_prompts and not joins)):
                return batch
            batch.append(queue.popleft())
            budget -= job.tokens
            prompts += not joins
            last_group = job.group
    return batch
