"""``model.engine = "sglang"``: the EngineAdapter contract on SGLang's model runner (bundled SmolLM2, bf16).

Every test skips, saying why, where this interpreter cannot import SGLang (docs/sglang.md says
how to install it); CI has no SGLang.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers.cluster import REPO, StartCluster, child_env, cluster_config
from helpers.http import node_metric, wait_for

from tessera.composition.layout import layout_from_trace
from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig, SGLangConfig
from tessera.engines.base import Extend, UnitFeed, UnitPrefill, UnitState, load_engine
from tessera.engines.offline import compose, prefill_units
from tessera.engines.reference import ReferenceEngine
from tessera.engines.rope import RopeTable
from tessera.engines.sglang.runner import sglang_missing
from tessera.engines.weights import ModelSpec
from tessera.errors import BadRequest
from tessera.kernels.rope import rope_place_span

pytestmark = pytest.mark.skipif(sglang_missing() is not None, reason=sglang_missing() or "")
# the environment before this process built an SGLang runner (which sets SGLang's and
# torch.distributed's variables for itself): a child starting SGLang of its own needs this one
STARTING_ENV = dict(os.environ)
STARTING_CORES = os.sched_getaffinity(0)  # SGLang binds the thread that builds its runner to its cores

UNIT_A = "Record A: the lighthouse keeper logs every passing ship in a blue notebook, and rests on Sundays. "
UNIT_B = "Record B: the orchard on the hill grows pears, plums and late apples for the autumn market. "
QUESTION = " Question: who keeps the log of passing ships? Answer:"


def sglang_config(nodes: int = 1, threads: int = 2, local_blocks: int = 1024) -> ClusterConfig:
    cfg = cluster_config("smollm2", nodes=nodes, threads=threads, local_blocks=local_blocks)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engine="sglang", dtype="bfloat16"),
                               sglang=SGLangConfig(max_total_tokens=8192, max_requests=8))


@pytest.fixture(scope="module")
def engine() -> Any:
    return load_engine(sglang_config(), 4096)


def _prefill(engine: Any, tokens: list[int], n_slots: int = 0) -> tuple[Any, Extend]:
    slots = engine.allocate(n_slots or len(tokens) + 8)
    ext = Extend(slots, tokens, list(range(len(tokens))))
    engine.step([ext])
    return slots, ext


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Logits of two bf16 computations of the same thing: one greedy token, small differences."""
    assert int(a.argmax()) == int(b.argmax())
    assert float((a - b).abs().max()) < 0.05 * float(a.abs().max())


def test_placement_equals_rope_applied_directly(engine: Any) -> None:
    """A unit placed at offset 37 holds the keys an independent float32 RoPE gives at 37.. (bf16 rounding)."""
    tokens = engine.encode(UNIT_A)
    unit = UnitPrefill(tokens)
    engine.step([unit])
    slots = engine.allocate(37 + len(tokens))
    try:
        engine.place(slots, 37, unit.state)
        placed, values = engine.read_slots(slots, 37, 37 + len(tokens))
        spec = ModelSpec.from_config(engine.runner.model_config.hf_config.to_dict())
        table = RopeTable(spec.rope, 37 + len(tokens), torch.float32, torch.device("cpu"))
        direct = torch.empty(unit.state.keys.shape[0], 37 + len(tokens), *unit.state.keys.shape[2:])
        rope_place_span(unit.state.keys.float(), 37, table.cos, table.sin, direct)
        # SGLang's CPU RoPE rotates with bfloat16 cos/sin: an error of a few bf16 steps of each head's scale
        # (a rotation one position off is wrong by the head's whole scale)
        scale = direct[:, 37:].abs().amax(dim=-1, keepdim=True)
        assert bool(((placed.float() - direct[:, 37:]).abs() <= 2 ** -6 * scale + 1e-3).all())
        shifted = torch.empty_like(direct)
        rope_place_span(unit.state.keys.float(), 36, table.cos, table.sin, shifted)
        assert not bool(((placed.float() - shifted[:, 36:-1]).abs() <= 2 ** -6 * scale + 1e-3).all())
        torch.testing.assert_close(values, unit.state.values.to(values.dtype), atol=1e-6, rtol=0.0)
    finally:
        engine.free(slots)


def test_unit_capture_is_the_pools_post_rope_keys_rotated_back(engine: Any) -> None:
    """A unit's captured keys, rotated at 0.., are exactly what a prefill of its tokens wrote to the pool."""
    tokens = engine.encode(UNIT_B)
    unit = UnitPrefill(tokens)
    engine.step([unit])
    assert unit.state.keys.dtype == engine.kv_dtype and unit.state.n_tokens == len(tokens)
    slots, _ = _prefill(engine, tokens)
    try:
        keys, values = engine.read_slots(slots, 0, len(tokens))
        # float16 storage holds a bfloat16 value exactly, but for subnormals (|v| < 6e-5)
        torch.testing.assert_close(engine.rotate(unit.state.keys, torch.arange(len(tokens))), keys,
                                   atol=1e-6, rtol=0.0)
        torch.testing.assert_close(unit.state.values.to(values.dtype), values, atol=1e-6, rtol=0.0)
    finally:
        engine.free(slots)


