"""Composition policies select the right positions; composing over placed units is exact where it must be."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.engines import ENGINE_NAMES, max_diff, random_layout, tiny_engine

from tessera.composition.layout import Ranges, placements, tokens_to_compute
from tessera.composition.policies import (
    POLICIES,
    CompositionPolicy,
    LegoLink,
    get_policy,
    policy_from_config,
    policy_names,
)
from tessera.config import CompositionConfig
from tessera.config_file import load_config
from tessera.engines.base import EngineAdapter
from tessera.engines.offline import compose, prefill, prefill_units
from tessera.errors import ConfigError
from tessera.messages.prompt import PromptLayout

# positions: text 0-5 | u1 5-25 | text 25-27 | u3 27-37 | text 37-44
PARTS = [("text", 5), ("unit", 20), ("text", 2), ("unit", 10), ("text", 7)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module", params=ENGINE_NAMES)
def engine(tiny_dir: Path, request: pytest.FixtureRequest) -> EngineAdapter:
    """Every composition property holds for both CPU engines (reference and paged)."""
    return tiny_engine(tiny_dir, "llama", engine=request.param)


def first_k(k: int) -> CompositionPolicy:
    """EPIC's plain rule: the first k tokens of every unit whatever its length (not length-aware)."""
    return get_policy("epic", recompute_tokens=k, recompute_fraction=1.0)


def test_epic_selects_all_text_and_the_first_k_tokens_of_every_unit() -> None:
    """LegoLink k=4 recomputes text plus unit heads; a unit shorter than k is recomputed whole."""
    layout = random_layout(PARTS)
    assert first_k(4).select(layout) == ((0, 9), (25, 31), (37, 44))
    assert first_k(16).select(layout) == ((0, 21), (25, 44))
    assert first_k(0).select(layout) == get_policy("naive").select(layout)


@pytest.mark.parametrize("name", ["epic", "query", "naive", "full"])
def test_get_policy_without_settings_is_the_served_policy(name: str) -> None:
    """Regression: get_policy("epic") had k=16, fraction 1.0, inline 1.0; the cluster serves 0.25 / 0.75."""
    served = policy_from_config(dataclasses.replace(load_config().composition, policy=name))
    policy = get_policy(name)
    assert type(policy) is type(served) and vars(policy) == vars(served)
    if name == "epic":
        assert vars(LegoLink()) == vars(served)


def test_naive_selects_only_text_and_full_selects_everything() -> None:
    """naive computes the request's own text; full computes the whole prompt."""
    layout = random_layout(PARTS)
    assert get_policy("naive").select(layout) == ((0, 5), (25, 27), (37, 44))
    assert get_policy("full").select(layout) == ((0, 44),)


def test_policies_are_registered_by_name_and_built_from_config(register: Any) -> None:
    """tessera.toml names a policy; unknown names fail with the list of known ones."""
    assert {"epic", "naive", "full"} <= set(policy_names())
    epic = policy_from_config(CompositionConfig(policy="epic", recompute_tokens=7))
    assert isinstance(epic, LegoLink) and epic.k == 7
    with pytest.raises(ConfigError, match=r"known: .*epic"):
        get_policy("cacheblend-typo")

    @register(POLICIES, "test-first-unit-only")
    class FirstUnit(CompositionPolicy):
        def select(self, layout: PromptLayout) -> Ranges:
            return ((0, layout.n_tokens),)

    assert isinstance(get_policy("test-first-unit-only"), FirstUnit)


def test_final_extend_covers_selected_positions_above_the_prefix_hit() -> None:
    """tokens_to_compute drops the prefix hit; placements serve every unit token not computed."""
    layout = random_layout(PARTS)
    ranges = first_k(4).select(layout)
    ids, positions = tokens_to_compute(layout, ranges, prefix_len=3)
    assert positions == [*range(3, 9), *range(25, 31), *range(37, 44)]
    prompt = layout.token_ids()
    assert ids == [prompt[p] for p in positions]
    assert [(p.unit_id, p.offset + p.start, p.offset + p.end) for p in placements(layout, ranges, 3)] == [
        ("u1", 9, 25), ("u3", 31, 37)]
    # a unit the policy recomputes entirely is not placed at all
    assert [p.unit_id for p in placements(layout, first_k(16).select(layout), 0)] == ["u1"]


def test_last_prompt_position_is_always_computed() -> None:
    """A prompt ending inside a unit still yields next-token logits from its last position."""
    layout = random_layout([("text", 4), ("unit", 12)])
    _, positions = tokens_to_compute(layout, get_policy("naive").select(layout), prefix_len=4)
    assert positions == [15]
    assert placements(layout, get_policy("naive").select(layout), 4)[0].end == 11


