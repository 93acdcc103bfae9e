"""Model geometry from a checkpoint's ``config.json``, without loading any weights.

Memory nodes size their block arena from the geometry, and a memory node must never pay
for (or hold) the model weights, so everything here reads the transformers config file
only. Generation nodes get the same numbers from their loaded engine; both must agree or
the block layout differs, which is why there is exactly one place that derives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera.engines.base import DTYPES, ModelGeometry
from tessera.engines.checkpoint import Checkpoint, load_config_dict
from tessera.errors import ModelLoadError


def _int_field(raw: Mapping[str, Any], key: str, where: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{where}: {key} = {value!r}; expected a positive integer")
    return value


def geometry_from_config_dict(
    raw: Mapping[str, Any], kv_dtype: str, max_context: int = 0, where: str = "config.json"
) -> ModelGeometry:
    """Geometry from a transformers config mapping (Llama-style field names).

    ``head_dim`` is taken when present, else ``hidden_size / num_attention_heads``;
    ``num_key_value_heads`` defaults to ``num_attention_heads`` (plain multi-head attention).
    ``max_context`` of 0 means the model's own ``max_position_embeddings``.
    """
    if kv_dtype not in DTYPES:
        raise ModelLoadError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(DTYPES)}")
    # multimodal checkpoints nest the language model's config
    if "num_hidden_layers" not in raw and isinstance(raw.get("text_config"), Mapping):
        raw = raw["text_config"]
    n_layers = _int_field(raw, "num_hidden_layers", where)
    n_heads = _int_field(raw, "num_attention_heads", where)
    n_kv_heads = _int_field(raw, "num_key_value_heads", where) if "num_key_value_heads" in raw else n_heads
    if raw.get("head_dim") is not None:
        head_dim = _int_field(raw, "head_dim", where)
    else:
        hidden = _int_field(raw, "hidden_size", where)
        if hidden % n_heads:
            raise ModelLoadError(f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {n_heads}")
        head_dim = hidden // n_heads
    vocab = _int_field(raw, "vocab_size", where)
    own_max = _int_field(raw, "max_position_embeddings", where) if "max_position_embeddings" in raw else 0
    context = max_context or own_max
    if context <= 0:
        raise ModelLoadError(f"{where} has no max_position_embeddings; set model.max_context")
    return ModelGeometry(n_layers, n_kv_heads, head_dim, vocab, context, kv_dtype)


def geometry_from_checkpoint(checkpoint: Checkpoint, kv_dtype: str, max_context: int = 0) -> ModelGeometry:
    """Geometry of a resolved checkpoint (reads ``config.json`` only, never the weights)."""
    return geometry_from_config_dict(
        load_config_dict(checkpoint), kv_dtype, max_context, where=str(checkpoint.path / "config.json")
    )
