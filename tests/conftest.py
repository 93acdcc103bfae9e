"""Fixtures shared by every test module."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.engines.base import EngineAdapter, Extend, KVSlots, UnitPrefill, UnitState
from tessera.registry import Registry

REPO = Path(__file__).resolve().parents[1]

# the embedder and model must never reach for a hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# role processes started by tests (directly or through LocalCluster) import this checkout
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
# no sys.path edit: pytest's default (prepend) import mode puts tests/ on sys.path, so test
# modules import the helpers beside them (support.py, serving_support.py, ...)


# --- a fake engine for CPU unit tests of the scheduler and the executor ----------------------

FAKE_VOCAB = 32
FAKE_EOS = 31


@dataclasses.dataclass(eq=False)
class FakeSlots(KVSlots):
    n_slots: int
    filled: set[int] = dataclasses.field(default_factory=set)
    freed: bool = False


class FakeEngine(EngineAdapter):
    """An engine without a model: the next token after ``t`` is ``t + 1``; it records every call.

    It checks the adapter contract an executor must respect: slots below a computed position
    are filled first, and freed slots are never used again.
    """

    def __init__(self) -> None:
        self.batches: list[list[int]] = []  # token counts of each step's items, in batch order
        self.allocated: list[FakeSlots] = []
        self.placed: list[tuple[int, int]] = []  # (offset, n_tokens)

    def allocate(self, n_slots: int) -> KVSlots:
        slots = FakeSlots(n_slots)
        self.allocated.append(slots)
        return slots

    def free(self, slots: KVSlots) -> None:
        assert isinstance(slots, FakeSlots) and not slots.freed
        slots.freed = True

    def place(self, slots: KVSlots, offset: int, state: UnitState) -> None:
        assert isinstance(slots, FakeSlots) and not slots.freed
        slots.filled.update(range(offset, offset + state.n_tokens))
        self.placed.append((offset, state.n_tokens))

    def step(self, work: Sequence[UnitPrefill | Extend]) -> None:
        self.batches.append([len(item.token_ids) for item in work])
        for item in work:
            if isinstance(item, UnitPrefill):
                t = torch.zeros(1, len(item.token_ids), 1, 2)
                item.state = UnitState(t, t.clone())
                continue
            slots = item.slots
            assert isinstance(slots, FakeSlots) and not slots.freed
            missing = set(range(min(item.positions))) - slots.filled
            assert not missing, f"positions {sorted(missing)} are read before they are filled"
            slots.filled.update(item.positions)
            logits = torch.zeros(FAKE_VOCAB)
            logits[(item.token_ids[-1] + 1) % FAKE_VOCAB] = 1.0
            item.logits = logits

    def match_prefix(self, slots: KVSlots, token_ids: Sequence[int], namespace: str = "") -> int:
        return 0

    def insert_prefix(self, slots: KVSlots, token_ids: Sequence[int], namespace: str = "") -> None:
        pass

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (FAKE_EOS,)

    def encode(self, text: str) -> list[int]:
        return [ord(c) % FAKE_VOCAB for c in text]

    def decode_tokens(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def register() -> Iterator[Callable[[Registry[Any], str], Callable[[Any], Any]]]:
    """``@register(REGISTRY, "name")`` on a test's class; unregistered when the test ends.

    Regression: a test that registered its own policy left it registered, so running the
    suite twice in one process failed with "registered twice".
    """
    added: list[tuple[Registry[Any], str]] = []

    def add(registry: Registry[Any], name: str) -> Callable[[Any], Any]:
        added.append((registry, name))
        return registry.register(name)

    yield add
    for registry, name in added:
        registry.unregister(name)