@pytest.mark.integration
def test_full_composition_equals_plain_prefill(engine: EngineAdapter, tiny_dir: Path) -> None:
    """full over a prefix-cache hit gives the plain prefill's logits and transformers' (fp32 < 1e-3)."""
    from transformers import AutoModelForCausalLM

    layout = random_layout([("text", 30), ("unit", 50), ("text", 3), ("unit", 40), ("text", 12)], seed=4)
    states = prefill_units(engine, layout)
    warm = compose(engine, layout, get_policy("full"), states, insert_prefix=True)
    hit = compose(engine, layout, get_policy("full"), states)
    plain = prefill(engine, layout.token_ids())
    assert (warm.prefix_len, hit.prefix_len) == (0, 30)
    assert max_diff(hit.logits, plain.logits) < 1e-3
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([layout.token_ids()])).logits[0, -1]
    assert max_diff(hit.logits, theirs) < 1e-3


@pytest.mark.integration
def test_a_unit_at_offset_zero_composes_exactly(engine: EngineAdapter) -> None:
    """With no preceding context a placed unit is exact, so naive equals prefill at every layer."""
    layout = random_layout([("unit", 60), ("text", 10)], seed=5)
    composed = compose(engine, layout, get_policy("naive"), prefill_units(engine, layout), max_new_tokens=5)
    plain = prefill(engine, layout.token_ids(), max_new_tokens=5)
    assert max_diff(composed.logits, plain.logits) < 1e-4
    assert composed.generated == plain.generated


@pytest.mark.integration
def test_epic_computes_exactly_its_ranges_and_places_the_rest(engine: EngineAdapter) -> None:
    """The final extend covers text + unit heads; every other unit token comes from its state."""
    layout = random_layout([("text", 8), ("unit", 40), ("text", 2), ("unit", 30), ("text", 6)], seed=6)
    out = compose(engine, layout, first_k(16), prefill_units(engine, layout), use_prefix_cache=False)
    assert out.computed == ((0, 24), (48, 66), (80, 86))
    assert out.n_placed == (40 - 16) + (30 - 16)


@pytest.mark.integration
def test_unit_states_are_unchanged_by_composition(engine: EngineAdapter) -> None:
    """Recomputed tokens live only in the request's slots; the reusable form is never written."""
    layout = random_layout([("text", 8), ("unit", 40), ("text", 2), ("unit", 30), ("text", 6)], seed=7)
    states = prefill_units(engine, layout)
    before = {uid: (s.keys.clone(), s.values.clone()) for uid, s in states.items()}
    for name in ("epic", "naive", "full", "query"):
        compose(engine, layout, get_policy(name, recompute_budget=0.3), states, max_new_tokens=3)
    for uid, s in states.items():
        assert torch.equal(s.keys, before[uid][0]) and torch.equal(s.values, before[uid][1]), uid


def transformers_composition(model: Any, layout: PromptLayout, ranges: Ranges) -> torch.Tensor:
    """An independent oracle built only from transformers: units prefilled into a DynamicCache at their
    real positions attending only to themselves, then one pass over the selected positions with a
    custom 4-D mask that hides the stale copies of recomputed unit tokens."""
    from transformers import DynamicCache

    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    prompt, n = layout.token_ids(), layout.n_tokens
    computed = sorted({p for a, b in ranges for p in range(a, b)} | {n - 1})
    cache, cache_pos = DynamicCache(config=model.config), []

    def run(ids: list[int], pos: list[int], visible: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), attention_mask=visible[None, None],
                    use_cache=True, **{cache_kw: cache})
        cache_pos.extend(pos)
        return out.logits[0, -1]

    with torch.no_grad():
        for o, seg in layout.unit_offsets():
            t = len(seg.token_ids)
            visible = torch.zeros(t, len(cache_pos) + t, dtype=torch.bool)
            visible[:, len(cache_pos):] = torch.tril(torch.ones(t, t, dtype=torch.bool))
            run(list(seg.token_ids), list(range(o, o + t)), visible)
        old, q = torch.tensor(cache_pos, dtype=torch.long), torch.tensor(computed)
        stale = torch.isin(old, q)
        visible = torch.cat([(old[None, :] <= q[:, None]) & ~stale[None, :], q[None, :] <= q[:, None]], dim=1)
        return run([prompt[p] for p in computed], computed, visible)


