"""``model.engine = "sglang"``: a generation node on SGLang's model code, kernels and KV pool.

The node's scheduler stays Tessera's; each :meth:`SGLangEngine.step` is one forward of
SGLang's model (its embedding, norms, fused projections, RoPE kernel and MLP) with
:class:`~tessera.engines.sglang.attention.ComposeAttention` published as its attention
backend. Per-request KV lives in SGLang's token pool: a request holds one row of SGLang's
request-to-token table and one pool location per position.

The reusable form of a unit is the same as the reference engine's (keys before RoPE and
values in ``kv_dtype``): keys are taken as the model's RoPE module receives them (after any
key norm) and values as attention receives them. Placement rotates a state with the model's
own RoPE module, so rope scaling is SGLang's. Exact prefixes are shared per tenant through
Tessera's radix :class:`~tessera.engines.prefix_cache.PrefixCache` of post-RoPE KV copied out
of the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tessera.config import ClusterConfig
from tessera.engines.base import DTYPES, ENGINES, EngineAdapter, Extend, KVSlots, UnitPrefill, UnitState
from tessera.engines.checkpoint import load_config_dict, resolve
from tessera.engines.device import placement
from tessera.engines.geometry import ModelGeometry
from tessera.engines.prefix_cache import PrefixCache
from tessera.engines.sglang.attention import Batch, ComposeAttention, Seq, runs
from tessera.engines.sglang.runner import RunnerSpec, build_runner
from tessera.engines.tokenizer import Tokenized, Tokenizer, load_tokenizer, serving_fingerprint
from tessera.engines.weights import ModelSpec
from tessera.errors import BadRequest, ConfigError
from tessera.units import ServingFingerprint

DEFAULT_PREFIX_CACHE_TOKENS = 16384


class SGLangSlots(KVSlots):
    """One request's KV in SGLang's pool: its request row and a pool location per position."""

    def __init__(self, req_idx: int, locs: torch.Tensor) -> None:
        self.req_idx = req_idx
        self.locs = locs
        self.n_slots = int(locs.numel())
        self.freed = False


class _CapturingRope(nn.Module):
    """The model's RoPE module for one layer, recording the keys it is given (before rotation)."""

    attention: ComposeAttention  # not a module: it hands this wrapper the forward's batch

    def __init__(self, inner: nn.Module, layer_id: int, attention: ComposeAttention) -> None:
        super().__init__()
        self.inner = inner
        self.layer_id = layer_id
        self.attention = attention

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *args: Any,
                **kwargs: Any) -> Any:
        batch = self.attention.batch
        if batch is not None:
            for s in batch.seqs:
                if s.capture is not None:
                    keys = s.capture[0]
                    # copied before the call: SGLang's CPU RoPE kernel may rotate in place
                    keys[self.layer_id].copy_(k[s.start + s.capture_from:s.end].view(keys.shape[1:]))
        return self.inner(positions, q, k, *args, **kwargs)


