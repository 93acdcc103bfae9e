"""The KV pool's test values: a tiny model geometry, random unit states, memory-node cluster configs."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers.cluster import free_port, with_secret_file
from tessera.config import ClusterConfig, GenerationNodeConfig, KVPoolNodeConfig, ModelConfig, TransportConfig
from tessera.engines.base import UnitState
from tessera.engines.geometry import ModelGeometry
from tessera.transport.blocks import BlockLayout

# 2 layers, 2 kv heads of dim 8, fp16: 128 bytes per token; B = 4 -> 512-byte payloads
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_size": 32,
    "vocab_size": 64,
    "max_position_embeddings": 256,
}
TINY_GEOMETRY = ModelGeometry(2, 2, 8, 64, 256, "float16")
BLOCK_TOKENS = 4
TRANSPORTS = ["shm", "tcp", "mooncake"]
HANG_GUARD_S = 30.0  # far beyond any timeout used in tests: reaching it means something hung


def mooncake_missing() -> str | None:
    """Why the Mooncake Transfer Engine cannot be loaded here, or None if it can."""
    from tessera.errors import ConfigError
    from tessera.transport.mooncake import load_engine_class

    try:
        load_engine_class()
    except ConfigError as exc:
        return str(exc)
    return None


def skip_if_unavailable(transport: str) -> None:
    """Skip a mooncake case only because the engine cannot load, saying exactly why."""
    if transport == "mooncake" and (why := mooncake_missing()):
        pytest.skip(f"Mooncake Transfer Engine unavailable: {why}")


def tiny_layout() -> BlockLayout:
    return BlockLayout(TINY_GEOMETRY, BLOCK_TOKENS)


def random_state(n_tokens: int, seed: int = 0, geometry: ModelGeometry = TINY_GEOMETRY) -> UnitState:
    g = torch.Generator().manual_seed(seed)
    shape = (geometry.n_layers, n_tokens, geometry.n_kv_heads, geometry.head_dim)
    return UnitState(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())


def tiny_checkpoint(directory: Path) -> Path:
    """A checkpoint directory with only config.json: enough for a memory node (it never loads weights)."""
    path = directory / "tiny-model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return path


def build_pool_config(
    directory: Path,
    *,
    secret_file: Path | None,
    transport: str = "tcp",
    nodes: tuple[str, ...] = ("kv0",),
    capacity: int = 64,
    model_source: str | None = None,
    **transport_fields: object,
) -> ClusterConfig:
    """A cluster on free loopback ports with the tiny model and the given memory nodes.

    ``model_source`` replaces the config.json-only checkpoint (a retrieval role needs a tokenizer).
    ``secret_file``: the cluster secret (memory nodes then demand capabilities), or None for none.
    Tests take the ``pool_config`` fixture, which passes the tests' cluster secret.
    """
    kvpools = tuple(KVPoolNodeConfig(name, port=free_port(), data_port=free_port(), capacity_blocks=capacity)
                    for name in nodes)
    base = ClusterConfig(generation=(GenerationNodeConfig("gen0", port=free_port()),))
    config = dataclasses.replace(
        base,
        block_tokens=BLOCK_TOKENS,
        model=ModelConfig(source=model_source or str(tiny_checkpoint(directory))),
        retrieval=dataclasses.replace(base.retrieval, port=free_port()),
        transport=TransportConfig(name=transport, **transport_fields),  # type: ignore[arg-type]
        kvpools=kvpools,
    )
    return with_secret_file(config, secret_file) if secret_file is not None else config


# the ``pool_config`` fixture: ``build_pool_config`` with the tests' cluster secret unless ``secure=False``
PoolConfig = Callable[..., ClusterConfig]
