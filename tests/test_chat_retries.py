"""The chat driver's retries against the queueing bound: the real control plane, fake generation nodes.

The first node a request reaches answers only after the bound (``control.max_queue_wait_s``)
has passed, then either fails (a stopped node found silent) or refuses (its queue was too
long). The other node is busy, but within the bound: a request may still queue there only if
its retry was left some of the bound, both by the plane (its admission) and by the node
(the plan's ``queue_budget_s``, checked the way the node's late-start check does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from helpers.plane import Cluster

from tessera.errors import Overloaded
from tessera.messages.generation import (
    DoneEvent,
    ErrorEvent,
    ExecuteEvent,
    ExecuteRequest,
    RequestStats,
    SamplingParams,
    SnapshotResponse,
)
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
from tessera.retrieval.chat.driver import ChatDriver
from tessera.retrieval.chat.generation_client import NodeUnavailable
from tessera.retrieval.leadership.path import LocalPath
from tessera.wire import WIRE_VERSION

BOUND_S = 0.2  # control.max_queue_wait_s
SLOW_S = 0.3  # how long the first node takes to fail or refuse: past the bound
BUSY_S = 0.05  # the other node's queue: a request's work begins there this long after its plan
LAYOUT = PromptLayout((Segment(SegmentKind.TEXT, (1, 2, 3)),))


class Nodes:
    """The generation nodes as the driver reaches them (``NodeClients``' verbs).

    The first node asked fails (``NodeUnavailable``) or refuses (a refused ``ErrorEvent``)
    after ``SLOW_S``; by then the other node has a request queued on the plane and is busy for
    ``BUSY_S``, so it refuses a plan whose queueing budget ends sooner.
    """

    def __init__(self, cluster: Cluster, first: str) -> None:
        self.cluster = cluster
        self.first = first  # "fails" or "refuses"
        self.slow = ""  # the first node asked
        self.plans: dict[str, list[ExecuteRequest]] = {}

    async def snapshot(self, watch: Any, request_id: str, unit_ids: Sequence[str]) -> SnapshotResponse:
        return SnapshotResponse(WIRE_VERSION, request_id, watch.name, (), 0)

    async def execute(self, watch: Any, msg: ExecuteRequest) -> AsyncGenerator[ExecuteEvent, None]:
        node = msg.plan.node
        self.plans.setdefault(node, []).append(msg)
        if not self.slow:
            self.slow = node
            await asyncio.sleep(SLOW_S)
            self._queue_behind_another(node)
            if self.first == "fails":
                raise NodeUnavailable(f"generation node {node} stopped reporting in")
            yield ErrorEvent(WIRE_VERSION, "the request's queueing bound ran out", refused=True)
            return
        if msg.queue_budget_s is not None and msg.queue_budget_s < BUSY_S:
            yield ErrorEvent(WIRE_VERSION, "the request's queueing bound ran out", refused=True)
            return
        yield DoneEvent(WIRE_VERSION, "length", RequestStats())

    def abort_later(self, node: str, request_id: str) -> None:
        pass

    def _queue_behind_another(self, slow: str) -> None:
        """The other node measured one service time of ``BUSY_S`` and has one request waiting."""
        plane, clock = self.cluster.plane, self.cluster.clock
        plane.route("ahead-1", [], exclude={slow})
        clock.advance(BUSY_S)
        plane.started("ahead-1")
        plane.route("ahead-2", [], exclude={slow})


class Receiver:
    def committed(self) -> bool:
        return False

    def restart(self) -> None:
        pass


def driver(cluster: Cluster, nodes: Nodes) -> ChatDriver:
    path = LocalPath(lambda: cluster.plane)
    node = SimpleNamespace(office=SimpleNamespace(path=lambda: path), config=cluster.config)
    return ChatDriver(node, nodes, SamplingParams(), arrived=time.perf_counter())  # type: ignore[arg-type]


async def serve(cluster: Cluster, nodes: Nodes) -> list[object]:
    return [event async for event in driver(cluster, nodes).run(LAYOUT, Receiver())]


async def test_a_retry_after_a_failed_node_is_not_charged_for_the_time_it_took() -> None:
    """Regression: a request stranded on a stopped node was refused 429 on its retry although
    the other node could take it in time: the time spent finding the node dead was counted
    against the queueing bound, by the plane's admission and by the plan's budget."""
    cluster = Cluster(nodes=2, max_queue_wait_s=BOUND_S, max_attempts=2)
    nodes = Nodes(cluster, first="fails")
    events = await serve(cluster, nodes)
    assert [type(e) for e in events] == [DoneEvent], events
    (other,) = set(nodes.plans) - {nodes.slow}
    (retry,) = nodes.plans[other]
    assert retry.queue_budget_s is not None and BUSY_S <= retry.queue_budget_s <= BOUND_S, retry.queue_budget_s


async def test_the_time_queued_on_a_node_that_refused_still_counts() -> None:
    """A node that refused had the request queued until its bound ran out: the retry is left
    none of it, so a busy node is not offered it (429) rather than queueing it a second time."""
    cluster = Cluster(nodes=2, max_queue_wait_s=BOUND_S, max_attempts=2)
    nodes = Nodes(cluster, first="refuses")
    with pytest.raises(Overloaded, match="max_queue_wait_s"):
        await serve(cluster, nodes)
    assert set(nodes.plans) == {nodes.slow}, "the busy node was sent a request whose bound was spent"
