"""Model geometry comes from config.json alone (memory nodes never load weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.kvpool import TINY_CONFIG, tiny_checkpoint

from tessera.config import ModelConfig
from tessera.engines.checkpoint import load_config_dict, resolve
from tessera.engines.geometry import geometry_from_checkpoint, geometry_from_config_dict
from tessera.engines.weights import ModelSpec
from tessera.errors import ModelLoadError


def test_geometry_reads_layers_kv_heads_and_head_dim(tmp_path: Path) -> None:
    """A checkpoint directory with only config.json is enough."""
    g = geometry_from_checkpoint(resolve(ModelConfig(source=str(tiny_checkpoint(tmp_path)))), "float16")
    assert (g.n_layers, g.n_kv_heads, g.head_dim, g.vocab_size, g.max_context) == (2, 2, 8, 64, 256)
    assert g.token_bytes == 2 * 2 * 2 * 8 * 2


def test_head_dim_defaults_to_hidden_over_heads_and_kv_heads_to_heads() -> None:
    """Plain multi-head configs without head_dim or num_key_value_heads still work."""
    raw = {k: v for k, v in TINY_CONFIG.items() if k not in ("head_dim", "num_key_value_heads")}
    g = geometry_from_config_dict(raw, "float32")
    assert (g.n_kv_heads, g.head_dim, g.kv_dtype) == (4, 8, "float32")


def test_max_context_overrides_the_model_limit() -> None:
    assert geometry_from_config_dict(TINY_CONFIG, "float16", max_context=64).max_context == 64


@pytest.mark.parametrize(
    ("change", "message"),
    [({"num_hidden_layers": 0}, "num_hidden_layers"), ({"hidden_size": 30, "head_dim": None}, "divisible"),
     ({"num_key_value_heads": "2"}, "num_key_value_heads")],
)
def test_a_broken_config_names_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        geometry_from_config_dict({**TINY_CONFIG, **change}, "float16")


def test_the_bundled_model_geometry() -> None:
    """SmolLM2-135M: 30 layers, 3 kv heads of 64; 16 fp16 tokens are 360 KiB per block."""
    g = geometry_from_checkpoint(resolve(ModelConfig()), "float16")
    assert (g.n_layers, g.n_kv_heads, g.head_dim) == (30, 3, 64)
    assert g.block_payload_bytes(16) == 368640


@pytest.mark.parametrize("source", ["tiny", "smollm2"])
def test_the_engine_spec_and_the_geometry_read_the_same_shape(tmp_path: Path, source: str) -> None:
    """One parser: ModelSpec (engine) and the geometry (memory nodes) agree on every shape field."""
    checkpoint = resolve(ModelConfig(source=str(tiny_checkpoint(tmp_path)) if source == "tiny" else "smollm2"))
    raw = load_config_dict(checkpoint)
    spec = ModelSpec.from_config({"intermediate_size": 64, **raw})
    g = geometry_from_config_dict(raw, "float16")
    assert (spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.vocab_size) == (
        g.n_layers, g.n_kv_heads, g.head_dim, g.vocab_size)
    assert spec.max_positions == g.max_context


def test_the_engine_spec_refuses_a_broken_shape_field_like_the_geometry_does() -> None:
    """A boolean layer count is refused by ModelSpec too (it used to be read as 1 layer)."""
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        ModelSpec.from_config({**TINY_CONFIG, "intermediate_size": 64, "num_hidden_layers": True})
