"""Helpers for KV-pool tests: a tiny model geometry, cluster configs, memory-node processes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import RoleProcess, free_port, shared_secret_file, signed_get, with_secret, write_config

from tessera.auth import CapabilityIssuer, read_secret
from tessera.config import ClusterConfig, GenerationNodeConfig, KVPoolNodeConfig, ModelConfig, TransportConfig
from tessera.engines.base import ModelGeometry, UnitState
from tessera.transport.arena import SHM_DIR
from tessera.transport.base import NodeEndpoint
from tessera.transport.blocks import BlockLayout
from tessera.wire import from_wire

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


def pool_config(
    directory: Path,
    *,
    transport: str = "tcp",
    nodes: tuple[str, ...] = ("kv0",),
    capacity: int = 64,
    model_source: str | None = None,
    secure: bool = True,
    **transport_fields: object,
) -> ClusterConfig:
    """A cluster on free loopback ports with the tiny model and the given memory nodes.

    ``model_source`` replaces the config.json-only checkpoint (a retrieval role needs a tokenizer).
    ``secure``: with the tests' cluster secret (memory nodes then demand capabilities).
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
    return with_secret(config) if secure else config


def issuer() -> CapabilityIssuer:
    """Capabilities as the test clusters' control plane would sign them (the test acts as the plane)."""
    return CapabilityIssuer(read_secret(str(shared_secret_file())))


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


class MemoryNodeProcess:
    """A real ``tessera run --role kvpool`` process on loopback."""

    def __init__(self, config: ClusterConfig, config_path: Path, name: str) -> None:
        self.config = config
        self.node = config.kvpool_node(name)
        self.url = f"http://{self.node.host}:{self.node.port}"
        self.proc = RoleProcess("kvpool", config_path, name)
        self.shm_name = ""

    def wait_healthy(self, timeout: float = 60.0) -> NodeEndpoint:
        self.proc.wait_healthy(self.url, timeout)
        endpoint = self.endpoint()
        self.shm_name = endpoint.shm_name
        return endpoint

    def endpoint(self) -> NodeEndpoint:
        return from_wire(NodeEndpoint, json.loads(signed_get(self.config, f"{self.url}/info")))

    def pause(self) -> None:
        self.proc.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (no cleanup in the node; works on a paused node too, which must not run again)."""
        self.proc.kill()
        if self.shm_name:
            (SHM_DIR / self.shm_name).unlink(missing_ok=True)

    def stop(self) -> int:
        self.resume()
        return self.proc.stop()


@contextlib.contextmanager
def memory_node(config: ClusterConfig, directory: Path, name: str = "kv0") -> Iterator[MemoryNodeProcess]:
    path = directory / "tessera.toml"
    if not path.exists():
        write_config(directory, config)
    node = MemoryNodeProcess(config, path, name)
    try:
        node.wait_healthy()
        yield node
    finally:
        if node.proc.proc.poll() is None:
            node.stop()
        if node.shm_name:
            (SHM_DIR / node.shm_name).unlink(missing_ok=True)
