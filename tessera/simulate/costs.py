"""Cost models: how long a simulated node's engine step, unit copy and transfer take.

A model is data (a JSON file), never code: ``tessera simulate --calibrate`` writes one fitted
to the configured engine on this machine, and the package ships GPU models built from
published measurements (``tessera/simulate/models/*.json``; sources in the README, "Scale").

One engine step runs a batch of items (request extends, unit prefills, decodes). Its time is

    step_s = base_s + per_token_s * new tokens + per_attn_s * sum(new tokens * context / 1000)
             + per_decode_s * decodes

where an item's context is the position its last token attends to (a prefill from 0: its own
length; an extend over a cached prefix: the prefix plus the extend). Placing a cached unit at
its offset (RoPE) costs ``place_per_token_s`` per token; moving a unit state over a link costs
``link_latency_s + bytes / link_bytes_per_s`` with ``kv_bytes_per_token`` bytes per token.
``request_overhead_s`` is what a request spends outside the node (HTTP, retrieval, routing).
``host_slowdown[k - 1]`` stretches a step that runs while k engines of one host are busy (CPU
nodes sharing cores and memory bandwidth; empty: every node has its own device).

This module knows nothing about the control plane or the event loop.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tessera.errors import ConfigError

COST_MODEL_VERSION = 1


@dataclass(frozen=True)
class StepItem:
    """One item of a batch as the cost model sees it: new tokens and the context they attend to."""

    tokens: int
    context: int
    decode: bool = False


@dataclass(frozen=True)
class CostModel:
    name: str
    source: str  # where the numbers come from (measured here, or the publication)
    base_s: float  # fixed cost of one engine step (launch, sampling, Python)
    per_token_s: float  # each new token's share of the linear layers
    per_attn_s: float  # attention, per new token per 1,000 tokens of context
    per_decode_s: float = 0.0  # extra per decode item (its own KV read, sampling)
    place_per_token_s: float = 0.0  # placing a reused unit's state at its offset
    kv_bytes_per_token: int = 0  # a unit state's size per token (keys + values, all layers)
    link_latency_s: float = 0.0  # one transfer to or from a memory node
    link_bytes_per_s: float = 1e12
    request_overhead_s: float = 0.0  # outside the node: HTTP, retrieval, routing
    host_slowdown: tuple[float, ...] = ()  # [k - 1]: a step's stretch while k engines of its host are busy
    version: int = COST_MODEL_VERSION

    def __post_init__(self) -> None:
        for f in ("base_s", "per_token_s", "per_attn_s", "per_decode_s", "place_per_token_s",
                  "link_latency_s", "request_overhead_s"):
            if getattr(self, f) < 0:
                raise ConfigError(f"cost model {self.name!r}: {f} = {getattr(self, f)} must be >= 0")
        if self.link_bytes_per_s <= 0 or self.kv_bytes_per_token < 0:
            raise ConfigError(f"cost model {self.name!r}: link_bytes_per_s must be > 0 and kv_bytes_per_token >= 0")
        object.__setattr__(self, "host_slowdown", tuple(float(x) for x in self.host_slowdown))  # a JSON list
        if any(x <= 0 for x in self.host_slowdown):
            raise ConfigError(f"cost model {self.name!r}: host_slowdown {self.host_slowdown} must be > 0")
        if self.version != COST_MODEL_VERSION:
            raise ConfigError(f"cost model {self.name!r} has version {self.version}; this Tessera reads "
                              f"version {COST_MODEL_VERSION}: run tessera simulate --calibrate again")

    def step_s(self, items: Iterable[StepItem]) -> float:
        t = self.base_s
        for it in items:
            t += self.per_token_s * it.tokens + self.per_attn_s * it.tokens * it.context / 1000.0
            if it.decode:
                t += self.per_decode_s
        return t

    def slowdown(self, busy: int) -> float:
        """A step's stretch while ``busy`` engines of its host run (past the measured ones: the last)."""
        if not self.host_slowdown or busy <= 1:
            return 1.0
        return self.host_slowdown[min(busy, len(self.host_slowdown)) - 1]

    def transfer_s(self, n_tokens: int) -> float:
        return self.link_latency_s + n_tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    def place_s(self, n_tokens: int) -> float:
        return self.place_per_token_s * n_tokens

    # --- files ---------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "cost model") -> CostModel:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where} is not JSON: {exc}") from None
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields if isinstance(data, dict) else {"<not an object>"}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; expected some of {sorted(fields)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())


def builtin_models() -> list[str]:
    """Names of the cost models shipped in the package (``tessera/simulate/models``)."""
    return sorted(p.name.removesuffix(".json") for p in resources.files("tessera.simulate.models").iterdir()
                  if p.name.endswith(".json"))


def load_cost_model(spec: str) -> CostModel:
    """A shipped model by name (e.g. ``llama3-8b-a100``) or a JSON file's path."""
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ConfigError(f"cost model file {path} does not exist; write one with tessera simulate --calibrate "
                              f"--cost-model {path}, or name a shipped model: {', '.join(builtin_models())}")
        return CostModel.from_json(path.read_text(), str(path))
    shipped = resources.files("tessera.simulate.models") / f"{spec}.json"
    if not shipped.is_file():
        raise ConfigError(f"unknown cost model {spec!r}: shipped models are {', '.join(builtin_models())}; "
                          "or pass a JSON file written by tessera simulate --calibrate")
    return CostModel.from_json(shipped.read_text(), f"shipped cost model {spec}")
