"""model.source = "random:<shape>": real architectures with seeded random weights, no weight files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.engines import random_tokens

from tessera.config import ClusterConfig, GenerationNodeConfig, ModelConfig
from tessera.engines.checkpoint import load_config_dict, resolve
from tessera.engines.geometry import geometry_from_checkpoint
from tessera.engines.offline import prefill
from tessera.engines.reference import ReferenceEngine
from tessera.engines.weights import ModelSpec
from tessera.errors import ModelLoadError


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random checkpoints are written under TESSERA_CACHE; the bundled model stays where it is."""
    bundled = resolve(ModelConfig())  # convert (or find) SmolLM2 before the cache moves
    monkeypatch.setattr("tessera.engines.checkpoint.resolve_bundled", lambda: bundled.path)
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))


def _config(source: str) -> ClusterConfig:
    return ClusterConfig(kv_dtype="float32", model=ModelConfig(source=source, dtype="float32"),
                         generation=(GenerationNodeConfig("gen0"),))


@pytest.mark.parametrize(("source", "layers", "kv_heads", "inter", "rope"), [
    ("random:llama-3.1-8b", 32, 8, 14336, "llama3"),
    ("random:qwen3-8b", 36, 8, 12288, "default"),
])
def test_8b_shapes_have_their_architecture_and_the_bundled_vocabulary(source: str, layers: int, kv_heads: int,
                                                                      inter: int, rope: str) -> None:
    """The spec is the real model's (layers, heads, MLP, RoPE); the vocabulary is the tokenizer's."""
    checkpoint = resolve(ModelConfig(source=source))
    assert not list(checkpoint.path.glob("*.safetensors"))
    spec = ModelSpec.from_config(load_config_dict(checkpoint))
    assert (spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.hidden_size) == (
        layers, 32, kv_heads, 128, 4096)
    assert spec.intermediate_size == inter and spec.rope.rope_type == rope
    assert spec.qk_norm == (source == "random:qwen3-8b")
    assert spec.vocab_size == 49152  # the bundled SmolLM2 tokenizer's
    geometry = geometry_from_checkpoint(checkpoint, "bfloat16")
    assert geometry.token_bytes == 2 * layers * kv_heads * 128 * 2  # 128 KiB/token for Llama-3.1-8B


def test_random_fingerprint_differs_from_real_weights_and_between_seeds() -> None:
    """A random shape never shares unit identity with real weights (nor with another seed)."""
    a = ReferenceEngine.from_config(_config("random:tiny"))
    b = ReferenceEngine.from_config(_config("random:tiny@1"))
    real = resolve(ModelConfig())
    assert a.fingerprint.model.startswith("random:tiny:")
    assert len({a.fingerprint.model, b.fingerprint.model, f"{real.name}:{real.identity}"}) == 3
    assert a.fingerprint.tokenizer == b.fingerprint.tokenizer


def test_random_tiny_runs_deterministically_from_its_seed() -> None:
    """The same seed gives the same weights (same logits); another seed gives others."""
    tokens = random_tokens(20, 1)
    first = prefill(ReferenceEngine.from_config(_config("random:tiny")), tokens).logits
    again = prefill(ReferenceEngine.from_config(_config("random:tiny")), tokens).logits
    other = prefill(ReferenceEngine.from_config(_config("random:tiny@1")), tokens).logits
    assert torch.equal(first, again) and torch.isfinite(first).all()
    assert not torch.allclose(first, other)
    engine = ReferenceEngine.from_config(_config("random:tiny"))
    assert engine.decode_tokens(engine.encode("Hello there")) == "Hello there"


def test_unknown_shapes_are_refused_with_the_known_ones() -> None:
    with pytest.raises(ModelLoadError, match=r"known: llama-3\.1-8b, qwen3-8b, tiny"):
        resolve(ModelConfig(source="random:llama-9"))
    with pytest.raises(ModelLoadError, match="seed"):
        resolve(ModelConfig(source="random:tiny@x"))
