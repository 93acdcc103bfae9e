"""The device data path: states are checked at the adapter boundary, and a state that cannot be
placed is computed instead (the request still succeeds). On CPU every copy is the identity."""

from __future__ import annotations

import pytest
import torch
from helpers.engines import ENGINE_NAMES, random_layout, tiny_engine
from helpers.executor import DictReader, StartExecutor, execute_request, run_request

from tessera.composition.policies import get_policy
from tessera.engines.base import EngineAdapter, UnitState
from tessera.engines.device import check_state, host_copy, to_device, to_host
from tessera.engines.offline import compose, prefill_units
from tessera.errors import PlacementError
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages.plan import Preparation

PARTS = [("text", 6), ("unit", 24), ("text", 2), ("unit", 18), ("text", 5)]


@pytest.fixture(scope="module", params=ENGINE_NAMES)
def engine(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> EngineAdapter:
    return tiny_engine(tmp_path_factory.mktemp("tiny"), "llama", kv_dtype="float16", engine=request.param)


def _kv_dtype(engine: EngineAdapter) -> torch.dtype:
    return {"float16": torch.float16, "float32": torch.float32}[engine.geometry.kv_dtype]


def _bad_dtype(state: UnitState) -> UnitState:
    return UnitState(state.keys.float(), state.values.float())


def _bad_shape(state: UnitState) -> UnitState:
    return UnitState(state.keys[:, :, :1].contiguous(), state.values[:, :, :1].contiguous())


def test_invariant_messages_name_the_tensor(engine: EngineAdapter) -> None:
    """check_state says which tensor is wrong and how (dtype, shape)."""
    state = prefill_units(engine, random_layout(PARTS))["u1"]
    cpu = torch.device("cpu")
    check_state(state, engine.geometry, _kv_dtype(engine), cpu)
    with pytest.raises(PlacementError, match=r"state\.keys is torch\.float32 .* torch\.float16"):
        check_state(_bad_dtype(state), engine.geometry, _kv_dtype(engine), cpu)
    with pytest.raises(PlacementError, match=r"state\.values is torch\.float32"):
        check_state(UnitState(state.keys, state.values.float()), engine.geometry, _kv_dtype(engine), cpu)
    with pytest.raises(PlacementError, match=r"state\.keys has shape \(2, 24, 1, 16\).*H_kv=2"):
        check_state(_bad_shape(state), engine.geometry, _kv_dtype(engine), cpu)


def test_place_refuses_a_foreign_state_before_writing(engine: EngineAdapter) -> None:
    """engine.place raises PlacementError (not a kernel error) for a state of another dtype."""
    state = prefill_units(engine, random_layout(PARTS))["u1"]
    slots = engine.allocate(64)
    try:
        with pytest.raises(PlacementError, match=r"state\.keys"):
            engine.place(slots, 0, _bad_dtype(state))
    finally:
        engine.free(slots)


async def test_copies_are_the_identity_on_cpu(engine: EngineAdapter) -> None:
    """A CPU state is neither copied nor pinned: to_device/to_host/host_copy return it as is."""
    state = prefill_units(engine, random_layout(PARTS))["u1"]
    assert to_device(state, torch.device("cpu")) is state
    host, event = to_host(state)
    assert host is state and event is None
    assert await host_copy(state) is state


@pytest.mark.parametrize("break_state", [_bad_dtype, _bad_shape], ids=["dtype", "shape"])
async def test_unplaceable_local_and_remote_states_fall_back_to_compute(engine: EngineAdapter, break_state,
        start_executor: StartExecutor) -> None:  # type: ignore[no-untyped-def]
    """A local and a fetched state that fail placement are computed; the tokens equal offline composition."""
    layout = random_layout(PARTS, seed=3)
    policy = get_policy("epic", recompute_tokens=4)
    good = prefill_units(engine, layout)
    oracle = compose(engine, layout, policy, good, max_new_tokens=5, use_prefix_cache=False)
    cache = LocalUnitCache(capacity_blocks=64, block_tokens=16)
    cache.insert("u1", break_state(good["u1"]))
    reader = DictReader({"u3": break_state(good["u3"])})
    req = execute_request(layout, {"u1": Preparation.LOCAL, "u3": Preparation.REMOTE}, max_tokens=5)
    assert cache.held(req.request_id, ["u1"]) == ["u1"]
    executor = start_executor(engine, policy, cache, reader)
    tokens, done = await run_request(executor, req)
    assert tokens == oracle.generated
    s = done.stats
    assert (s.fallbacks, s.computed_units, s.local_units, s.remote_units) == (2, 2, 0, 0)


async def test_local_and_remote_states_that_fit_are_placed(engine: EngineAdapter,
        start_executor: StartExecutor) -> None:
    """Control: the same request with good states reuses both and returns the same tokens."""
    layout = random_layout(PARTS, seed=3)
    policy = get_policy("epic", recompute_tokens=4)
    good = prefill_units(engine, layout)
    oracle = compose(engine, layout, policy, good, max_new_tokens=5, use_prefix_cache=False)
    cache = LocalUnitCache(capacity_blocks=64, block_tokens=16)
    cache.insert("u1", good["u1"])
    req = execute_request(layout, {"u1": Preparation.LOCAL, "u3": Preparation.REMOTE}, max_tokens=5)
    cache.held(req.request_id, ["u1"])
    executor = start_executor(engine, policy, cache, DictReader({"u3": good["u3"]}))
    tokens, done = await run_request(executor, req)
    assert tokens == oracle.generated
    s = done.stats
    assert (s.fallbacks, s.computed_units, s.local_units, s.remote_units) == (0, 0, 1, 1)


async def test_a_missing_unit_is_retained_locally_as_a_host_state(engine: EngineAdapter,
        start_executor: StartExecutor) -> None:
    """A computed unit with local retention lands in the cache in host memory, usable by the next request."""
    layout = random_layout(PARTS, seed=4)
    policy = get_policy("epic", recompute_tokens=4)
    cache = LocalUnitCache(capacity_blocks=64, block_tokens=16)
    req = execute_request(layout, {"u1": Preparation.COMPUTE, "u3": Preparation.COMPUTE}, max_tokens=2,
                          retain_local=True)
    executor = start_executor(engine, policy, cache)
    await run_request(executor, req)
    await executor.retainer.drain(5.0)
    assert sorted(cache.unit_ids()) == ["u1", "u3"]
    kept = cache.get("u1")
    assert kept is not None and kept.keys.device.type == "cpu" and kept.keys.dtype == torch.float16



async def test_a_request_waits_for_kv_pages_instead_of_failing(tmp_path_factory: pytest.TempPathFactory,
        start_executor: StartExecutor) -> None:
    """Paged engine with a pool for one request at a time: two concurrent requests both succeed."""
    import asyncio

    engine = tiny_engine(tmp_path_factory.mktemp("small-pool"), "llama", kv_dtype="float16", engine="paged",
                         kv_pool_tokens=96)
    policy = get_policy("epic", recompute_tokens=4)
    layout = random_layout(PARTS, seed=5)  # 55 prompt tokens + 8 decode: 4 of the 6 pages
    oracle = compose(engine, layout, policy, prefill_units(engine, layout), max_new_tokens=8, use_prefix_cache=False)
    cache = LocalUnitCache(capacity_blocks=64, block_tokens=16)
    reqs = [execute_request(layout, {"u1": Preparation.COMPUTE, "u3": Preparation.COMPUTE}, max_tokens=8,
                            request_id=f"req-{i}") for i in range(2)]
    executor = start_executor(engine, policy, cache)
    results = await asyncio.gather(*(run_request(executor, r) for r in reqs))
    assert [tokens for tokens, _ in results] == [oracle.generated, oracle.generated]
    assert engine.pool.free_pages == engine.pool.n_pages
