"""Cost models: how long a simulated node's engine step, unit copy and transfer take.

A model is data (a JSON file), never code: ``tessera simulate --calibrate`` writes one fitted
to the configured engine on this machine, and the package ships GPU models built from
published measurements (``tessera_lab/simulate/models/*.json``; each file's ``source`` names them).

One engine step runs a batch of items (request extends, unit prefills, decodes). Its time is

    step_s = base_s + per_token_s * new tokens + per_attn_s * sum(new tokens * context / 1000)
             + per_decode_s * decodes

where an item's context is the position its last token attends to (a prefill from 0: its own
length; an extend over a cached prefix: the prefix plus the extend). Placing a cached unit at
its offset (RoPE) costs ``place_per_token_s`` per token; moving a unit state over a link costs
``link_latency_s + bytes / link_bytes_per_s`` with ``kv_bytes_per_token`` bytes per token.
``request_overhead_s`` is the latency a request spends outside the node (HTTP hops; the CPU of
retrieval is ``cpu_per_request_s`` below when measured). ``host_slowdown[k - 1]`` stretches a
step that runs while k engines of one host are busy (CPU nodes sharing caches and memory
bandwidth; ``--calibrate-cpu`` refits it to the engines' CPU in the real cluster; empty: every
node has its own device).

The other roles' CPU: ``cpu_per_request_s[role]`` is what one request costs each role outside
the engine threads (``retrieval``: HTTP, search, prompt building, tokenizing, the control
plane; ``generation``: the node's event loop, its copies and checksums; ``kvpool``: the memory
node; ``client``: the load generator), measured by ``tessera simulate --calibrate-cpu``. On a
host of ``host_cores`` cores (0: not modelled, as on a GPU node with its own device) that
work runs beside the engine steps, and with k steps and j such jobs running each gets

    share = min(1, (host_cores - host_background_cores) / (k + j))
    a step runs at share / host_slowdown[k - 1], a job at share

The retrieval role's share is on the request's path (before routing); the others' run beside it.

This module knows nothing about the control plane or the event loop.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from tessera.errors import ConfigError

COST_MODEL_VERSION = 1
CPU_ROLES = ("retrieval", "generation", "kvpool", "client")  # the roles cpu_per_request_s may name


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
    host_cores: int = 0  # the cores one host's engines and roles share (0: the host's CPU is not modelled)
    host_background_cores: float = 0.0  # of those, what the roles keep busy whatever the load (heartbeats, loops)
    cpu_per_request_s: dict[str, float] = field(default_factory=dict)  # role -> CPU per request outside engines
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
        unknown = set(self.cpu_per_request_s) - set(CPU_ROLES)
        if unknown or any(v < 0 for v in self.cpu_per_request_s.values()):
            raise ConfigError(f"cost model {self.name!r}: cpu_per_request_s {self.cpu_per_request_s} takes roles "
                              f"{', '.join(CPU_ROLES)} with seconds >= 0")
        if self.host_cores < 0 or not 0 <= self.host_background_cores < max(self.host_cores, 1):
            raise ConfigError(f"cost model {self.name!r}: host_cores {self.host_cores} must be >= 0 and "
                              f"host_background_cores {self.host_background_cores} in [0, host_cores)")
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
        if not self.host_slowdown or busy < 1:
            return 1.0
        return self.host_slowdown[min(busy, len(self.host_slowdown)) - 1]

    def cores_free(self) -> float:
        """The host's cores left for the engines and the per-request work (0: not modelled)."""
        return self.host_cores - self.host_background_cores if self.host_cores else 0.0

    def role_cpu_s(self, role: str) -> float:
        """CPU seconds one request costs ``role`` outside the engine threads (0: not measured)."""
        return self.cpu_per_request_s.get(role, 0.0)

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
    """Names of the cost models shipped in the package (``tessera_lab/simulate/models``)."""
    return sorted(p.name.removesuffix(".json") for p in resources.files("tessera_lab.simulate.models").iterdir()
                  if p.name.endswith(".json"))


def load_cost_model(spec: str) -> CostModel:
    """A shipped model by name (e.g. ``llama3-8b-a100``) or a JSON file's path."""
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ConfigError(f"cost model file {path} does not exist; write one with tessera simulate --calibrate "
                              f"--cost-model {path}, or name a shipped model: {', '.join(builtin_models())}")
        return CostModel.from_json(path.read_text(), str(path))
    shipped = resources.files("tessera_lab.simulate.models") / f"{spec}.json"
    if not shipped.is_file():
        raise ConfigError(f"unknown cost model {spec!r}: shipped models are {', '.join(builtin_models())}; "
                          "or pass a JSON file written by tessera simulate --calibrate")
    return CostModel.from_json(shipped.read_text(), f"shipped cost model {spec}")
