"""Retrieval role -> generation node: snapshot, execute, abort, revoke, and the execute stream
back (one NDJSON line per event)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.messages.plan import RequestPlan
from tessera.messages.prompt import PromptLayout

MAX_TEMPERATURE = 2.0  # OpenAI's bound
# the smallest normal float32: sampling compares top_p with float32 probabilities, where a
# smaller top_p underflows to 0 and filters out every token; the API refuses it
MIN_TOP_P = 1.1754943508222875e-38
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the generation node picks tokens; built from a client's request only by
    :func:`tessera.retrieval.chat.request.parse_chat_request`, which explains bad values to
    the client. The checks here are the message's invariants (a peer that breaks them gets a
    400 from the wire decoder)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # -1: no logprobs; 0: the chosen token's logprob; k > 0: also the k most likely tokens
    top_logprobs: int = -1

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens = {self.max_tokens} is invalid: expected >= 1")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature = {self.temperature} is invalid: expected 0..{MAX_TEMPERATURE} (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p = {self.top_p} is invalid: expected 0 < top_p <= 1")
        if not -1 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs = {self.top_logprobs} is invalid: expected -1..{MAX_TOP_LOGPROBS}")


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    """Step 3 of the plan: the chosen node reports which of these units it holds locally.

    The node pins the units it reports until the request executes or is aborted.
    """

    version: int
    request_id: str
    unit_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SnapshotResponse:
    version: int
    request_id: str
    node: str
    held: tuple[str, ...]
    inflight: int


@dataclass(frozen=True, slots=True)
class ExecuteRequest:
    """Step 4: the finalized plan and the fixed prompt layout, sent to the chosen node."""

    version: int
    request_id: str
    layout: PromptLayout
    plan: RequestPlan
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = ""  # the namespace of the node's exact-prefix cache (no cross-tenant hits)
    # what is left of control.max_queue_wait_s when the plan is sent (None: no bound): the
    # node refuses the request if its first-token step has not begun within it (see
    # tessera.generation.scheduler, "late starts")
    queue_budget_s: float | None = None
    # the units' order was chosen for exact prefix reuse (an order-free request): the node
    # matches its exact-prefix cache across units, not only the text before the first one,
    # and may serve the rest exactly when that computes no more than composing it
    exact_into_units: bool = False
    # ... and its units' order was served before: the rest is served exactly whatever it costs,
    # so that the next prompt in this order is a prefix hit (admitted on its second sight)
    recurring: bool = False
    # the composition setting to serve it with (composition.per_request: its label,
    # tessera.composition.choice); "" = the node's own
    setting: str = ""


@dataclass(frozen=True, slots=True)
class UnitText:
    """A unit's token ids, for a node that prefills it."""

    unit_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """Retrieval role -> an idle generation node: prefill these units of another node's request
    and publish them (one of the request's plan's ``assists``: sealed for this node)."""

    version: int
    plan: RequestPlan  # every unit COMPUTE under a write grant of this node
    units: tuple[UnitText, ...]  # the token ids of each of the plan's units


@dataclass(frozen=True, slots=True)
class PrefillResponse:
    version: int
    request_id: str
    units: int  # units accepted: each is prefilled (or found in the local cache) and published


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """The retrieval role gives up on a request: the node stops running it, or drops its snapshot's pins."""

    version: int
    request_id: str


@dataclass(frozen=True, slots=True)
class AbortResponse:
    version: int
    request_id: str
    aborted: bool  # a run was in flight and is cancelled; False: at most the snapshot's pins were dropped


@dataclass(frozen=True, slots=True)
class RevokeRequest:
    """Retrieval role -> generation node: these units were deleted; drop their cached states."""

    version: int
    unit_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RevokeResponse:
    """Generation node -> retrieval role: how many of the revoked units its local cache dropped."""

    version: int
    dropped: int


