"""Model geometry and weights read straight from a checkpoint directory.

``config.json`` becomes a frozen :class:`ModelSpec` (its shape fields through the one parser,
:class:`~tessera.engines.geometry.ConfigShape`); ``*.safetensors`` become plain tensors in
the compute dtype on the compute device, with the projections that read the same input fused
(q|k|v and gate|up) so each layer runs one matmul per input. Tied embeddings reuse the
embedding matrix as the LM head.

Supported: Llama (Llama 2/3, SmolLM2), Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm), SiLU MLPs,
full (non-sliding) attention. Anything else raises :class:`ModelLoadError` with the reason.
A random-shape checkpoint (:mod:`tessera.engines.shapes`) gets seeded random weights instead.
This module knows nothing about attention or caches.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.engines.geometry import ConfigShape
from tessera.engines.rope import RopeSpec
from tessera.engines.shapes import random_seed
from tessera.errors import ModelLoadError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    max_positions: int
    tie_embeddings: bool
    rope: RopeSpec

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        names = list(config.get("architectures") or [])
        arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"architecture {names or config.get('model_type')!r} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act {act!r} is not supported (only silu)")
        layer_types = set(config.get("layer_types") or [])
        if config.get("use_sliding_window") or "sliding_attention" in layer_types:
            raise ModelLoadError("sliding-window attention is not supported; use a full-attention checkpoint")
        shape = ConfigShape.parse(config)
        if not shape.hidden_size:
            raise ModelLoadError("config.json: hidden_size is missing; expected a positive integer")
        head_dim = shape.head_dim
        return cls(
            arch=arch,
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            n_layers=shape.n_layers,
            n_heads=shape.n_heads,
            n_kv_heads=shape.n_kv_heads,
            head_dim=head_dim,
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_positions=shape.max_positions or 4096,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope=RopeSpec.from_config(config, head_dim),
        )


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(H + 2*H_kv) * D, hidden]: q | k | v rows
    bqkv: torch.Tensor | None
    wo: torch.Tensor  # [hidden, H * D]
    bo: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 * inter, hidden]: gate | up rows
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor  # [hidden, inter]
    b_down: torch.Tensor | None


@dataclass
class Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


class _Reader:
    """Tensors of every ``*.safetensors`` file in a directory, by name, checked for shape."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no *.safetensors weights in {path}")
        self._where: dict[str, Any] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt", device="cpu")
            # safe_open handles are not iterable, and their stubs leave keys() untyped
            for name in handle.keys():  # type: ignore[no-untyped-call]  # noqa: SIM118
                self._where[name] = handle

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(f"weight {name!r} is missing from the checkpoint")
        t: torch.Tensor = self._where[name].get_tensor(name)
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"weight {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        return t

    def maybe(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.get(name, shape) if self.has(name) else None


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ModelLoadError("some but not all fused projections carry a bias")
    return torch.cat([p for p in parts if p is not None])


def load_weights(path: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> Weights:
    r = _Reader(path)
    hd, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_rows, kv_rows = spec.n_heads * d, spec.n_kv_heads * d

    def put(t: torch.Tensor | None) -> Any:
        return None if t is None else t.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        proj = [(a + "q_proj", q_rows), (a + "k_proj", kv_rows), (a + "v_proj", kv_rows)]
        gate_up = [(m + "gate_proj", inter), (m + "up_proj", inter)]
        layers.append(LayerWeights(
            attn_norm=put(r.get(p + "input_layernorm.weight", (hd,))),
            wqkv=put(torch.cat([r.get(n + ".weight", (rows, hd)) for n, rows in proj])),
            bqkv=put(_cat([r.maybe(n + ".bias", (rows,)) for n, rows in proj])),
            wo=put(r.get(a + "o_proj.weight", (hd, q_rows))),
            bo=put(r.maybe(a + "o_proj.bias", (hd,))),
            q_norm=put(r.get(a + "q_norm.weight", (d,))) if spec.qk_norm else None,
            k_norm=put(r.get(a + "k_norm.weight", (d,))) if spec.qk_norm else None,
            mlp_norm=put(r.get(p + "post_attention_layernorm.weight", (hd,))),
            w_gate_up=put(torch.cat([r.get(n + ".weight", (rows, hd)) for n, rows in gate_up])),
            b_gate_up=put(_cat([r.maybe(n + ".bias", (rows,)) for n, rows in gate_up])),
            w_down=put(r.get(m + "down_proj.weight", (hd, inter))),
            b_down=put(r.maybe(m + "down_proj.bias", (hd,))),
        ))
    embed = put(r.get("model.embed_tokens.weight", (spec.vocab_size, hd)))
    if r.has("lm_head.weight") and not spec.tie_embeddings:
        lm_head = put(r.get("lm_head.weight", (spec.vocab_size, hd)))
    elif spec.tie_embeddings:
        lm_head = embed
    else:
        raise ModelLoadError("lm_head.weight is missing and tie_word_embeddings is false")
    return Weights(embed=embed, layers=layers, norm=put(r.get("model.norm.weight", (hd,))), lm_head=lm_head)


def checkpoint_weights(path: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> Weights:
    """The checkpoint's weights: read from safetensors, or made at random for a random shape."""
    seed = random_seed(json.loads((path / "config.json").read_text()))
    return load_weights(path, spec, dtype, device) if seed is None else random_weights(spec, dtype, device, seed)


def random_weights(spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int) -> Weights:
    """Seeded N(0, 1/fan_in) projections and ~1 norms, made on ``device`` in ``dtype`` (no host copy)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hd, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_rows, kv_rows = spec.n_heads * d, spec.n_kv_heads * d

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g, dtype=dtype, device=device).mul_(cols ** -0.5)

    def norm(n: int) -> torch.Tensor:
        return torch.randn(n, generator=g, dtype=dtype, device=device).mul_(0.1).add_(1.0)

    bias = spec.arch == "qwen2"  # Qwen2 always has q/k/v biases
    layers = [LayerWeights(
        attn_norm=norm(hd),
        wqkv=w(q_rows + 2 * kv_rows, hd),
        bqkv=torch.randn(q_rows + 2 * kv_rows, generator=g, dtype=dtype, device=device).mul_(0.1) if bias else None,
        wo=w(hd, q_rows),
        bo=None,
        q_norm=norm(d) if spec.qk_norm else None,
        k_norm=norm(d) if spec.qk_norm else None,
        mlp_norm=norm(hd),
        w_gate_up=w(2 * inter, hd),
        b_gate_up=None,
        w_down=w(hd, inter),
        b_down=None,
    ) for _ in range(spec.n_layers)]
    embed = w(spec.vocab_size, hd)
    lm_head = embed if spec.tie_embeddings else w(spec.vocab_size, hd)
    return Weights(embed=embed, layers=layers, norm=norm(hd), lm_head=lm_head)
