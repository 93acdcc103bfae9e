"""Tiny random checkpoints (2 layers, hidden 64) with the real SmolLM2 vocabulary.

``write_tiny_checkpoint(dir)`` writes config.json (the ``tiny`` shape's
:func:`~tessera.engines.shapes.tiny_config`) + model.safetensors in the transformers layout and
copies the bundled SmolLM2 tokenizer files, so ``model.source = dir`` loads through the normal
path in milliseconds. Tests compare our forward against transformers' on these,
and end-to-end tests run real role processes on them.

Weights are N(0, 1/fan_in) (embeddings N(0, 1/hidden)), so attention is far from uniform and
a wrong mask or position shows up in the logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from tessera.engines.checkpoint import TOKENIZER_FILES, resolve_bundled
from tessera.engines.shapes import tiny_config


def tiny_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hd, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def w(rows: int, cols: int) -> torch.Tensor:
        out: torch.Tensor = torch.randn(rows, cols, generator=g) / cols ** 0.5
        return out

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    out = {"model.embed_tokens.weight": torch.randn(config["vocab_size"], hd, generator=g) / hd ** 0.5,
           "model.norm.weight": norm(hd)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm(hd)
        out[p + "post_attention_layernorm.weight"] = norm(hd)
        for name, rows in (("q_proj", heads * d), ("k_proj", kv_heads * d), ("v_proj", kv_heads * d)):
            out[p + f"self_attn.{name}.weight"] = w(rows, hd)
            if config["model_type"] == "qwen2":  # Qwen2 always has q/k/v biases
                out[p + f"self_attn.{name}.bias"] = 0.1 * torch.randn(rows, generator=g)
        out[p + "self_attn.o_proj.weight"] = w(hd, heads * d)
        if config["model_type"] == "qwen3":
            out[p + "self_attn.q_norm.weight"] = norm(d)
            out[p + "self_attn.k_norm.weight"] = norm(d)
        out[p + "mlp.gate_proj.weight"] = w(inter, hd)
        out[p + "mlp.up_proj.weight"] = w(inter, hd)
        out[p + "mlp.down_proj.weight"] = w(hd, inter)
    return out


def write_tiny_checkpoint(path: str | Path, arch: str = "llama", seed: int = 0, **config_opts: Any) -> Path:
    """Write a tiny random ``arch`` checkpoint with the SmolLM2 tokenizer into ``path``; return it."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    bundled = resolve_bundled()
    base = json.loads((bundled / "config.json").read_text())
    config = tiny_config(arch, base["vocab_size"], bos_token_id=base.get("bos_token_id", 1),
                         eos_token_id=base.get("eos_token_id", 2), **config_opts)
    for name in TOKENIZER_FILES:
        if (bundled / name).is_file():
            shutil.copyfile(bundled / name, path / name)
    save_file({k: v.contiguous() for k, v in tiny_weights(config, seed).items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
