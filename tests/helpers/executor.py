"""An executor's requests and fake collaborators (no HTTP, no control plane); ``start_executor`` runs one."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from tessera.engines.base import UnitState
from tessera.generation.executor import Executor
from tessera.messages.generation import DoneEvent, ExecuteRequest, SamplingParams, TokenEvent
from tessera.messages.plan import Preparation, ReadLease, RequestPlan, Retention, UnitPlan, WriteGrant
from tessera.messages.prompt import PromptLayout
from tessera.wire import WIRE_VERSION


class QuietControl:
    """Residency reports and give-ups go nowhere (no control plane in these tests)."""

    def __init__(self) -> None:
        self.reports: list[tuple[list[str], list[str]]] = []
        self.given_up: list[str] = []

    async def residency(self, inserted: Sequence[str], evicted: Sequence[str], kept: Sequence[str] = ()) -> None:
        self.reports.append((list(inserted), list(evicted)))

    async def give_up(self, grant: WriteGrant) -> None:
        self.given_up.append(grant.unit_id)


class DictReader:
    """A KV-pool reader that serves given states by unit id (whatever they are)."""

    def __init__(self, states: Mapping[str, UnitState]) -> None:
        self.states = dict(states)

    async def fetch(self, lease: ReadLease, n_tokens: int, *, release: bool = True,
                    received_at: float | None = None) -> UnitState:
        return self.states[lease.unit_id]

    async def late_lease(self, unit_id: str) -> ReadLease | None:
        return None  # nothing was published since the plan


# the ``start_executor`` fixture: (engine, policy, cache, reader=None) -> a running executor
StartExecutor = Callable[..., Executor]


def execute_request(layout: PromptLayout, preparations: Mapping[str, Preparation], max_tokens: int,
                    request_id: str = "req-1", retain_local: bool = False) -> ExecuteRequest:
    """A request whose units are prepared as given (REMOTE ones get a lease naming the unit)."""
    units = []
    for _, seg in layout.unit_offsets():
        prep = preparations[seg.unit_id]
        lease = ReadLease(f"lease-{seg.unit_id}", seg.unit_id, 1, (), 60.0) if prep is Preparation.REMOTE else None
        units.append(UnitPlan(seg.unit_id, len(seg.token_ids), prep,
                              Retention.LOCAL if retain_local else Retention.NEITHER, lease=lease))
    plan = RequestPlan(WIRE_VERSION, request_id, "gen0", tuple(units))
    return ExecuteRequest(WIRE_VERSION, request_id, layout, plan,
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def run_request(executor: Executor, req: ExecuteRequest) -> tuple[list[int], DoneEvent]:
    """Run to the end, as the node does (the executor frees the slots after its last event)."""
    tokens: list[int] = []
    finished: DoneEvent | None = None
    async for event in executor.run(req):
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        else:
            finished = event
    assert finished is not None, "the request ended without a DoneEvent event"
    return tokens, finished
