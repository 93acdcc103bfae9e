"""Helpers for the engine tests: tiny engines on random checkpoints, random prompt layouts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tessera.config import ClusterConfig, CompositionConfig, GenerationNodeConfig, ModelConfig
from tessera.engines.base import ENGINES, EngineAdapter, KVSlots
from tessera.engines.paged import PagedEngine
from tessera.engines.reference import TorchSlots
from tessera.engines.tiny import write_tiny_checkpoint
from tessera.messages import PromptLayout, Segment, SegmentKind

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
