"""The chat API's Prometheus metrics on the retrieval role, one verb per thing counted.

Each verb has one caller: the handler counts a request's status (:meth:`ChatMetrics.request`)
and the serving state its admissions (:meth:`pending`); the reply layer observes the first
token (:meth:`first_token`) and, once per finished reply, where its prompt's state came from
(:meth:`finished`). The control plane's figures are read at scrape time, never copied.

This module knows nothing about HTTP or the request path; it only names and counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from tessera.control.plane import ControlPlane
from tessera.messages.generation import RequestStats
from tessera.metrics import Metrics


class ChatMetrics:
    """The retrieval role's registry: chat requests, their tokens and units, the plane at scrape time."""

    def __init__(self, plane: Callable[[], ControlPlane]) -> None:
        """``plane()``: the plane whose figures a scrape reads (the current term's, with ``[ha]``)."""
        m = self.registry = Metrics()
        self._requests = m.counter("tessera_requests_total", "Chat requests by HTTP status", ["status"])
        self._ttft = m.histogram("tessera_ttft_seconds", "Time to first token at the server")
        self._tokens = m.counter("tessera_prompt_tokens_total", "Prompt tokens by where their state came from "
                                 "(prefix cache, local unit cache, shared KV pool, computed unit, coalesced "
                                 "unit, recomputed); each unit prefill counts as computed once",
                                 ["source"])
        self._units = m.counter("tessera_units_total", "Context units by preparation outcome", ["preparation"])
        self._fallbacks = m.counter("tessera_fetch_fallbacks_total", "Remote fetches that failed and were computed")
        self._coalesced = m.counter("tessera_coalesced_prefills_total",
                                    "Missing units that joined an in-flight prefill")
        self._bytes = m.counter("tessera_bytes_fetched_total", "Bytes of unit state fetched from the KV pool")
        self._completion = m.counter("tessera_completion_tokens_total", "Generated tokens")
        self._pending = m.gauge("tessera_pending_requests", "Requests in flight at the retrieval node")
        # the reuse receipts, summed (tessera.retrieval.chat.receipt): per unit source, and the fidelity gate
        self._receipt_units = m.counter("tessera_receipt_units_total", "Context units by where their state came "
                                        "from (prefix, local, remote, computed, coalesced, inlined)",
                                        ["source"])
        self._receipt_tokens = m.counter("tessera_receipt_unit_tokens_total", "Unit tokens by source", ["source"])
        self._receipt_recomputed = m.counter("tessera_receipt_recomputed_tokens_total",
                                             "Unit tokens recomputed in the final extend, by the unit's source",
                                             ["source"])
        self._composed = m.counter("tessera_composition_requests_total", "Replies by served composition policy "
                                   "and calibration status (exact, calibrated, uncalibrated, below-target, "
                                   "fallback-full)", ["policy", "calibration"])
        self._ways = m.counter("tessera_requests_by_way_total", "Replies by how the prompt past the exact-prefix "
                               "hit was served: exact (computed in full) or composed (by the policy)", ["way"])
        self._settings = m.counter("tessera_requests_by_setting_total", "Replies by the composition setting that "
                                   "served them, every knob named (with composition.per_request: the setting "
                                   "chosen for each request)", ["setting"])
        m.read_at_scrape(lambda: plane().metrics())

    def request(self, status: str) -> None:
        """One admitted request ended with this status: an HTTP code, ``stream-error`` or ``cancelled``."""
        self._requests.labels(status=status).inc()

    def pending(self, n: int) -> None:
        self._pending.set(n)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def finished(self, stats: RequestStats, receipt: dict[str, Any]) -> None:
        """A reply ran to its end (done, or cut by a stop string): its prompt's figures and its receipt."""
        for source, n in receipt["units"].items():
            self._receipt_units.labels(source=source).inc(n)
            self._receipt_tokens.labels(source=source).inc(receipt["unit_tokens"][source])
            self._receipt_recomputed.labels(source=source).inc(receipt["recomputed_tokens"][source])
        policy = receipt.get("policy", {}).get("policy", "prefix")
        self._composed.labels(policy=policy, calibration=receipt.get("calibration", "exact")).inc()
        self._ways.labels(way=receipt["way"]).inc()
        named = receipt.get("policy", {"policy": "prefix"})
        self._settings.labels(setting=" ".join(f"{k}={v}" for k, v in named.items())).inc()
        for source, n in stats.tokens_by_source():
            self._tokens.labels(source=source).inc(n)
        for preparation, n in stats.units_by_preparation():
            self._units.labels(preparation=preparation).inc(n)
        self._fallbacks.inc(stats.fallbacks)
        self._coalesced.inc(stats.coalesced_units)
        self._bytes.inc(stats.bytes_fetched)
        self._completion.inc(stats.completion_tokens)

    def response(self) -> web.Response:
        return self.registry.response()
