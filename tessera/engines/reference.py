"""The PyTorch reference engine: our own forward (CPU or CUDA) behind the EngineAdapter contract.

Per-request KV lives in :class:`TorchSlots`: post-RoPE keys and values ``[L, n_slots, H_kv, D]``
in the compute dtype, position p in slot p. Reusable unit states are ``[L, T, H_kv, D]`` keys
before RoPE and values in ``kv_dtype``; placement rotates them into slots with the kernel in
:mod:`tessera.kernels.rope` and never writes back into a state. Exact prefixes are shared
through a radix :class:`PrefixCache` of post-RoPE KV.

This module knows nothing about plans, transports or which units are cached where.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tessera.config import ClusterConfig
from tessera.engines.base import (
    DTYPES,
    ENGINES,
    EngineAdapter,
    Extend,
    KVSlots,
    UnitFeed,
    UnitPrefill,
    UnitState,
)
from tessera.engines.checkpoint import Checkpoint, load_config_dict, resolve
from tessera.engines.device import placement
from tessera.engines.geometry import ModelGeometry
from tessera.engines.model import Feed, Item, Model
from tessera.engines.prefix_cache import PrefixCache
from tessera.engines.tokenizer import Tokenized, Tokenizer, load_tokenizer, serving_fingerprint
from tessera.engines.weights import ModelSpec
from tessera.errors import BadRequest, ConfigError
from tessera.kernels.rope import rope_place_span
from tessera.units import ServingFingerprint

DEFAULT_PREFIX_CACHE_TOKENS = 16384


class TorchSlots(KVSlots):
    """Post-RoPE K and V of one request, ``[L, n_slots, H_kv, D]`` each (compute dtype)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys
        self.values = values
        self.n_slots = int(keys.shape[1])
        self.freed = False