@ENGINES.register("sglang")
class SGLangEngine(Tokenized, EngineAdapter):
    fuses_unit_prefills = True  # Extend.units: a missed unit is prefilled in its request's own forward

    def __init__(self, runner: Any, tokenizer: Tokenizer, fingerprint: ServingFingerprint, spec: ModelSpec, *,
                 kv_dtype: str = "float16", unit_bos: bool = False, max_context: int = 0,
                 kernels: bool = True, prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS) -> None:
        self.runner = runner
        self.model = runner.model
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.kv_dtype = DTYPES[kv_dtype]
        self.device = torch.device(runner.device)
        self.pool = runner.token_to_kv_pool
        self.req_to_token = runner.req_to_token_pool
        self.allocator = runner.token_to_kv_pool_allocator
        self.dtype = self.pool.get_key_buffer(0).dtype
        self.geometry = ModelGeometry(spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.vocab_size,
                                      max_context or int(runner.model_config.context_len), kv_dtype)
        if unit_bos and tokenizer.bos_token_id is None:
            raise ConfigError("composition.unit_bos = true needs a tokenizer with a BOS token; this one has none")
        self.bos: int | None = tokenizer.bos_token_id if unit_bos else None
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.attention = ComposeAttention(self.pool, self.req_to_token, kernels=kernels, rotate=self.rotate)
        self.rope = self._wrap_rope()

    def on_engine_thread(self) -> None:
        """Bind this thread's OpenMP team to the runner's cores, as SGLang binds its own scheduler's.

        SGLang binds the team of the thread that built the runner; OpenMP gives every other
        thread a team of its own, unbound, whose threads migrate between cores: the node's
        engine thread would run every forward far slower than SGLang's server does."""
        cores = getattr(self.runner, "local_omp_cpuid", None)
        bind = getattr(getattr(torch.ops, "sgl_kernel", None), "init_cpu_threads_env", None)
        if self.device.type == "cpu" and cores and bind is not None:
            bind(str(cores))

    @classmethod
    def from_config(cls, cfg: ClusterConfig,
                    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS) -> SGLangEngine:
        """SGLang's runner for ``[model]`` (a transformers checkpoint; the bundled GGUF is converted)."""
        checkpoint = resolve(cfg.model)
        spec = ModelSpec.from_config(load_config_dict(checkpoint))
        max_context = cfg.model.max_context or spec.max_positions
        runner = build_runner(RunnerSpec.of(cfg, checkpoint.path, max_context))
        tokenizer = load_tokenizer(checkpoint)
        return cls(runner, tokenizer, serving_fingerprint(cfg, checkpoint, tokenizer), spec,
                   kv_dtype=cfg.kv_dtype, unit_bos=cfg.composition.unit_bos, max_context=max_context,
                   kernels=cfg.model.device == "cpu" and cfg.sglang.attention_backend == "intel_amx",
                   prefix_cache_tokens=prefix_cache_tokens)

    def _wrap_rope(self) -> nn.Module:
        """Wrap every attention layer's RoPE module to capture unit keys; return one to place with."""
        first: nn.Module | None = None
        for module in self.model.modules():
            attn, rope = getattr(module, "attn", None), getattr(module, "rotary_emb", None)
            if attn is None or rope is None or isinstance(rope, _CapturingRope):
                continue
            module.rotary_emb = _CapturingRope(rope, int(attn.layer_id), self.attention)
            first = first or rope
        if first is None:
            raise ConfigError(f"model {type(self.model).__name__} has no attention layer with a rotary_emb; "
                              "model.engine = \"sglang\" supports RoPE decoder models (Llama, Qwen, Mistral)")
        return first

    # --- slots ----------------------------------------------------------------------------

    def allocate(self, n_slots: int) -> SGLangSlots:
        if not 0 < n_slots <= self.geometry.max_context:
            raise BadRequest(f"a request needs {n_slots} positions; this model serves 1..{self.geometry.max_context}")
        if not self.req_to_token.free_slots:
            raise BadRequest(f"the engine holds slots for {self.req_to_token.size} requests at once, all in use; "
                             "retry, or raise sglang.max_requests")
        locs = self.allocator.alloc(n_slots)
        if locs is None:
            raise BadRequest(f"a request needs {n_slots} KV slots and SGLang's pool has "
                             f"{self.allocator.available_size()} free; retry, or raise sglang.max_total_tokens")
        idx = self.req_to_token.free_slots.pop()
        self.req_to_token.write((idx, slice(0, n_slots)), locs.to(torch.int32))
        return SGLangSlots(idx, locs)

    def free(self, slots: KVSlots) -> None:
        s = _slots(slots)
        self.allocator.free(s.locs)
        self.req_to_token.free_slots.append(s.req_idx)
        s.locs = torch.empty(0, dtype=torch.int64)
        s.freed = True

    def place(self, slots: KVSlots, offset: int, state: UnitState) -> None:
        s = _slots(slots)
        checked = placement(state, offset, s.n_slots, self.geometry, self.kv_dtype, self.device)
        if checked is None:
            return
        positions = torch.arange(offset, offset + checked.n_tokens, device=self.device)
        self.write_slots(s, offset, self.rotate(checked.keys, positions), checked.values.to(self.dtype))

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys before RoPE ``[L, T, H, D]`` rotated at ``positions`` by the model's RoPE, in the pool dtype."""
        n_layers, n, heads, dim = keys.shape
        flat = keys.to(self.dtype).permute(1, 0, 2, 3).reshape(n, n_layers * heads * dim).contiguous()
        # the RoPE module rotates a query and a key: every layer's keys go in as one query
        rotated, _ = self.rope(positions.to(torch.int64), flat, flat[:, :heads * dim].clone())
        out: torch.Tensor = rotated.reshape(n, n_layers, heads, dim).permute(1, 0, 2, 3)
        return out

    # --- forward --------------------------------------------------------------------------

    def step(self, work: Sequence[UnitPrefill | Extend]) -> None:
        seqs: list[Seq] = []
        ids: list[int] = []
        extends: list[tuple[Extend, int]] = []
        for w in work:
            if isinstance(w, UnitPrefill):
                w.state = self._unit(w.token_ids, seqs, ids)
                continue
            s = _slots(w.slots)
            if not w.token_ids or len(w.token_ids) != len(w.positions):
                raise ValueError(f"an extend needs >= 1 token and one position per token; got "
                                 f"{len(w.token_ids)} tokens, {len(w.positions)} positions")
            positions = [int(p) for p in w.positions]
            if min(positions) < 0 or max(positions) >= s.n_slots:
                raise ValueError(f"positions {min(positions)}..{max(positions)} do not fit {s.n_slots} slots")
            if sorted(positions) != positions or len(set(positions)) != len(positions):
                raise ValueError("an extend's positions must be strictly increasing")
            # the request's own units first: each layer of theirs reaches its slots before it attends
            for u in w.units:
                u.state = self._unit(u.token_ids, seqs, ids, u.checked_spans(s.n_slots), s.locs)
            start = len(ids)
            for a, b in runs(positions):
                seqs.append(Seq("tail", start + a, positions[a:b], req_idx=s.req_idx, locs=s.locs))
            ids += [int(t) for t in w.token_ids]
            extends.append((w, start + len(positions) - 1))  # the highest position is the last
        if not seqs:
            return
        # one token per request and no unit: SGLang's decode kernel
        decode = len(seqs) == len(extends) and all(s.kind == "tail" and s.n == 1 for s in seqs)
        logits = self._forward(Batch(seqs, decode=decode, device=self.device), ids, [r for _, r in extends])
        for (ext, _), row in zip(extends, logits, strict=True):
            ext.logits = row

    def _unit(self, token_ids: Sequence[int], seqs: list[Seq], ids: list[int],
              feeds: list[tuple[int, int, int]] | None = None, feed_locs: torch.Tensor | None = None) -> UnitState:
        """An empty state of the unit's shape; its sequence (which captures into it) joins the batch."""
        g = self.geometry
        shape = (g.n_layers, len(token_ids), g.n_kv_heads, g.head_dim)
        state = UnitState(torch.empty(shape, dtype=self.kv_dtype, device=self.device),
                          torch.empty(shape, dtype=self.kv_dtype, device=self.device))
        if token_ids:
            lead = [] if self.bos is None else [self.bos]
            tokens = lead + list(token_ids)
            seqs.append(Seq("unit", len(ids), list(range(len(tokens))), capture=(state.keys, state.values),
                            capture_from=len(lead), feeds=feeds or [], feed_locs=feed_locs))
            ids += tokens
        return state

    def _forward(self, batch: Batch, ids: list[int], logit_rows: list[int]) -> torch.Tensor:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        dev = self.device
        positions = torch.tensor([p for s in batch.seqs for p in s.positions], dtype=torch.int64, device=dev)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        marker = _ForwardMarker(ForwardMode.DECODE if batch.decode else ForwardMode.EXTEND)
        self.attention.begin(batch)
        try:
            with torch.no_grad(), forward_context(ForwardContext(attn_backend=self.attention)):
                hidden = self.model.model(input_ids, positions, marker)
                if not logit_rows:
                    return torch.empty(0, self.geometry.vocab_size)
                rows = hidden[torch.tensor(logit_rows, device=dev)]
                logits = self.model.logits_processor._compute_lm_head(rows, self.model.lm_head)
        finally:
            self.attention.end()
        out: torch.Tensor = logits[:, :self.geometry.vocab_size].float()
        return out

    # --- exact prefix cache ---------------------------------------------------------------

    def match_prefix(self, slots: KVSlots, token_ids: Sequence[int], namespace: str = "") -> int:
        s = _slots(slots)
        hit = self.prefix_cache.match(token_ids[:s.n_slots], namespace)
        for start, keys, values in hit.chunks:
            self.write_slots(s, start, keys, values)
        return hit.length

    def insert_prefix(self, slots: KVSlots, token_ids: Sequence[int], namespace: str = "") -> None:
        s = _slots(slots)
        assert len(token_ids) <= s.n_slots, (len(token_ids), s.n_slots)
        self.prefix_cache.insert(token_ids, lambda a, b: self.read_slots(s, a, b), namespace)

    def write_slots(self, slots: SGLangSlots, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Post-RoPE keys and values ``[L, n, H, D]`` (pool dtype) into positions ``start .. start+n``."""
        locs = slots.locs[start:start + keys.shape[1]]
        for layer in range(self.geometry.n_layers):
            self.pool.get_key_buffer(layer)[locs] = keys[layer]
            self.pool.get_value_buffer(layer)[locs] = values[layer]

    def read_slots(self, slots: KVSlots, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE keys and values of positions ``start .. end``, ``[L, n, H, D]`` each (copies)."""
        locs = _slots(slots).locs[start:end]
        layers = range(self.geometry.n_layers)
        return (torch.stack([self.pool.get_key_buffer(i)[locs] for i in layers]),
                torch.stack([self.pool.get_value_buffer(i)[locs] for i in layers]))


class _ForwardMarker:
    """What SGLang's layers read of a batch outside the attention backend: its forward mode."""

    def __init__(self, mode: Any) -> None:
        self.forward_mode = mode


def _slots(slots: KVSlots) -> SGLangSlots:
    assert isinstance(slots, SGLangSlots), f"slots from another engine: {type(slots).__name__}"
    assert not slots.freed, "slots used after free()"
    return slots
