"""An order-free request on a generation node (tiny model, both engines): the exact-prefix cache
matches into its units, what it covers is served exactly, and the rest is computed in full or
composed, whichever computes fewer tokens; grants of units it needs no state of go back."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers.engines import ENGINE_NAMES, random_layout, tiny_engine
from helpers.executor import QuietControl, execute_request, run_request

from tessera.composition.policies import get_policy
from tessera.engines.base import EngineAdapter
from tessera.engines.offline import compose, prefill, prefill_units
from tessera.generation.executor import Executor
from tessera.generation.prefills import PrefillCoalescer
from tessera.generation.retention import Retainer
from tessera.generation.scheduler import Scheduler
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages.generation import ExecuteRequest
from tessera.messages.plan import Preparation, Retention, WriteGrant
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind

# lead text, u1, a separator, u3, the question
PROMPT_A = random_layout([("text", 6), ("unit", 24), ("text", 2), ("unit", 18), ("text", 5)], seed=5)
# the same lead, u1 and separator, then another unit and the same question
PROMPT_B = PromptLayout((*PROMPT_A.segments[:3],
                         Segment(SegmentKind.UNIT, random_layout([("unit", 20)], seed=9).token_ids(), "u5"),
                         PROMPT_A.segments[4]))
POLICY = get_policy("epic", recompute_tokens=4)
GRANT = WriteGrant("u1", 1, (), "gen0", 24, 30.0)


@pytest.fixture(params=ENGINE_NAMES)
def engine(tmp_path: Path, request: pytest.FixtureRequest) -> EngineAdapter:
    """A fresh engine each test: its prefix cache starts empty."""
    return tiny_engine(tmp_path, "llama", engine=request.param)


@dataclasses.dataclass
class Node:
    executor: Executor
    cache: LocalUnitCache
    control: QuietControl


@contextlib.asynccontextmanager
async def node(engine: EngineAdapter) -> AsyncIterator[Node]:
    scheduler = Scheduler(engine, max_batch_tokens=4096)
    scheduler.start()
    cache = LocalUnitCache(capacity_blocks=64, block_tokens=16)
    control = QuietControl()
    retainer = Retainer(cache, None, control, staging_bytes=1 << 24, outstanding=2)
    try:
        yield Node(Executor(scheduler, PrefillCoalescer(scheduler), cache, retainer, None, lambda _: None,
                            POLICY, "compose"), cache, control)
    finally:
        await retainer.drain(5.0)
        await scheduler.stop()


def order_free(layout: PromptLayout, preparations: dict[str, Preparation], request_id: str,
               granted: str = "", retain: bool = False, recurring: bool = False) -> ExecuteRequest:
    """The request as the retrieval role sends an order-free one (``granted``: a unit with a write
    grant; ``retain``: every unit kept in the local tier)."""
    req = execute_request(layout, preparations, max_tokens=4, request_id=request_id, retain_local=retain)
    units = tuple(dataclasses.replace(u, retention=Retention.SHARED, grant=GRANT) if u.unit_id == granted else u
                  for u in req.plan.units)
    return dataclasses.replace(req, plan=dataclasses.replace(req.plan, units=units), exact_into_units=True,
                               recurring=recurring)


async def test_an_order_free_prompt_is_served_exactly_when_that_computes_less(engine: EngineAdapter) -> None:
    """Cold units that no tier keeps cost their prefill plus the policy's tokens: computing the
    prompt in full is cheaper, so it is served exactly (full prefill's tokens), its grant goes
    back, and the same prompt again is all but its last token a prefix hit."""
    full = prefill(engine, PROMPT_A.token_ids(), max_new_tokens=4, stop_ids=())
    async with node(engine) as n:
        computed = {"u1": Preparation.COMPUTE, "u3": Preparation.COMPUTE}
        tokens, done = await run_request(n.executor, order_free(PROMPT_A, computed, "a1"))
        assert tokens == full.generated
        s = done.stats
        assert s.served_exactly and s.prefix_cached_tokens == 0 and s.recomputed_tokens == PROMPT_A.n_tokens
        assert s.computed_ranges == ((0, PROMPT_A.n_tokens),) and s.computed_units == 0
        again, done = await run_request(n.executor, order_free(PROMPT_A, computed, "a2"))
    assert again == full.generated
    assert done.stats.served_exactly and done.stats.prefix_cached_tokens == PROMPT_A.n_tokens - 1


async def test_cold_units_that_will_be_kept_are_composed_not_served_exactly(engine: EngineAdapter) -> None:
    """The same cold prompt with its units kept locally: their prefills are kept for reuse at any
    position, so composing costs only the policy's tokens and wins; the states are computed."""
    async with node(engine) as n:
        req = order_free(PROMPT_A, {"u1": Preparation.COMPUTE, "u3": Preparation.COMPUTE}, "a1", retain=True)
        _, done = await run_request(n.executor, req)
    s = done.stats
    assert not s.served_exactly and s.computed_units == 2 and s.prefix_cached_tokens == 0


async def test_an_order_served_before_is_served_exactly_even_where_composing_costs_less(
        engine: EngineAdapter) -> None:
    """The same kept cold units in an order the retrieval role served before (``recurring``): the
    rest is computed exactly (full prefill's tokens), so the next prompt in this order is a hit."""
    full = prefill(engine, PROMPT_A.token_ids(), max_new_tokens=4, stop_ids=())
    async with node(engine) as n:
        computed = {"u1": Preparation.COMPUTE, "u3": Preparation.COMPUTE}
        tokens, done = await run_request(n.executor, order_free(PROMPT_A, computed, "a1", retain=True,
                                                                recurring=True))
        _, again = await run_request(n.executor, order_free(PROMPT_A, computed, "a2", retain=True))
    assert tokens == full.generated and done.stats.served_exactly and done.stats.computed_units == 0
    assert again.stats.prefix_cached_tokens == PROMPT_A.n_tokens - 1


async def test_past_a_hit_into_its_units_the_rest_is_composed_when_that_computes_less(
        engine: EngineAdapter) -> None:
    """The prefix cache holds prompt A; prompt B shares its lead, u1 and separator, then a unit
    held locally: the hit covers u1 (no state of it is used; its grant goes back), the rest is
    composed, and the tokens equal offline composition with the same hit."""
    states = prefill_units(engine, PROMPT_B)
    hit = sum(len(seg.token_ids) for seg in PROMPT_A.segments[:3])
    async with node(engine) as n:
        await run_request(n.executor, order_free(PROMPT_A, {"u1": Preparation.COMPUTE, "u3": Preparation.COMPUTE},
                                                 "a1"))
        oracle = compose(engine, PROMPT_B, POLICY, states, max_new_tokens=4, match_into_units=True)
        assert oracle.prefix_len == hit
        n.cache.insert("u5", states["u5"])
        req = order_free(PROMPT_B, {"u1": Preparation.COMPUTE, "u5": Preparation.LOCAL}, "b1", granted="u1")
        n.cache.held(req.request_id, ["u5"])
        tokens, done = await run_request(n.executor, req)
    assert tokens == oracle.generated[: len(tokens)]
    s = done.stats
    assert not s.served_exactly and s.prefix_cached_tokens == hit
    assert (s.local_units, s.computed_units) == (1, 0) and "u1" not in s.unit_sources
    assert n.control.given_up == ["u1"]


async def test_a_fixed_order_request_matches_only_its_leading_text(engine: EngineAdapter) -> None:
    """Control: the same prompt B with its order fixed matches the lead only, and composes u1 too."""
    states = prefill_units(engine, PROMPT_B)
    async with node(engine) as n:
        await run_request(n.executor, order_free(PROMPT_A, {"u1": Preparation.COMPUTE, "u3": Preparation.COMPUTE},
                                                 "a1"))
        for uid in ("u1", "u5"):
            n.cache.insert(uid, states[uid])
        req = dataclasses.replace(order_free(PROMPT_B, {"u1": Preparation.LOCAL, "u5": Preparation.LOCAL}, "b1"),
                                  exact_into_units=False)
        n.cache.held(req.request_id, ["u1", "u5"])
        _, done = await run_request(n.executor, req)
    assert done.stats.prefix_cached_tokens == len(PROMPT_A.segments[0].token_ids)
    assert not done.stats.served_exactly and done.stats.local_units == 2