@pytest.mark.parametrize("policy", ["epic", "naive", "query", "deviation"])
@pytest.mark.integration
def test_composition_equals_an_independent_transformers_oracle(engine: EngineAdapter, tiny_dir: Path,
                                                              policy: str) -> None:
    """Placement + selective recompute give the logits transformers computes for the same composed cache."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
    layout = random_layout([("text", 9), ("unit", 45), ("text", 2), ("unit", 33), ("text", 2), ("unit", 20),
                            ("text", 11)], seed=8)
    pol = (get_policy(policy, recompute_tokens=8) if policy == "epic"
           else get_policy(policy, recompute_tokens=4, recompute_budget=0.2).bound(engine)
           if policy in ("query", "deviation")
           else get_policy(policy))
    ours = compose(engine, layout, pol, prefill_units(engine, layout), use_prefix_cache=False).logits
    theirs = transformers_composition(hf, layout, pol.select(layout))
    assert max_diff(ours, theirs) < 1e-3
    # and composition is not trivially exact: it differs from a plain prefill of the same prompt
    assert max_diff(ours, prefill(engine, layout.token_ids()).logits) > 1e-2


class _Paid:
    """A model probe answering the scores it is given (pure selection logic, no model)."""

    probes_model = True

    def __init__(self, paid: dict[int, float]) -> None:
        self.paid = paid
        self.asked: list[tuple[int, object]] = []

    def first_layer_attention(self, token_ids: Sequence[int], query_from: int) -> list[float]:
        self.asked.append((len(token_ids), query_from))
        return [self.paid.get(p, 0.0) for p in range(len(token_ids))]

    def second_layer_deviation(self, token_ids: Sequence[int], units: Sequence[tuple[int, int]]) -> list[float]:
        self.asked.append((len(token_ids), list(units)))
        return [self.paid.get(p, 0.0) for p in range(len(token_ids))]


def test_the_query_policy_adds_the_unit_tokens_the_question_pays_most_to_epics_heads() -> None:
    """Text + the first k of every unit + ceil(budget * the other unit tokens), highest attention
    first, ties to the earlier position; the probe is asked about the whole prompt from the
    text after the last unit."""
    layout = random_layout(PARTS)  # text 0-5 | u1 5-25 | text 25-27 | u3 27-37 | text 37-44
    probe = _Paid({12: 5.0, 30: 4.0, 20: 3.0, 33: 3.0, 6: 9.0})  # 6 is a head (k=2): already computed
    policy = get_policy("query", recompute_tokens=2, recompute_fraction=1.0, recompute_budget=0.1).bound(probe)
    # 26 non-head unit tokens (18 + 8): ceil(2.6) = 3 picks: 12, 30, then 20 before 33 (tie)
    assert policy.select(layout) == ((0, 7), (12, 13), (20, 21), (25, 29), (30, 31), (37, 44))
    assert probe.asked == [(44, 37)]
    assert get_policy("query", recompute_tokens=2, recompute_fraction=1.0, recompute_budget=0.0).bound(
        probe).select(layout) == first_k(2).select(layout)


def test_the_deviation_policy_asks_about_every_unit_span_and_picks_the_furthest_tokens() -> None:
    """Same budget rule as query, scored by the probe's second-layer deviation over the unit spans."""
    layout = random_layout(PARTS)
    probe = _Paid({12: 5.0, 30: 4.0, 20: 3.0, 33: 3.0})
    policy = get_policy("deviation", recompute_tokens=2, recompute_fraction=1.0, recompute_budget=0.1).bound(probe)
    assert policy.select(layout) == ((0, 7), (12, 13), (20, 21), (25, 29), (30, 31), (37, 44))
    assert probe.asked == [(44, [(5, 25), (27, 37)])]


def test_the_query_policys_choice_follows_the_attention_it_reads() -> None:
    """Another question pays other tokens: the selection changes with it (same units, same budget)."""
    layout = random_layout(PARTS)
    one = get_policy("query", recompute_tokens=0, recompute_budget=0.1).bound(_Paid({8: 1.0, 9: 1.0, 10: 1.0}))
    other = get_policy("query", recompute_tokens=0, recompute_budget=0.1).bound(_Paid({30: 1.0, 31: 1.0, 32: 1.0}))
    assert one.select(layout) == ((0, 5), (8, 11), (25, 27), (37, 44))
    assert other.select(layout) == ((0, 5), (25, 27), (30, 33), (37, 44))


def test_the_query_policy_reads_a_model_and_says_so_without_one() -> None:
    """Unbound it cannot select (a clear error, not a guess); bound to an engine that cannot
    compute attention it refuses at once, naming the engines that can."""
    layout = random_layout(PARTS)
    with pytest.raises(ConfigError, match="bind the engine"):
        get_policy("query").select(layout)

    class NoProbe:
        probes_model = False

    with pytest.raises(ConfigError, match=r"model.engine = \"reference\""):
        get_policy("query").bound(NoProbe())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"composition\.recompute_budget"):
        get_policy("query", recompute_budget=1.5)


