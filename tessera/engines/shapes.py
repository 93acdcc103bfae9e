"""Model shapes without weights: ``model.source = "random:<shape>"`` (speed measurements only).

Like ``--load-format dummy`` in vLLM and SGLang: the architecture of a real model (layers,
heads, KV heads, head dim, MLP width, RoPE and its scaling) with seeded random weights made
on the compute device, so an 8B-class forward can be timed without its 16 GB of weights.
The tokenizer is the bundled SmolLM2's and the vocabulary is sized to it (49 152 rows instead
of 128 256 / 151 936): prefill cost is unchanged (the LM head runs on one row per request),
and every sampled id decodes. Outputs are noise: fidelity is measured with real weights.

:func:`tessera.engines.checkpoint.resolve` materialises a small checkpoint directory
(config.json with a ``tessera_random_weights`` entry + tokenizer files, no safetensors) under
the user cache, so every role reads geometry and tokenizer the usual way; its serving
fingerprint differs from any real checkpoint's. The tiny architecture of the tests
(:func:`tiny_config`, whose weights :mod:`tessera.engines.tiny` makes) is one of the shapes.
This module knows nothing about files, tensors or forward passes: it only writes dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tessera.errors import ModelLoadError

PREFIX = "random:"
SEED_KEY = "tessera_random_weights"


def _llama_3_1_8b() -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }


def _qwen3_8b() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
    }


ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


def tiny_config(arch: str, vocab_size: int, *, hidden_size: int = 64, n_layers: int = 2, n_heads: int = 4,
                n_kv_heads: int = 2, intermediate_size: int = 128, max_position_embeddings: int = 2048,
                rope_theta: float = 10000.0, rope_scaling: dict[str, Any] | None = None,
                bos_token_id: int = 1, eos_token_id: int = 2) -> dict[str, Any]:
    """config.json of a tiny ``arch`` model (the ``tiny`` shape; the tests' checkpoints with weights)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {arch!r}")
    architecture, model_type = ARCHS[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": hidden_size // n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=n_layers)
    return config


def _tiny() -> dict[str, Any]:
    config = tiny_config("llama", 0)
    del config["vocab_size"], config["bos_token_id"], config["eos_token_id"]
    return config


# shape name -> config.json without vocabulary and special tokens (taken from the tokenizer)
SHAPES: dict[str, Callable[[], dict[str, Any]]] = {
    "llama-3.1-8b": _llama_3_1_8b,
    "qwen3-8b": _qwen3_8b,
    "tiny": _tiny,  # 2 layers, hidden 64: for tests of this path
}


def parse(source: str) -> tuple[str, int]:
    """``random:<shape>[@seed]`` -> (shape, seed); ModelLoadError naming the known shapes."""
    spec = source[len(PREFIX):]
    shape, _, seed = spec.partition("@")
    if shape not in SHAPES:
        raise ModelLoadError(f"model.source = {source!r}: unknown random shape {shape!r}; known: "
                             f"{', '.join(sorted(SHAPES))} (optionally @SEED, e.g. random:qwen3-8b@1)")
    if seed and not seed.isdigit():
        raise ModelLoadError(f"model.source = {source!r}: the seed after @ must be a non-negative integer")
    return shape, int(seed or 0)


def random_config(shape: str, seed: int, tokenizer_config: dict[str, Any]) -> dict[str, Any]:
    """config.json of a random-weight ``shape`` whose vocabulary is the bundled tokenizer's."""
    config = SHAPES[shape]()
    config.update(vocab_size=int(tokenizer_config["vocab_size"]),
                  bos_token_id=tokenizer_config.get("bos_token_id", 1),
                  eos_token_id=tokenizer_config.get("eos_token_id", 2),
                  torch_dtype="bfloat16")
    config[SEED_KEY] = {"shape": shape, "seed": seed}
    return config


def random_seed(config: dict[str, Any]) -> int | None:
    """The weight seed of a random-shape checkpoint's config.json, None for a real checkpoint."""
    entry = config.get(SEED_KEY)
    return None if entry is None else int(entry["seed"])
