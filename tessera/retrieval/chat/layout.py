"""A chat request's units and its fixed prompt layout, checked against the model's context.

:func:`chat_layout` retrieves the request's units (or identifies the caller's), renders the
chat template around them on the retrieval worker thread and refuses, with a 400 that says
what to send instead, a prompt that cannot fit (the steps of :mod:`~tessera.retrieval.prompt_path`,
which the offline tools share). Work is bounded before it is done: the
prompt's characters are checked before anything is tokenized (:mod:`tessera.retrieval.limits`).
An order-free request's units are deduplicated and ordered before the template is rendered
(:mod:`tessera.retrieval.order`).

This module knows nothing about routing, generation nodes or the reply: it ends at the layout.
"""

from __future__ import annotations

from tessera.retrieval.chat.request import ChatRequest
from tessera.retrieval.chat.serving import Serving
from tessera.retrieval.limits import check_prompt_chars
from tessera.retrieval.node import RetrievalNode
from tessera.retrieval.order import lead_key
from tessera.retrieval.prompt_path import Built, fitting, served_layout
from tessera.tenants import OPEN, Tenant
from tessera.units import ContextUnit


async def request_units(node: RetrievalNode, chat: ChatRequest, tenant: Tenant = OPEN) -> list[ContextUnit]:
    """The request's units, all of ``tenant`` (403 for a scope it does not own)."""
    if chat.retrieval is not None:
        r = chat.retrieval
        tenant.check_scope(r.scope, "retrieval.scope")
        if r.embedding is not None:
            hits = await node.retrieve(r.scope, embedding=r.embedding, top_k=r.top_k, tenant=tenant.name)
        else:
            hits = await node.retrieve(r.scope, query=r.query, top_k=r.top_k, tenant=tenant.name)
        return [h.unit for h in hits]
    if chat.units:
        by_scope: dict[str, list[int]] = {}
        for i, u in enumerate(chat.units):
            by_scope.setdefault(u.scope, []).append(i)
        out: list[ContextUnit | None] = [None] * len(chat.units)
        for scope, idx in by_scope.items():
            tenant.check_scope(scope, "context_units.scope")
            for i, unit in zip(idx, await node.identify(scope, [chat.units[i].text for i in idx], tenant.name),
                               strict=True):
                out[i] = unit
        return [u for u in out if u is not None]
    return []


async def chat_layout(serving: Serving, node: RetrievalNode, chat: ChatRequest, tenant: Tenant = OPEN) -> Built:
    """The request's layout: its units placed in the rendered chat template, as rendered and as served."""
    builder, limit = serving.builder, serving.max_context
    assert builder is not None, "Serving.start() runs before the first chat request"
    texts = [m["content"] for m in chat.messages]
    # bounded work: a prompt that cannot fit is refused before anything is tokenized
    check_prompt_chars([*texts, *(u.text for u in chat.units)], limit)
    units = await request_units(node, chat, tenant)
    check_prompt_chars([*texts, *(u.text for u in units)], limit)
    free = bool(units) and chat.order_free(node.config.retrieval.order_free)
    recurring = False
    if free:  # deduplicated, and ordered so that what earlier prompts began with recurs
        arranged = serving.orders.arrange(lead_key(tenant.name, chat.messages, chat.placement), units)
        units, recurring = arranged.units, arranged.recurring
    # tokenizing runs on the retrieval worker thread, never on the event loop
    rendered = await node.in_worker(builder.build, chat.messages, units, chat.placement)
    if serving.choices is not None:  # the cheapest calibrated setting for this prompt, as it serves it
        choice, served = serving.choices.choose(rendered)
        return Built(rendered, fitting(served, chat.max_tokens, limit), order_free=free, recurring=recurring,
                     setting=choice.label)
    policy = serving.policy if node.config.control.mode == "compose" else None
    return Built(rendered, served_layout(rendered, policy, chat.max_tokens, limit), order_free=free,
                 recurring=recurring)