@pytest.mark.integration
def test_first_layer_attention_is_full_prefills_and_the_query_choice_changes_with_the_question(
        engine: EngineAdapter, tiny_dir: Path) -> None:
    """The probe equals the first layer's attention transformers computes over the whole prompt,
    and on the tiny model two questions over the same units recompute different unit tokens;
    each composes exactly as composing the ranges it names does."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32, attn_implementation="eager").eval()
    layout = random_layout([("text", 6), ("unit", 40), ("text", 2), ("unit", 30), ("text", 9)], seed=11)
    ids = layout.token_ids()
    with torch.no_grad():
        attn = hf(input_ids=torch.tensor([ids]), output_attentions=True).attentions[0][0]  # [H, n, n]
    expected = attn[:, 78:, :].sum(dim=(0, 1))
    assert max_diff(torch.tensor(engine.first_layer_attention(ids, 78)), expected) < 1e-4
    questions = [random_layout([("text", 9)], seed=s).segments[0] for s in (12, 13)]
    asked = [dataclasses.replace(layout, segments=(*layout.segments[:-1], q)) for q in questions]
    policy = get_policy("query", recompute_tokens=4, recompute_budget=0.15).bound(engine)
    picks = [policy.select(x) for x in asked]
    assert picks[0] != picks[1]
    for x, ranges in zip(asked, picks, strict=True):
        states = prefill_units(engine, x)
        served = compose(engine, x, policy, states, use_prefix_cache=False)
        named = compose(engine, x, _Fixed(ranges), states, use_prefix_cache=False)
        assert served.computed == named.computed and torch.equal(served.logits, named.logits)


@pytest.mark.integration
def test_second_layer_deviation_is_the_distance_transformers_computes(engine: EngineAdapter, tiny_dir: Path) -> None:
    """The probe's deviation equals the squared distance between the second layer's k/v
    projections (before RoPE) of each unit prefilled alone and of the whole prompt, as
    transformers computes them; 0 outside the units."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    layout = random_layout([("text", 6), ("unit", 40), ("text", 2), ("unit", 30), ("text", 9)], seed=14)
    ids = layout.token_ids()
    attn = hf.model.layers[1].self_attn
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out[0])) for m in (attn.k_proj, attn.v_proj)]

    def kv(tokens: Sequence[int]) -> torch.Tensor:
        seen.clear()
        with torch.no_grad():
            hf(input_ids=torch.tensor([list(tokens)]))
        return torch.cat(seen, dim=-1)

    try:
        whole = kv(ids)
        expected = torch.zeros(len(ids))
        spans = [(o, o + len(seg.token_ids)) for o, seg in layout.unit_offsets()]
        for a, b in spans:
            expected[a:b] = (whole[a:b] - kv(ids[a:b])).pow(2).sum(dim=-1)
    finally:
        for h in hooks:
            h.remove()
    got = torch.tensor(engine.second_layer_deviation(ids, spans))
    assert max_diff(got, expected) < 1e-3 * max(1.0, float(expected.max()))
    assert float(expected.max()) > 0 and not got[:6].any() and not got[46:48].any()


@pytest.mark.parametrize("name", ["query", "deviation"])
@pytest.mark.integration
def test_a_policy_that_reads_the_model_recomputes_exactly_the_tokens_it_names(engine: EngineAdapter,
                                                                          name: str) -> None:
    """Composing with the policy is composing the ranges its select names, bit for bit."""
    layout = random_layout([("text", 6), ("unit", 40), ("text", 2), ("unit", 30), ("text", 9)], seed=15)
    policy = get_policy(name, recompute_tokens=2, recompute_budget=0.25).bound(engine)
    ranges = policy.select(layout)
    assert sum(b - a for a, b in ranges) > sum(b - a for a, b in get_policy("epic", recompute_tokens=2).select(layout))
    states = prefill_units(engine, layout)
    served = compose(engine, layout, policy, states, use_prefix_cache=False)
    named = compose(engine, layout, _Fixed(ranges), states, use_prefix_cache=False)
    assert served.computed == named.computed and torch.equal(served.logits, named.logits)


class _Fixed(CompositionPolicy):
    """Computes exactly the ranges it was given."""

    name = "test-fixed"

    def __init__(self, ranges: Ranges) -> None:
        self.ranges = ranges

    def select(self, layout: PromptLayout) -> Ranges:
        return self.ranges
