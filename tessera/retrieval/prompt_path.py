"""The server's prompt path as pure steps: unit checks, chat template, inlining, the context limit.

The chat API (:mod:`tessera.retrieval.chat.layout`) and every offline tool that claims to
score or replay "what is served" (``tessera verify``, ``tessera analyze``, the trace replay)
build prompts with these functions, so the two can never drift:

* :func:`identify_unit`: a unit's text becomes token ids through the deployment's unit
  factory (plain text: ``<|im_start|>`` in a unit is characters, never a control token) and is
  refused like the API refuses it (empty, no tokens, over ``retrieval.max_unit_tokens``: 413);
* :class:`PromptPath`: the same, plus the chat template (:class:`PromptBuilder`), the policy's
  inlining and the context limit, for tools that have no server.

This module knows nothing about HTTP, routing or generation nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tessera.composition.policies import CompositionPolicy
from tessera.errors import BadRequest
from tessera.messages.prompt import PromptLayout
from tessera.retrieval.limits import check_prompt_chars, check_unit_chars
from tessera.retrieval.prompt import PromptBuilder
from tessera.retrieval.store.index import check_scope
from tessera.units import ContextUnit, UnitFactory


def identify_unit(factory: UnitFactory, max_unit_tokens: int, scope: str, text: str, field: str = "unit",
                  tenant: str = "") -> ContextUnit:
    """Tokenize and identify one unit of ``tenant``; validates scope, emptiness and length (413)."""
    check_scope(scope, f"{field}.scope")
    if not isinstance(text, str) or not text.strip():
        raise BadRequest(f"{field}.text is empty; a unit needs some text")
    check_unit_chars(field, text, max_unit_tokens)  # before tokenizing an oversized text
    unit = factory.make(scope, text, tenant)
    if unit.n_tokens == 0:
        raise BadRequest(f"{field}.text has no tokens")
    if unit.n_tokens > max_unit_tokens:
        raise BadRequest(
            f"{field}.text is {unit.n_tokens} tokens, more than retrieval.max_unit_tokens = "
            f"{max_unit_tokens}; split it into smaller units", 413
        )
    return unit


def served_layout(layout: PromptLayout, policy: CompositionPolicy | None, max_tokens: int,
                  max_context: int) -> PromptLayout:
    """What the node is sent: ``layout`` with the units ``policy`` inlines as text (None: prefix
    mode, nothing inlined), refused (400) when it and ``max_tokens`` exceed the context."""
    if policy is not None:
        # units the policy recomputes (nearly) whole are plain text: never prefilled, planned or retained
        layout = policy.inline(layout)
    return fitting(layout, max_tokens, max_context)


def fitting(layout: PromptLayout, max_tokens: int, max_context: int) -> PromptLayout:
    """``layout`` as served, refused (400) when it and ``max_tokens`` exceed the context."""
    if layout.n_tokens + max_tokens > max_context:
        raise BadRequest(
            f"the prompt has {layout.n_tokens} tokens (units included) and max_tokens is {max_tokens}, "
            f"more than the model's context of {max_context}; send fewer or shorter units, or lower max_tokens")
    return layout


@dataclass(frozen=True)
class Built:
    """A request's prompt as rendered (every unit a UNIT segment) and as served (after inlining)."""

    rendered: PromptLayout
    served: PromptLayout
    # its units were deduplicated and ordered for exact prefix reuse (tessera.retrieval.order):
    # the node may match its exact-prefix cache into them
    order_free: bool = False
    recurring: bool = False  # order-free, and served in this order before (tessera.retrieval.order.Arranged)
    # the setting chosen for it (composition.per_request: its label, tessera.composition.choice);
    # "" = the process's own
    setting: str = ""


@dataclass
class PromptPath:
    """The chat API's prompt path without a server, for one deployment's tokenizer and limits."""

    builder: PromptBuilder
    factory: UnitFactory
    max_unit_tokens: int
    max_context: int

    def units(self, pairs: Sequence[tuple[str, str]], tenant: str = "") -> list[ContextUnit]:
        """(scope, text) pairs as the API identifies ``context_units`` (same checks, same 413)."""
        return [identify_unit(self.factory, self.max_unit_tokens, scope, text, f"context_units[{i}]", tenant)
                for i, (scope, text) in enumerate(pairs)]

    def build(self, messages: Sequence[dict[str, Any]], units: Sequence[ContextUnit], placement: str,
              policy: CompositionPolicy | None, max_tokens: int = 1) -> Built:
        check_prompt_chars([*(str(m.get("content", "")) for m in messages), *(u.text for u in units)],
                           self.max_context)
        rendered = self.builder.build(messages, units, placement)
        return Built(rendered, served_layout(rendered, policy, max_tokens, self.max_context))
