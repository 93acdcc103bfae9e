"""The radix prefix cache matches, splits, evicts LRU leaves and serves exact prefixes to the engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.engines import max_diff, random_tokens, tiny_engine

from tessera.engines.base import Extend
from tessera.engines.offline import prefill
from tessera.engines.prefix_cache import PrefixCache


def kv_of(tokens: list[int]) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """K/V whose entries are the token ids themselves, so every chunk can be checked by content."""

    def kv(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(tokens[a:b], dtype=torch.float32).view(1, -1, 1, 1)
        return t, -t

    return kv


def content(cache: PrefixCache, tokens: list[int]) -> list[int]:
    hit = cache.match(tokens)
    return [int(x) for _, k, _ in hit.chunks for x in k.flatten()]


def test_match_returns_the_longest_cached_prefix_even_inside_an_edge() -> None:
    """After inserting a sequence, any sequence sharing a prefix matches exactly that prefix."""
    cache = PrefixCache(100)
    seq = [5, 6, 7, 8, 9]
    assert cache.insert(seq, kv_of(seq)) == 5
    assert cache.match([5, 6, 7, 1]).length == 3
    assert content(cache, [5, 6, 7, 1]) == [5, 6, 7]
    assert cache.match([4, 5]).length == 0
    assert cache.insert(seq, kv_of(seq)) == 0  # already cached


def test_diverging_insert_splits_the_edge_and_keeps_both_branches() -> None:
    """A sequence diverging mid-edge stores only its new tail; both branches still match fully."""
    cache = PrefixCache(100)
    a, b = [1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9]
    cache.insert(a, kv_of(a))
    assert cache.insert(b, kv_of(b)) == 3
    assert cache.n_tokens == 8
    assert content(cache, a) == a and content(cache, b) == b


def test_eviction_drops_least_recently_used_unlocked_leaves() -> None:
    """When full, the LRU leaf goes first; a locked path survives."""
    cache = PrefixCache(10)
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    cache.insert(a, kv_of(a))
    cache.insert(b, kv_of(b))
    cache.match(a)  # a is now more recent than b
    cache.insert(c, kv_of(c))
    assert cache.match(b).length == 0 and cache.match(a).length == 4 and cache.match(c).length == 4
    pinned = cache.match(a)
    cache.lock(pinned)
    cache.insert(b, kv_of(b))  # must evict c, not the older-but-locked a
    assert cache.match(a).length == 4 and cache.match(c).length == 0
    cache.unlock(pinned)
    assert cache.n_tokens <= cache.capacity


def test_inserts_beyond_capacity_are_truncated_and_zero_capacity_disables() -> None:
    """A prefix longer than the whole cache stores what fits; capacity 0 stores nothing."""
    cache = PrefixCache(6)
    long = list(range(10))
    assert cache.insert(long, kv_of(long)) == 6
    assert cache.match(long).length == 6
    off = PrefixCache(0)
    assert off.insert(long, kv_of(long)) == 0 and off.match(long).length == 0


@pytest.mark.integration
def test_engine_prefix_hit_gives_the_logits_of_a_full_prefill(tmp_path: Path) -> None:
    """Slots filled by match_prefix + extending the rest = prefilling everything."""
    engine = tiny_engine(tmp_path, "qwen3")
    system, question = random_tokens(64, 1), random_tokens(20, 2)
    first = engine.allocate(64)
    engine.step([Extend(first, system, range(64))])
    engine.insert_prefix(first, system)
    slots = engine.allocate(84)
    assert engine.match_prefix(slots, system + question) == 64
    rest = Extend(slots, question, range(64, 84))
    engine.step([rest])
    assert rest.logits is not None
    assert max_diff(rest.logits, prefill(engine, system + question).logits) < 1e-4


@pytest.mark.parametrize("n", [1, 63])
@pytest.mark.integration
def test_engine_match_copies_only_what_fits_the_slots(tmp_path: Path, n: int) -> None:
    """match_prefix never writes beyond the request's slots."""
    engine = tiny_engine(tmp_path, "llama")
    tokens = random_tokens(64, 3)
    slots = engine.allocate(64)
    engine.step([Extend(slots, tokens, range(64))])
    engine.insert_prefix(slots, tokens)
    assert engine.match_prefix(engine.allocate(n), tokens) == n


def test_namespaces_never_match_each_others_entries() -> None:
    """Regression: one tenant's cached prompt showed as another tenant's prefix hit."""
    cache = PrefixCache(64)
    kv = kv_of(list(range(16)))
    assert cache.insert(list(range(16)), kv, namespace="tenant-a") == 16
    assert cache.match(list(range(16)), namespace="tenant-b").length == 0
    assert cache.match(list(range(16))).length == 0
    assert cache.match(list(range(16)), namespace="tenant-a").length == 16
    assert cache.insert(list(range(16)), kv, namespace="tenant-b") == 16  # b stores its own copy
    assert cache.n_tokens == 32
    assert cache.evict(32) == 32 and cache.match(list(range(16)), namespace="tenant-a").length == 0