@ENGINES.register("reference")
class ReferenceEngine(Tokenized, EngineAdapter):
    fuses_unit_prefills = True  # Extend.units: see tessera.engines.model (Feed)
    scores_tail = True  # Extend.tail_logits: the model returns an item's last rows' logits
    probes_model = True  # first_layer_attention, second_layer_deviation: the model's own

    def __init__(self, model: Model, tokenizer: Tokenizer, fingerprint: ServingFingerprint, *,
                 kv_dtype: str = "float16", unit_bos: bool = False,
                 prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS) -> None:
        s = model.spec
        self.model = model
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.kv_dtype = DTYPES[kv_dtype]
        self.geometry = ModelGeometry(s.n_layers, s.n_kv_heads, s.head_dim, s.vocab_size,
                                      model.max_positions, kv_dtype)
        if unit_bos and tokenizer.bos_token_id is None:
            raise ConfigError("composition.unit_bos = true needs a tokenizer with a BOS token; this one has none")
        self.bos: int | None = tokenizer.bos_token_id if unit_bos else None
        self.prefix_cache = PrefixCache(prefix_cache_tokens)

    @classmethod
    def from_config(cls, cfg: ClusterConfig,
                    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS) -> ReferenceEngine:
        """Load the configured model (``model.threads`` also sets torch's intra-op threads)."""
        model, tokenizer, fingerprint = load_model(cfg)
        return cls(model, tokenizer, fingerprint, kv_dtype=cfg.kv_dtype,
                   unit_bos=cfg.composition.unit_bos, prefix_cache_tokens=prefix_cache_tokens)

    # --- slots ----------------------------------------------------------------------------

    def first_layer_attention(self, token_ids: Sequence[int], query_from: int) -> list[float]:
        return self.model.first_layer_attention(token_ids, query_from)

    def second_layer_deviation(self, token_ids: Sequence[int], units: Sequence[tuple[int, int]]) -> list[float]:
        return self.model.second_layer_deviation(token_ids, units, self.bos)

    def allocate(self, n_slots: int) -> TorchSlots:
        if not 0 < n_slots <= self.geometry.max_context:
            raise BadRequest(f"a request needs {n_slots} positions; this model serves 1..{self.geometry.max_context}")
        g, m = self.geometry, self.model
        shape = (g.n_layers, n_slots, g.n_kv_heads, g.head_dim)
        # uninitialised on purpose: the contract fills every slot below a computed position first
        return TorchSlots(torch.empty(shape, dtype=m.dtype, device=m.device),
                          torch.empty(shape, dtype=m.dtype, device=m.device))

    def free(self, slots: KVSlots) -> None:
        s = _torch_slots(slots)
        s.keys = s.values = torch.empty(0)
        s.freed = True

    def place(self, slots: KVSlots, offset: int, state: UnitState) -> None:
        s = _torch_slots(slots)
        checked = placement(state, offset, s.n_slots, self.geometry, self.kv_dtype, s.keys.device)
        if checked is None:
            return
        state, n = checked, checked.n_tokens
        self.model.rope.ensure(offset + n)
        rope_place_span(state.keys, offset, self.model.rope.cos, self.model.rope.sin, s.keys)
        s.values[:, offset:offset + n].copy_(state.values)

    # --- forward --------------------------------------------------------------------------

    def step(self, work: Sequence[UnitPrefill | Extend]) -> None:
        items: list[Item] = []
        extends: list[Extend] = []
        for w in work:
            if isinstance(w, UnitPrefill):
                w.state, item = self._unit_item(w.token_ids)
                if item is not None:
                    items.append(item)
            else:
                s = _torch_slots(w.slots)
                if not w.token_ids or len(w.token_ids) != len(w.positions):
                    raise ValueError(f"an extend needs >= 1 token and one position per token; got "
                                     f"{len(w.token_ids)} tokens, {len(w.positions)} positions")
                # the request's own units first: their rows reach its slots layer by layer,
                # before its tokens attend (an item's place in the batch does not matter)
                for u in w.units:
                    u.state, item = self._unit_item(u.token_ids, self._feeds(u, s))
                    if item is not None:
                        items.append(item)
                if not 0 <= w.tail_logits <= len(w.token_ids):
                    raise ValueError(f"tail_logits {w.tail_logits} of an extend of {len(w.token_ids)} tokens")
                items.append(Item(w.token_ids, w.positions, kv=(s.keys, s.values), logits=True, tail=w.tail_logits))
                extends.append(w)
        if not items:
            return
        logits = self.model.forward(items)
        row = 0
        for ext in extends:
            ext.logits = logits[row]
            if ext.tail_logits:
                ext.tail = logits[row + 1:row + 1 + ext.tail_logits]
            row += 1 + ext.tail_logits
        assert row == logits.shape[0], (row, logits.shape)

    def _unit_item(self, token_ids: Sequence[int], feeds: Sequence[Feed] = ()) -> tuple[UnitState, Item | None]:
        """An empty state of the unit's shape, and the fresh item that captures into it (None: no tokens)."""
        g, dev = self.geometry, self.model.device
        shape = (g.n_layers, len(token_ids), g.n_kv_heads, g.head_dim)
        state = UnitState(torch.empty(shape, dtype=self.kv_dtype, device=dev),
                          torch.empty(shape, dtype=self.kv_dtype, device=dev))
        if not token_ids:
            return state, None
        lead = [] if self.bos is None else [self.bos]
        return state, Item(lead + list(token_ids), capture=(state.keys, state.values), capture_from=len(lead),
                           feeds=feeds)

    @staticmethod
    def _feeds(unit: UnitFeed, slots: TorchSlots) -> list[Feed]:
        return [Feed((slots.keys, slots.values), start, end, position)
                for start, end, position in unit.checked_spans(slots.n_slots)]

    # --- exact prefix cache ---------------------------------------------------------------

    def match_prefix(self, slots: KVSlots, token_ids: Sequence[int], namespace: str = "") -> int:
        s = _torch_slots(slots)
        hit = self.prefix_cache.match(token_ids[:s.n_slots], namespace)
        for start, keys, values in hit.chunks:
            end = start + keys.shape[1]
            s.keys[:, start:end].copy_(keys)
            s.values[:, start:end].copy_(values)
        return hit.length

    def insert_prefix(self, slots: KVSlots, token_ids: Sequence[int], namespace: str = "") -> None:
        s = _torch_slots(slots)
        assert len(token_ids) <= s.n_slots, (len(token_ids), s.n_slots)
        self.prefix_cache.insert(
            token_ids, lambda a, b: (s.keys[:, a:b].clone(), s.values[:, a:b].clone()), namespace)


def load_model(cfg: ClusterConfig) -> tuple[Model, Tokenizer, ServingFingerprint]:
    """The configured model on its device, its tokenizer and the serving fingerprint (any torch engine)."""
    torch.set_num_threads(cfg.model.threads)
    checkpoint: Checkpoint = resolve(cfg.model)
    spec = ModelSpec.from_config(load_config_dict(checkpoint))
    device = torch.device(cfg.model.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device = {cfg.model.device!r} but this torch has no CUDA "
                          f"({torch.__version__}); use \"cpu\" or install a CUDA build of torch")
    model = Model.load(checkpoint.path, spec, DTYPES[cfg.model.dtype], device, cfg.model.max_context)
    tokenizer = load_tokenizer(checkpoint)
    return model, tokenizer, serving_fingerprint(cfg, checkpoint, tokenizer)


def _torch_slots(slots: KVSlots) -> TorchSlots:
    assert isinstance(slots, TorchSlots), f"slots from another engine: {type(slots).__name__}"
    assert not slots.freed, "slots used after free()"
    return slots
