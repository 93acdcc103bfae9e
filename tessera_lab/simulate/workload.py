"""What the simulation serves: each request's prompt layout as the retrieval role would build it.

A bench workload (``rag``, ``locomo``, ``synthetic``) or a traffic trace becomes the list of
:class:`SimRequest`: retrieval is the real in-process retrieval pool (MiniLM + usearch, as
``tessera bench --trace-only`` renders it; rag and locomo only), the prompt is built by the
server's own prompt path (:class:`~tessera.benchmark.traffic_render.TraceRenderer`: unit
identity, chat template, the policy's inlining, the context limit). Arrival times are the
bench client's (:func:`poisson_arrivals`, same seeds), so a simulated run replays the exact
sequence ``tessera bench`` sends.

This module knows nothing about nodes, costs or the control plane.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from tessera.benchmark.traffic import TraceRequest, TraceUnit
from tessera.benchmark.traffic_render import TraceRenderer
from tessera.benchmark.workloads import Workload
from tessera.config import ClusterConfig
from tessera.messages.prompt import PromptLayout, SegmentKind


@dataclass(frozen=True)
class SimRequest:
    layout: PromptLayout  # as served (after the policy's inlining)
    tenant: str
    max_tokens: int | None  # this request's own reply length; None: the run's
    stream: str = ""  # the workload's stream (a LoCoMo conversation): reports break TTFT down by it

    def unit_refs(self) -> list[tuple[str, int]]:
        """(unit_id, n_tokens) of the layout's units in prompt order: what the chat driver routes by."""
        refs: dict[str, int] = {}
        for seg in self.layout.segments:
            if seg.kind is SegmentKind.UNIT:
                refs.setdefault(seg.unit_id, len(seg.token_ids))
        return list(refs.items())


def unit_texts(config: ClusterConfig, workload: Workload) -> list[list[tuple[str, str]]]:
    """Each request's (scope, text) units: retrieved by the real retrieval pool, or as sent."""
    if not any(r.retrieval is not None for r in workload.requests):
        return [[(r.scope, t) for t in r.context_units] for r in workload.requests]
    from tessera.benchmark.render import PromptRenderer  # loads the MiniLM embedder: retrieval workloads only

    renderer = PromptRenderer(config)
    renderer.ingest(workload)
    return [[(u.scope, u.text) for u in renderer.units(r)] for r in workload.requests]


def render(config: ClusterConfig, workload: Workload, texts: Sequence[Sequence[tuple[str, str]]],
           renderer: TraceRenderer | None = None) -> list[SimRequest]:
    """The workload's requests as ``config``'s retrieval role serves them (its mode decides inlining)."""
    renderer = renderer or TraceRenderer(config)
    out = []
    for req, units in zip(workload.requests, texts, strict=True):
        trace = TraceRequest(req.messages, tuple(TraceUnit(s, text=t) for s, t in units), req.placement, req.scope,
                             max_tokens=req.max_tokens)
        out.append(SimRequest(renderer.build(trace).served, trace.tenant, req.max_tokens, req.stream))
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """The bench client's open-loop send times (seconds from the phase's start), same generator and seed."""
    rng = random.Random(seed)
    out, at = [], 0.0
    for _ in range(n):
        out.append(at)
        at += rng.expovariate(rate) if rate > 0 else 0.0
    return out
