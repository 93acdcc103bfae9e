"""Engines for tests: tiny engines on random checkpoints, random prompt layouts, and a fake engine."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tessera.config import ClusterConfig, CompositionConfig, GenerationNodeConfig, ModelConfig
from tessera.engines.base import ENGINES, EngineAdapter, Extend, KVSlots, UnitPrefill, UnitState
from tessera.engines.paged import PagedEngine
from tessera.engines.reference import TorchSlots
from tessera.engines.tiny import write_tiny_checkpoint
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small on purpose: with head_dim 16 every frequency band (kept, smoothed, divided) is hit
    "original_max_position_embeddings": 64,
}


# engines that run on CPU and share the contract tests
ENGINE_NAMES = ("reference", "paged")


def tiny_config(source: Path, *, kv_dtype: str = "float32", unit_bos: bool = False, dtype: str = "float32",
                threads: int = 2, engine: str = "reference", device: str = "cpu",
                kv_pool_tokens: int = 8192) -> ClusterConfig:
    return ClusterConfig(
        kv_dtype=kv_dtype,
        # a small pool: the paged engine's default (4x the context) is more than the tests need
        model=ModelConfig(source=str(source), dtype=dtype, threads=threads, engine=engine, device=device,
                          kv_pool_tokens=kv_pool_tokens),
        composition=CompositionConfig(unit_bos=unit_bos),
        generation=(GenerationNodeConfig("gen0"),),
    )


def tiny_engine(directory: Path, arch: str = "llama", *, prefix_cache_tokens: int = 4096,
                checkpoint_opts: dict[str, Any] | None = None, **config_opts: Any) -> Any:
    """An engine (``engine=`` "reference" by default, or "paged") on a tiny random checkpoint."""
    if not (directory / "config.json").is_file():
        write_tiny_checkpoint(directory, arch, **(checkpoint_opts or {}))
    cfg = tiny_config(directory, **config_opts)
    return ENGINES.get(cfg.model.engine).from_config(cfg, prefix_cache_tokens)


def slot_kv(engine: EngineAdapter, slots: KVSlots) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE K and V of every slot of a request, ``[L, n_slots, H_kv, D]`` each (either engine)."""
    if isinstance(slots, TorchSlots):
        return slots.keys, slots.values
    assert isinstance(engine, PagedEngine), type(engine).__name__
    return engine.pool.read(slots, 0, slots.n_slots)  # type: ignore[arg-type]


def random_tokens(n: int, seed: int, vocab: int = 49152) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    # stay clear of the special tokens at the bottom of the vocabulary
    return tuple(int(t) for t in torch.randint(100, vocab, (n,), generator=g))


def random_layout(parts: Sequence[tuple[str, int]], seed: int = 0) -> PromptLayout:
    """Layout from ("text"|"unit", n_tokens) parts; unit k is named ``u{k}``."""
    segments = []
    for i, (kind, n) in enumerate(parts):
        tokens = random_tokens(n, seed * 1000 + i)
        if kind == "unit":
            segments.append(Segment(SegmentKind.UNIT, tokens, f"u{i}"))
        else:
            segments.append(Segment(SegmentKind.TEXT, tokens))
    return PromptLayout(tuple(segments))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


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
        self.batches.append([item.n_computed if isinstance(item, Extend) else len(item.token_ids) for item in work])
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


class FusingFakeEngine(FakeEngine):
    """A :class:`FakeEngine` that prefills an extend's units in the same step and fills their spans
    (``fuses_unit_prefills``, as the reference engine does); ``batches`` counts their tokens too."""

    fuses_unit_prefills = True

    def step(self, work: Sequence[UnitPrefill | Extend]) -> None:
        for item in work:
            if not isinstance(item, Extend):
                continue
            slots = item.slots
            assert isinstance(slots, FakeSlots) and not slots.freed
            for unit in item.units:
                t = torch.zeros(1, len(unit.token_ids), 1, 2)
                unit.state = UnitState(t, t.clone())
                for start, end, position in unit.spans:
                    slots.filled.update(range(position, position + end - start))
                    self.placed.append((position, end - start))
        super().step(work)


class HeldStepsFakeEngine(FakeEngine):
    """A :class:`FakeEngine` that logs its steps and prefix inserts in order (``events``: "step N",
    "insert <tokens> <namespace>"). Each step numbered in ``held`` waits on the engine thread
    until the test sets ``release[N]``; with ``fail_insert`` every insert raises. An insert
    from freed slots fails the test."""

    def __init__(self, held: Sequence[int] = (), fail_insert: bool = False) -> None:
        super().__init__()
        self.events: list[str] = []
        self.release = {n: threading.Event() for n in held}
        self.fail_insert = fail_insert

    def step(self, work: Sequence[UnitPrefill | Extend]) -> None:
        n = len(self.batches) + 1
        self.events.append(f"step {n}")
        if n in self.release:
            assert self.release[n].wait(60), f"the test never released step {n}"
        super().step(work)

    def insert_prefix(self, slots: KVSlots, token_ids: Sequence[int], namespace: str = "") -> None:
        assert isinstance(slots, FakeSlots) and not slots.freed, "inserted from freed slots"
        self.events.append(f"insert {len(token_ids)} {namespace}")
        if self.fail_insert:
            raise RuntimeError("prefix cache is broken")