def test_composed_extends_match_the_masked_reference_computation(engine: Any) -> None:
    """Two placed units, scattered recompute ranges and a suffix in one step with a unit prefill and a
    tail: each extend's logits equal the portable masked computation of the same batch."""
    a, b, q = engine.encode(UNIT_A), engine.encode(UNIT_B), engine.encode(QUESTION)
    units = [UnitPrefill(a), UnitPrefill(b)]
    engine.step(units)
    n = len(a) + len(b) + len(q)
    recompute = [*range(0, 4), *range(len(a), len(a) + 4)]
    suffix = list(range(len(a) + len(b), n))
    tokens = [(a + b + q)[p] for p in recompute + suffix]

    def run(kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
        engine.attention.kernels = kernels
        try:
            composed = engine.allocate(n + 4)
            engine.place(composed, 0, units[0].state)
            engine.place(composed, len(a), units[1].state)
            plain, _ = _prefill(engine, a)
            scattered = Extend(composed, tokens, recompute + suffix)
            tail = Extend(plain, b[:5], list(range(len(a), len(a) + 5)))
            engine.step([UnitPrefill(q), scattered, tail])
            assert scattered.logits is not None and tail.logits is not None
            engine.free(composed)
            engine.free(plain)
            return scattered.logits, tail.logits
        finally:
            engine.attention.kernels = True

    kernel_scattered, kernel_tail = run(True)
    torch_scattered, torch_tail = run(False)
    _close(kernel_scattered, torch_scattered)
    _close(kernel_tail, torch_tail)


def test_a_unit_fed_into_its_requests_forward_equals_a_separate_prefill_and_placement(engine: Any) -> None:
    """Extend.units: the unit's state and the request's logits are those of prefill, place, then extend."""
    a, q = engine.encode(UNIT_A), engine.encode(QUESTION)
    n = len(a) + len(q)
    separate = UnitPrefill(a)
    engine.step([separate])
    placed = engine.allocate(n + 2)
    engine.place(placed, 0, separate.state)
    # the unit's head is recomputed (as EPIC does), the rest placed
    ext = Extend(placed, [*a[:4], *q], [*range(4), *range(len(a), n)])
    engine.step([ext])
    fused_slots = engine.allocate(n + 2)
    feed = UnitFeed(a, [(4, len(a), 4)])
    fused = Extend(fused_slots, [*a[:4], *q], [*range(4), *range(len(a), n)], units=[feed])
    engine.step([UnitPrefill(q), fused])
    try:
        assert feed.state is not None and separate.state is not None
        assert torch.equal(feed.state.keys, separate.state.keys)
        assert torch.equal(feed.state.values, separate.state.values)
        assert torch.equal(engine.read_slots(fused_slots, 0, n)[0], engine.read_slots(placed, 0, n)[0])
        assert fused.logits is not None and ext.logits is not None
        assert torch.equal(fused.logits, ext.logits)
    finally:
        engine.free(placed)
        engine.free(fused_slots)


def test_units_fed_into_two_requests_of_one_forward_equal_separate_prefills_and_placements(engine: Any) -> None:
    """Every feed of a forward is placed together at each layer: two units, one of them fed in two
    spans, into two requests, give the slots and logits that separate prefills and placements give."""
    a, b, q = engine.encode(UNIT_A), engine.encode(UNIT_B), engine.encode(QUESTION)
    n = len(a) + len(b) + len(q)
    states = {}
    for name, ids in (("a", a), ("b", b)):
        prefill = UnitPrefill(ids)
        engine.step([prefill])
        states[name] = prefill.state
    # request 1: A then B, the first 3 tokens of each recomputed; request 2: B alone, its head recomputed
    ids1, pos1 = [*a[:3], *b[:3], *q], [*range(3), *range(len(a), len(a) + 3), *range(len(a) + len(b), n)]
    ids2, pos2 = [*b[:2], *q], [*range(2), *range(len(b), len(b) + len(q))]
    placed1, placed2 = engine.allocate(n + 1), engine.allocate(len(b) + len(q) + 1)
    engine.place(placed1, 3, UnitState(states["a"].keys[:, 3:], states["a"].values[:, 3:]))
    engine.place(placed1, len(a) + 3, UnitState(states["b"].keys[:, 3:], states["b"].values[:, 3:]))
    engine.place(placed2, 2, UnitState(states["b"].keys[:, 2:], states["b"].values[:, 2:]))
    ext1, ext2 = Extend(placed1, ids1, pos1), Extend(placed2, ids2, pos2)
    engine.step([ext1, ext2])
    fused1, fused2 = engine.allocate(n + 1), engine.allocate(len(b) + len(q) + 1)
    feed_a = UnitFeed(a, [(3, len(a), 3)])
    feed_b1 = UnitFeed(b, [(3, 5, len(a) + 3), (5, len(b), len(a) + 5)])  # one unit, two spans
    feed_b2 = UnitFeed(b, [(2, len(b), 2)])
    f1 = Extend(fused1, ids1, pos1, units=[feed_a, feed_b1])
    f2 = Extend(fused2, ids2, pos2, units=[feed_b2])
    engine.step([f1, f2])
    try:
        for feed, name in ((feed_a, "a"), (feed_b1, "b"), (feed_b2, "b")):
            assert feed.state is not None and torch.equal(feed.state.keys, states[name].keys)
        assert torch.equal(engine.read_slots(fused1, 0, n)[0], engine.read_slots(placed1, 0, n)[0])
        m = len(b) + len(q)
        assert torch.equal(engine.read_slots(fused2, 0, m)[1], engine.read_slots(placed2, 0, m)[1])
        assert f1.logits is not None and ext1.logits is not None and torch.equal(f1.logits, ext1.logits)
        assert f2.logits is not None and ext2.logits is not None and torch.equal(f2.logits, ext2.logits)
    finally:
        for slots in (placed1, placed2, fused1, fused2):
            engine.free(slots)


def test_exact_prefix_cache_is_per_tenant_and_serves_the_same_logits(engine: Any) -> None:
    tokens = engine.encode(UNIT_A + UNIT_B)
    first, full = _prefill(engine, tokens)
    engine.insert_prefix(first, tokens, "tenant-a")
    engine.free(first)
    other = engine.allocate(len(tokens) + 4)
    assert engine.match_prefix(other, tokens, "tenant-b") == 0
    engine.free(other)
    again = engine.allocate(len(tokens) + 4)
    try:
        assert engine.match_prefix(again, tokens[:-1], "tenant-a") == len(tokens) - 1
        last = Extend(again, tokens[-1:], [len(tokens) - 1])
        engine.step([last])
        assert last.logits is not None and full.logits is not None
        _close(last.logits, full.logits)
    finally:
        engine.free(again)


def test_decode_continues_a_prefill_and_free_returns_every_slot(engine: Any) -> None:
    before = (engine.allocator.available_size(), len(engine.req_to_token.free_slots))
    tokens = engine.encode(UNIT_A + QUESTION)
    slots, ext = _prefill(engine, tokens, len(tokens) + 4)
    assert ext.logits is not None
    nxt = int(ext.logits.argmax())
    step = Extend(slots, [nxt], [len(tokens)])
    engine.decode([step])
    # the decode kernel's token equals a tail extend of the same token on a fresh prefill
    again, _ = _prefill(engine, [*tokens, nxt])
    check = Extend(again, [nxt], [len(tokens)])
    engine.step([check])
    assert step.logits is not None and check.logits is not None
    _close(step.logits, check.logits)
    engine.free(slots)
    engine.free(again)
    assert (engine.allocator.available_size(), len(engine.req_to_token.free_slots)) == before
    with pytest.raises(AssertionError, match="after free"):
        engine.place(slots, 0, UnitState(torch.empty(30, 0, 3, 64), torch.empty(30, 0, 3, 64)))
    with pytest.raises(BadRequest, match="positions"):
        engine.allocate(engine.geometry.max_context + 1)
    held = [engine.allocate(4) for _ in range(len(engine.req_to_token.free_slots))]
    with pytest.raises(BadRequest, match=r"sglang\.max_requests"):
        engine.allocate(4)
    for s in held:
        engine.free(s)
    assert (engine.allocator.available_size(), len(engine.req_to_token.free_slots)) == before


def test_a_reference_engine_unit_serves_on_sglang(engine: Any) -> None:
    """The reusable form is engine-neutral: a float16 state from the reference engine places and composes."""
    reference = ReferenceEngine.from_config(cluster_config("smollm2", nodes=1))
    tokens = engine.encode(UNIT_A)
    theirs, ours = UnitPrefill(tokens), UnitPrefill(tokens)
    reference.step([theirs])
    engine.step([ours])
    assert theirs.state is not None and ours.state is not None
    assert theirs.state.keys.dtype == ours.state.keys.dtype
    q = engine.encode(QUESTION)
    results = []
    for state in (theirs.state, ours.state):
        slots = engine.allocate(len(tokens) + len(q) + 2)
        engine.place(slots, 0, state)
        ext = Extend(slots, q, list(range(len(tokens), len(tokens) + len(q))))
        engine.step([ext])
        results.append(ext.logits)
        engine.free(slots)
    assert results[0] is not None and results[1] is not None
    assert int(results[0].argmax()) == int(results[1].argmax())


# --- a cluster of SGLang generation nodes ---------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_cluster(tmp_path_factory: pytest.TempPathFactory, start_module_cluster: StartCluster) -> Iterator[Any]:
    # no local unit cache: every unit is written back to the KV pool and fetched from it
    cfg = sglang_config(nodes=1, threads=1, local_blocks=0)
    yield cfg, start_module_cluster(cfg, tmp_path_factory.mktemp("sglang-cluster"))


def test_openai_client_against_sglang_nodes_composes_like_the_offline_engine(sglang_cluster: Any,
                                                                              engine: Any) -> None:
    """The openai client, units in the request: 200s; the served tokens are the offline composition's on
    the same engine; the first request's units are written back to the KV pool, the second fetches them."""
    import openai

    cfg, _ = sglang_cluster
    client = openai.OpenAI(base_url=cfg.retrieval_url + "/v1", api_key="unused")
    messages: Any = [{"role": "user", "content": "Who keeps the log of passing ships?"}]
    extra = {"context_units": [UNIT_A, UNIT_B], "return_layout": True}
    first = client.chat.completions.create(model="tessera", messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, extra_body=extra)
    node_url = f"http://127.0.0.1:{cfg.generation[0].port}"
    wait_for(lambda: node_metric(node_url, "tessera_node_writebacks_published_total", cfg) >= 2, what="writeback")
    second = client.chat.completions.create(model="tessera", messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, extra_body=extra)
    for reply in (first, second):
        body = reply.model_dump()
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        layout = layout_from_trace(body["tessera_layout"])
        states = prefill_units(engine, layout)
        served = [e["token_id"] for e in body["choices"][0]["logprobs"]["content"]]
        offline = compose(engine, layout, policy_from_config(cfg.composition), states, max_new_tokens=len(served),
                          stop_ids=engine.eos_token_ids)
        assert offline.generated[:len(served)] == served
    usage = second.model_dump()["usage"]["tessera"]
    assert (usage["remote_units"], usage["computed_units"]) == (2, 0), usage
    assert first.model_dump()["usage"]["tessera"]["computed_units"] == 2


def _fresh_child(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """``args`` in a child started as this process was, before it built an SGLang runner: its
    environment and its cores (SGLang set both for itself)."""
    env = child_env()
    for key in set(os.environ) - set(STARTING_ENV):
        env.pop(key, None)
    env.update({k: v for k, v in STARTING_ENV.items() if os.environ.get(k) != v})
    return subprocess.run(args, cwd=REPO, env=env, preexec_fn=lambda: os.sched_setaffinity(0, STARTING_CORES),
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_bench_sglang_agreement_compares_three_engines_greedy_tokens() -> None:
    """`python bench/sglang_agreement.py`: one table row per pair of engines, counts out of the prompts."""
    done = _fresh_child([sys.executable, "bench/sglang_agreement.py", "--prompts", "2", "--answer-tokens", "3"])
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^\| (.+?) \| (\d+)/2 \| (\d\.\d{3}) \|$", done.stdout, re.M)
    pairs = [tuple(side.split(" (")[0] for side in r[0].split(" vs ")) for r in rows]
    assert pairs == [("Tessera on SGLang", "unmodified SGLang"), ("Tessera on SGLang", "reference engine"),
                     ("unmodified SGLang", "reference engine")], rows


def test_a_short_chaos_run_on_sglang_nodes_keeps_every_invariant() -> None:
    """`tessera chaos --config bench/sglang_chaos.toml`: every fault kind under load on two SGLang
    nodes; every 200 is the offline composition's tokens on the same engine, or parts from them only
    at a near-tie of its bfloat16 kernels; no violation, and the cluster serves normally afterwards."""
    done = _fresh_child([sys.executable, "-m", "tessera", "chaos", "--config", "bench/sglang_chaos.toml",
                         "--duration", "45", "--rate", "1", "--fault-every", "6", "--seed", "1"])
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "violations: 0" in done.stdout and "served normally afterwards: yes" in done.stdout, done.stdout
    injected = re.search(r"^faults injected: (.*)$", done.stdout, re.M)
    assert injected is not None and {f.split()[0] for f in injected.group(1).split(", ")} == {
        "corrupt_block", "kill_generation", "kill_memory", "restart_retrieval", "stop_generation"}, done.stdout
    assert re.search(r"^outcomes: .*200 verified [1-9]", done.stdout, re.M), done.stdout
