"""Per-process state of the chat API: node clients, composition policy, prompt builder, admission, metrics.

The composition policy is the one the fidelity gate lets this process serve
(:func:`tessera.composition.calibration.decide`, decided in :meth:`Serving.start`), or, with
``composition.per_request``, one chosen for each request among the calibrated settings
(:class:`~tessera.composition.choice.Choices`; the receipt of each says which). Order-free
requests are ordered by :attr:`Serving.orders` (:mod:`tessera.retrieval.order`).

One :class:`Serving` lives on the aiohttp app (``routes.SERVING``). It is built with the app
and started by an explicit step, :meth:`Serving.start`, once the retrieval node has loaded
the tokenizer: that builds the prompt builder and reads the model's context limit from the
checkpoint's config (no weights are loaded here). Until then :attr:`ready` is False and the
handler answers 503.

Admission is a count of requests in flight against the cluster's capacity (the sum of the
generation nodes' ``max_inflight``): :meth:`admit` / :meth:`leave`.

This module knows nothing about HTTP, the request path or the reply: the handler, the
driver and the reply layer read this state; it never calls them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tessera.composition.calibration import decide
from tessera.composition.choice import Choices
from tessera.composition.policies import policy_from_config
from tessera.config import ClusterConfig
from tessera.control.plane import ControlPlane
from tessera.engines.checkpoint import resolve
from tessera.engines.geometry import geometry_from_checkpoint
from tessera.retrieval.chat.generation_client import NodeClients
from tessera.retrieval.chat.metrics import ChatMetrics
from tessera.retrieval.chat.receipt import Composition
from tessera.retrieval.node import RetrievalNode
from tessera.retrieval.order import UnitOrders
from tessera.retrieval.prompt import PromptBuilder
from tessera.units import TokenCache

log = logging.getLogger(__name__)


class Serving:
    """The chat API's state in one retrieval process."""

    def __init__(self, config: ClusterConfig, plane: Callable[[], ControlPlane]) -> None:
        self.config = config
        self.nodes = NodeClients(config)
        self.policy = policy_from_config(config.composition)  # until start(): the fidelity gate may replace it
        self.composition = Composition(None)  # what receipts say; set by start()
        self.metrics = ChatMetrics(plane)
        self.capacity = sum(n.max_inflight for n in config.generation)
        self.pending = 0
        self.builder: PromptBuilder | None = None  # set by start()
        self.max_context = 0  # tokens of the model's context, set by start()
        self.orders = UnitOrders()  # the unit orders served, for order-free requests
        # composition.per_request: the settings a request may be served with, and what their receipts say
        self.choices: Choices | None = None
        self._compositions: dict[str, Composition] = {}

    @property
    def ready(self) -> bool:
        return self.builder is not None

    def start(self, node: RetrievalNode) -> None:
        """Build the prompt builder on ``node``'s tokenizer, read the model's context limit and pass
        the fidelity gate (the generation nodes decide alike from the same config and records)."""
        assert node.ready and node.tokenizer is not None and node.fingerprint is not None, \
            "start the retrieval node before serving chat"
        c = self.config
        checkpoint = resolve(c.model)
        self.max_context = geometry_from_checkpoint(checkpoint, c.kv_dtype, c.model.max_context).max_context
        decision = decide(c.composition, c.control.mode, node.fingerprint.model, c.model.dtype, c.kv_dtype,
                          c.model.engine)
        if decision.warning:
            log.warning("retrieval: %s", decision.warning)
        self.policy = policy_from_config(decision.served)
        if c.control.mode == "compose" and c.composition.per_request:
            self.choices, passed = Choices.gate(c.composition, node.fingerprint.model, c.model.dtype, c.kv_dtype,
                                                c.model.engine)
            log.info("retrieval: composing per request among %s", self.choices.labels or "none (full prefill)")
            for why in passed:
                log.info("retrieval: calibration record passed over: %s", why)
            for choice in (*self.choices.options, self.choices.fallback):
                self._compositions[choice.label] = Composition(choice.policy, {**choice.decision.describe(),
                                                                               "choice": "per-request"})
            self.policy = self.choices.fallback.policy
            self.composition = self._compositions[self.choices.fallback.label]
        elif c.control.mode == "compose":
            self.composition = Composition(self.policy, decision.describe())
        else:  # exact prefix caching: no policy shapes the prompt
            self.composition = Composition(None, {"policy": {"policy": "prefix-caching"}, "calibration": "exact"})
        self.builder = PromptBuilder(node.tokenizer, TokenCache(node.tokenizer.encode_plain))

    def composition_of(self, setting: str) -> Composition:
        """What the receipt of a request served with ``setting`` says ("": the process's own)."""
        return self._compositions[setting] if setting else self.composition

    async def close(self) -> None:
        await self.nodes.close()

    def admit(self) -> bool:
        """Count one more request in flight; False (nothing counted) when the cluster is at capacity."""
        if self.pending >= self.capacity:
            return False
        self.pending += 1
        self.metrics.pending(self.pending)
        return True

    def leave(self) -> None:
        """An admitted request is over."""
        assert self.pending > 0, f"leave() without admit(): pending = {self.pending}"
        self.pending -= 1
        self.metrics.pending(self.pending)
