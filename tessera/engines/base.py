"""What a serving engine must offer a Tessera generation node.

The generation node drives any backend through :class:`EngineAdapter`; nothing
engine-specific leaks into the node. A backend provides:

* independent unit prefill from position 0 that captures the *reusable form* of a unit:
  keys before RoPE and values, ``[L, T, H_kv, D]`` each, in the storage dtype;
* per-request KV slots, allocated once the prompt layout is fixed (before preparation);
* placement of a unit's reusable form at a given offset (RoPE applied at the real
  positions, honouring the model's rope scaling);
* one batched forward (:meth:`EngineAdapter.step`) over a mix of unit prefills and request
  extends (recomputed unit tokens + suffix, or one decode token), where every token carries an
  explicit position and a key is visible to a query iff its position is <= the query's within
  the same request;
* optionally (:attr:`EngineAdapter.fuses_unit_prefills`), a unit prefill carried inside a
  request's extend (:class:`UnitFeed`): the unit is prefilled independently in the same
  forward, and each layer's slice of its captured state is placed into the request's slots
  before the request's tokens attend at that layer, so a request that misses a unit reaches
  its first token in one forward instead of two;
* exact prefix caching over token ids (match into slots / insert from slots);
* freeing a request's slots (abort), and the model geometry.

Recomputed states live only in the request's slots: a backend must never write them back
into a :class:`UnitState`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.config import ClusterConfig
from tessera.engines.geometry import ModelGeometry
from tessera.errors import ConfigError
from tessera.registry import Registry
from tessera.units import ServingFingerprint

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class UnitState:
    """Reusable form of one unit: keys before RoPE and values, ``[L, T, H_kv, D]`` each."""

    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        assert self.keys.shape == self.values.shape and self.keys.dim() == 4, (self.keys.shape, self.values.shape)

    @property
    def n_tokens(self) -> int:
        return int(self.keys.shape[1])

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2


class KVSlots(ABC):
    """Opaque per-request KV storage owned by an engine; position p lives in slot p."""

    n_slots: int


@dataclass
class UnitPrefill:
    """Internal request: prefill ``token_ids`` independently from position 0.

    After :meth:`EngineAdapter.step`, ``state`` holds the captured reusable form.
    """

    token_ids: Sequence[int]
    state: UnitState | None = None


@dataclass
class UnitFeed:
    """A unit prefilled inside a request's extend, and placed into that request's slots.

    The unit is computed as a :class:`UnitPrefill` would be (independently, from position 0;
    ``state`` holds the captured reusable form after the step), and each ``(start, end,
    position)`` span puts the state's rows ``start..end`` at positions ``position..`` of the
    extend's slots, RoPE applied, exactly as :meth:`EngineAdapter.place` of those rows would:
    the request sees the same storage-dtype state a separate prefill and placement give it.
    """

    token_ids: Sequence[int]
    spans: Sequence[tuple[int, int, int]]
    state: UnitState | None = None

    def checked_spans(self, n_slots: int) -> list[tuple[int, int, int]]:
        """The non-empty spans, each checked to lie in the unit and in ``n_slots`` slots."""
        n = len(self.token_ids)
        out = []
        for start, end, position in self.spans:
            if not (0 <= start <= end <= n and 0 <= position <= n_slots - (end - start)):
                raise ValueError(f"a unit span {start}..{end} at position {position} does not fit a unit of "
                                 f"{n} tokens in {n_slots} slots")
            if end > start:
                out.append((start, end, position))
        return out


@dataclass
class Extend:
    """Compute ``token_ids`` at ``positions`` for one request, attending to its slots.

    Every slot whose position is below a computed token's position must already be filled
    (placed, prefix-matched or computed earlier); the computed tokens' K/V are written to
    their slots. After the step, ``logits`` holds the logits of the token at the highest
    position, ``[vocab]`` in float32.

    ``units`` (only for an engine whose :attr:`~EngineAdapter.fuses_unit_prefills` is true):
    units prefilled in the same forward and placed into these slots before the extend's
    tokens attend to them.

    ``tail_logits`` (only for an engine whose :attr:`~EngineAdapter.scores_tail` is true): after
    the step, ``tail`` holds the logits of the extend's last ``tail_logits`` tokens,
    ``[tail_logits, vocab]`` float32 in token order (a fixed answer scored in one forward).
    """

    slots: KVSlots
    token_ids: Sequence[int]
    positions: Sequence[int]
    logits: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    units: Sequence[UnitFeed] = ()
    tail_logits: int = 0
    tail: torch.Tensor | None = None

    @property
    def n_computed(self) -> int:
        """Tokens this extend computes, its units' included (what it costs a batch's budget)."""
        return len(self.token_ids) + sum(len(u.token_ids) for u in self.units)


_NO_PROBE = ("engine {} cannot read its model for a composition policy (composition.policy = \"query\" or "
             "\"deviation\" needs model.engine = \"reference\" or \"paged\")")


class EngineAdapter(ABC):
    """Contract between a generation node and a model backend (see the module docstring).

    All methods are synchronous and may block for the duration of a forward pass; the node
    calls them from one worker thread, never concurrently.
    """

    geometry: ModelGeometry
    fingerprint: ServingFingerprint
    # True: step() honours Extend.units (a missing unit is prefilled in its request's own
    # forward); False: the node prefills it as a separate UnitPrefill and places it first
    fuses_unit_prefills: bool = False
    # True: first_layer_attention() and second_layer_deviation() answer (policies that read the model)
    probes_model: bool = False
    # True: step() honours Extend.tail_logits; False: a fixed answer is scored a decode step a token
    scores_tail: bool = False

    @abstractmethod
    def allocate(self, n_slots: int) -> KVSlots:
        """Reserve KV slots for a request of up to ``n_slots`` positions (prompt + decode)."""

    @abstractmethod
    def free(self, slots: KVSlots) -> None:
        """Release a request's slots (finished or aborted)."""

    @abstractmethod
    def place(self, slots: KVSlots, offset: int, state: UnitState) -> None:
        """Write ``state`` into slots ``offset .. offset+T``, RoPE applied at those positions."""

    @abstractmethod
    def step(self, work: Sequence[UnitPrefill | Extend]) -> None:
        """One batched forward over unit prefills and request extends (fills results in place)."""

    @abstractmethod
    def match_prefix(self, slots: KVSlots, token_ids: Sequence[int], namespace: str = "") -> int:
        """Copy the longest exact prefix of ``token_ids`` cached in ``namespace`` (the tenant)
        into slots; return its length. Another namespace's entries never match."""

    @abstractmethod
    def insert_prefix(self, slots: KVSlots, token_ids: Sequence[int], namespace: str = "") -> None:
        """Offer slots ``0 .. len(token_ids)`` (computed exactly) to the prefix cache of ``namespace``."""

    def on_engine_thread(self) -> None:
        """Called once on the thread that will make every later call, before the first.

        Loading may happen on another thread; an engine whose kernels keep per-thread state
        (an OpenMP team bound to cores) sets it up for this thread here. By default nothing."""
        return None

    def first_layer_attention(self, token_ids: Sequence[int], query_from: int) -> list[float]:
        """See :class:`~tessera.composition.policies.ModelProbe`; engines that set ``probes_model``
        implement it and :meth:`second_layer_deviation`."""
        raise ConfigError(_NO_PROBE.format(type(self).__name__))

    def second_layer_deviation(self, token_ids: Sequence[int], units: Sequence[tuple[int, int]]) -> list[float]:
        """See :class:`~tessera.composition.policies.ModelProbe`."""
        raise ConfigError(_NO_PROBE.format(type(self).__name__))

    def decode(self, work: Sequence[Extend]) -> None:
        """One decode step (one token per request); backends may override with a faster path."""
        self.step(work)

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Tokenize without adding special tokens."""

    @abstractmethod
    def decode_tokens(self, token_ids: Sequence[int]) -> str: ...

    @classmethod
    def from_config(cls, cfg: ClusterConfig, prefix_cache_tokens: int) -> EngineAdapter:
        """Load the configured model (``model.*``); raises ModelLoadError naming what is wrong.

        Engines selectable as ``model.engine`` implement this; adapters built by hand in tests
        need not.
        """
        raise ConfigError(f"engine {cls.__name__} cannot be built from tessera.toml (it has no from_config)")


# ``model.engine`` in tessera.toml names one of these; a test or a plugin may register more.
ENGINES: Registry[type[EngineAdapter]] = Registry(
    "model.engine", {"reference": "tessera.engines.reference", "paged": "tessera.engines.paged",
                     "sglang": "tessera.engines.sglang"})


def load_engine(cfg: ClusterConfig, prefix_cache_tokens: int) -> EngineAdapter:
    """The configured engine adapter with its model loaded."""
    return ENGINES.get(cfg.model.engine).from_config(cfg, prefix_cache_tokens)
