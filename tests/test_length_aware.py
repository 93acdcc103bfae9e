"""Length-aware LegoLink: per-unit recompute counts by length, and units served as plain text."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.engines import random_layout, tiny_engine

from tessera.composition.policies import LegoLink, get_policy, policy_from_config
from tessera.config import CompositionConfig
from tessera.engines.offline import compose, prefill_units
from tessera.errors import ConfigError
from tessera.messages.prompt import SegmentKind


def test_the_recompute_count_follows_the_unit_length() -> None:
    """min(k, ceil(fraction * n)): a short record recomputes a share, a long passage k tokens."""
    policy = LegoLink(recompute_tokens=16, recompute_fraction=0.25)
    assert [policy.recompute_count(n) for n in (1, 8, 25, 64, 200)] == [1, 2, 7, 16, 16]
    plain = LegoLink(recompute_tokens=16, recompute_fraction=1.0)  # the first k tokens whatever the length
    assert [plain.recompute_count(n) for n in (1, 8, 25, 200)] == [1, 8, 16, 16]
    assert LegoLink(recompute_tokens=16, recompute_fraction=0.0).recompute_count(50) == 0


def test_select_recomputes_each_unit_by_its_own_length() -> None:
    """A 24-token record recomputes 6 tokens and a 100-token passage 16, plus all text."""
    layout = random_layout([("text", 5), ("unit", 24), ("text", 2), ("unit", 100), ("text", 3)])
    ranges = LegoLink(16, 0.25).select(layout)
    assert ranges == ((0, 5 + 6), (29, 31 + 16), (131, 134))


def test_units_recomputed_nearly_whole_become_plain_text() -> None:
    """With k = 16 and inline_share 0.75, a 17-token unit is text; a 64-token unit stays a unit."""
    layout = random_layout([("text", 5), ("unit", 17), ("text", 2), ("unit", 64), ("text", 3)])
    policy = LegoLink(16, 1.0, inline_share=0.75)
    inlined = policy.inline(layout)
    assert inlined.token_ids() == layout.token_ids()
    assert [(s.kind, len(s.token_ids)) for s in inlined.segments] == [
        (SegmentKind.TEXT, 5 + 17 + 2), (SegmentKind.UNIT, 64), (SegmentKind.TEXT, 3)]
    assert policy.inline(inlined) == inlined  # idempotent: the node's policy sees no more to inline
    short = LegoLink(16, 0.25, inline_share=0.75)  # the same unit recomputes 5 of 17 tokens: kept
    assert short.inline(layout) is layout


@pytest.mark.integration
def test_an_inlined_unit_composes_as_if_recomputed_whole(tmp_path: Path) -> None:
    """Composing the inlined layout equals full prefill for a prompt whose only unit is inlined."""
    engine = tiny_engine(tmp_path)
    layout = random_layout([("text", 6), ("unit", 10), ("text", 4)], seed=3)
    policy = LegoLink(16, 1.0, inline_share=1.0)
    inlined = policy.inline(layout)
    assert all(s.kind is SegmentKind.TEXT for s in inlined.segments)
    out = compose(engine, inlined, policy, prefill_units(engine, inlined), use_prefix_cache=False)
    full = compose(engine, layout, get_policy("full"), {}, use_prefix_cache=False)
    assert out.n_placed == 0 and float((out.logits - full.logits).abs().max()) == 0.0


def test_config_keys_reach_the_policy_and_are_validated() -> None:
    """recompute_fraction and inline_share come from [composition]; bad values name the key."""
    policy = policy_from_config(CompositionConfig(recompute_tokens=8, recompute_fraction=0.5, inline_share=0.9))
    assert isinstance(policy, LegoLink) and (policy.k, policy.fraction, policy.inline_share) == (8, 0.5, 0.9)
    with pytest.raises(ConfigError, match=r"composition\.recompute_fraction"):
        CompositionConfig(recompute_fraction=1.5)
    with pytest.raises(ConfigError, match=r"composition\.inline_share"):
        CompositionConfig(inline_share=0.0)
