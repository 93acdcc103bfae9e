"""Model geometry (:class:`ModelGeometry`) and how to read it from a checkpoint's ``config.json``.

:class:`ConfigShape` is the one parser of the shape fields of ``config.json``. Memory nodes
size their block arena from the geometry, and a memory node must never pay
for (or hold) the model weights, so everything here reads the transformers config file
only, and this module imports no torch: a memory node never loads it. Generation nodes get
the same numbers from their loaded engine; both must agree or the block layout differs,
which is why there is exactly one place that derives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tessera.engines.checkpoint import Checkpoint, load_config_dict
from tessera.errors import ModelLoadError

# bytes per element of each storage dtype (tessera.engines.base.DTYPES has their torch dtypes)
KV_ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelGeometry:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    kv_dtype: str  # storage dtype of the reusable form, a key of KV_ITEMSIZE

    @property
    def token_bytes(self) -> int:
        """Bytes of reusable state per token: K and V for every layer."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * KV_ITEMSIZE[self.kv_dtype]

    def block_payload_bytes(self, block_tokens: int) -> int:
        return self.token_bytes * block_tokens


def _int_field(raw: Mapping[str, Any], key: str, where: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{where}: {key} = {value!r}; expected a positive integer")
    return value


@dataclass(frozen=True)
class ConfigShape:
    """The fields of ``config.json`` that the block layout and every engine read.

    This is the one parser of them: :func:`geometry_from_config_dict` (memory nodes, the
    retrieval role's context limit) and :class:`tessera.engines.weights.ModelSpec` (the
    reference engine) both start from it, so their numbers cannot drift apart.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int  # 0 when the config gives head_dim and no hidden_size
    vocab_size: int
    max_positions: int  # 0 when the config has no max_position_embeddings

    @classmethod
    def parse(cls, raw: Mapping[str, Any], where: str = "config.json") -> ConfigShape:
        """Llama-style field names.

        ``head_dim`` is taken when present, else ``hidden_size / num_attention_heads``;
        ``num_key_value_heads`` defaults to ``num_attention_heads`` (plain multi-head attention).
        """
        # multimodal checkpoints nest the language model's config
        if "num_hidden_layers" not in raw and isinstance(raw.get("text_config"), Mapping):
            raw = raw["text_config"]
        n_heads = _int_field(raw, "num_attention_heads", where)
        hidden = _int_field(raw, "hidden_size", where) if raw.get("hidden_size") is not None else 0
        if raw.get("head_dim") is not None:
            head_dim = _int_field(raw, "head_dim", where)
        else:
            hidden = _int_field(raw, "hidden_size", where)
            if hidden % n_heads:
                raise ModelLoadError(f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {n_heads}")
            head_dim = hidden // n_heads
        return cls(
            n_layers=_int_field(raw, "num_hidden_layers", where),
            n_heads=n_heads,
            n_kv_heads=_int_field(raw, "num_key_value_heads", where)
            if raw.get("num_key_value_heads") is not None else n_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            vocab_size=_int_field(raw, "vocab_size", where),
            max_positions=_int_field(raw, "max_position_embeddings", where)
            if raw.get("max_position_embeddings") is not None else 0,
        )


def geometry_from_config_dict(
    raw: Mapping[str, Any], kv_dtype: str, max_context: int = 0, where: str = "config.json"
) -> ModelGeometry:
    """Geometry from a transformers config mapping; ``max_context`` of 0 means the model's own
    ``max_position_embeddings``."""
    if kv_dtype not in KV_ITEMSIZE:
        raise ModelLoadError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_ITEMSIZE)}")
    shape = ConfigShape.parse(raw, where)
    context = max_context or shape.max_positions
    if context <= 0:
        raise ModelLoadError(f"{where} has no max_position_embeddings; set model.max_context")
    return ModelGeometry(shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.vocab_size, context, kv_dtype)


def geometry_from_checkpoint(checkpoint: Checkpoint, kv_dtype: str, max_context: int = 0) -> ModelGeometry:
    """Geometry of a resolved checkpoint (reads ``config.json`` only, never the weights)."""
    return geometry_from_config_dict(
        load_config_dict(checkpoint), kv_dtype, max_context, where=str(checkpoint.path / "config.json")
    )