@dataclass(slots=True)
class RequestStats:
    """Where one request's prompt tokens came from, and what it generated.

    Mutable on purpose: the executor's concurrent unit preparations add to it while the
    request runs; it crosses the wire once, inside the :class:`DoneEvent`.
    """

    prompt_tokens: int = 0
    prefix_cached_tokens: int = 0  # served by the exact prefix cache
    local_tokens: int = 0  # unit tokens whose state came from the local cache
    remote_tokens: int = 0  # ... from the shared KV Pool
    computed_unit_tokens: int = 0  # ... prefilled from text on this node, for this request
    # ... joined another request's in-flight prefill on this node: one forward pass serves
    # both, and only the request that ran it counts it as computed
    coalesced_unit_tokens: int = 0
    local_units: int = 0
    remote_units: int = 0
    computed_units: int = 0
    coalesced_units: int = 0
    fallbacks: int = 0  # remote fetches that failed and were computed instead
    recomputed_tokens: int = 0  # tokens computed in the final extend pass
    # the prompt positions that pass computed (half-open ranges), under a policy that selects by
    # the model (needs_probe; empty otherwise): only the node can select them, so receipts read them here
    computed_ranges: tuple[tuple[int, int], ...] = ()
    # an order-free request whose prompt past the exact-prefix hit was computed in full, as
    # prefix caching does, because that was no dearer than composing it (computed_ranges says what)
    served_exactly: bool = False
    bytes_fetched: int = 0
    completion_tokens: int = 0
    # on the node, from the plan's arrival: until the request's first engine step began (its
    # queueing there) and until its first token was sampled (0: not reached)
    node_queued_s: float = 0.0
    node_first_token_s: float = 0.0
    # unit id -> where its state came from: local, remote, computed (prefilled here; also a
    # failed fetch), peer (prefilled for this request by an idle node at the same time, then
    # fetched: counted as computed) or coalesced (another request's prefill of it, joined); a
    # unit the final extend recomputes whole is not prepared and not listed
    unit_sources: dict[str, str] = field(default_factory=dict)

    def tokens_by_source(self) -> tuple[tuple[str, int], ...]:
        """Prompt tokens by where their state came from: the ``source`` label of the token metrics."""
        return (("prefix", self.prefix_cached_tokens), ("local", self.local_tokens), ("remote", self.remote_tokens),
                ("computed", self.computed_unit_tokens), ("coalesced", self.coalesced_unit_tokens),
                ("recomputed", self.recomputed_tokens))

    def units_by_preparation(self) -> tuple[tuple[str, int], ...]:
        return (("local", self.local_units), ("remote", self.remote_units), ("computed", self.computed_units),
                ("coalesced", self.coalesced_units))

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose state was reused (OpenAI's ``usage.prompt_tokens_details.cached_tokens``).

        Coalesced tokens are not among them: no cache held their state when the request
        arrived, and the request waited for the prefill that made it."""
        return self.prefix_cached_tokens + self.local_tokens + self.remote_tokens


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token; ``text`` is the text it adds (tokens may end mid-character)."""

    version: int
    token_id: int
    text: str
    logprob: float | None = None  # set iff the request asked for logprobs
    top: tuple[TopLogprob, ...] = ()
    # on the first token only: the prompt's preparation figures, so a reply the caller cuts
    # short (stop string, disconnect) still has its usage
    stats: RequestStats | None = None
    kind: str = "token"


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """The last event of a request that finished: why it stopped and its statistics."""

    version: int
    finish_reason: str  # "stop" or "length"
    stats: RequestStats
    kind: str = "done"


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The last event of a request that failed after its stream started."""

    version: int
    message: str
    kind: str = "error"
    # the node refused the request before any of its work reached the client (its queueing
    # bound ran out): the caller treats it as a 429 (another node may still take it), not as a
    # failed node
    refused: bool = False


ExecuteEvent = TokenEvent | DoneEvent | ErrorEvent
EXECUTE_EVENTS: dict[str, type[ExecuteEvent]] = {"token": TokenEvent, "done": DoneEvent, "error": ErrorEvent}
