"""A generation node's local unit cache under revocation (the node side of a delete)."""

from __future__ import annotations

from helpers.kvpool import random_state

from tessera.generation.unit_cache import LocalUnitCache


def cache_with(*units: str) -> LocalUnitCache:
    cache = LocalUnitCache(capacity_blocks=16, block_tokens=4, pin_memory=False)
    for u in units:
        assert cache.insert(u, random_state(4))[0]
    return cache


def test_a_revoked_unit_is_dropped_at_once_when_nothing_pins_it() -> None:
    """Unpinned: gone now, its blocks free, and no later snapshot reports it."""
    cache = cache_with("a", "b")
    assert cache.revoke(["a", "never-held"]) == 1
    assert "a" not in cache and cache.used_blocks == 1
    assert cache.held("r1", ["a", "b"]) == ["b"]


def test_a_pinned_revoked_unit_goes_when_its_last_pin_is_released() -> None:
    """A request that started before the revocation keeps its copy until it unpins; nobody else gets it."""
    cache = cache_with("a")
    assert cache.held("early", ["a"]) == ["a"]
    assert cache.revoke(["a"]) == 0
    assert cache.get("a") is not None  # the early request still reads it
    assert cache.held("late", ["a"]) == []  # a snapshot after the revocation does not offer it
    cache.unpin_request("early")
    assert "a" not in cache and cache.used_blocks == 0


def test_a_late_insert_of_a_revoked_unit_is_declined() -> None:
    """A request planned before the revocation finishes its prefill afterwards: the node does not keep it."""
    cache = cache_with()
    cache.revoke(["a"])
    assert cache.insert("a", random_state(4)) == (False, [])
    assert cache.residency() == []
