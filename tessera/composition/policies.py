"""Composition policies: which prompt positions to recompute over placed unit states.

A prompt is a :class:`PromptLayout`: a leading text part (the exact prefix: system prompt,
template), then context units interleaved with request text, then the suffix (question,
generation prompt). Units arrive as independently prefilled states placed at their offsets;
a policy decides which positions the final extend pass computes on top of them.

Contract of :meth:`CompositionPolicy.select`:

* it only reads the layout and returns sorted, disjoint half-open ``(start, end)`` ranges of
  prompt positions;
* the ranges cover every TEXT token (text never has a reusable state; the caller later drops
  the part its exact-prefix cache already holds);
* unit positions not covered are served from the unit's placed state; covered ones are
  recomputed for this request only and never written back into a unit state.

Policies are registered by name (``composition.policy`` in tessera.toml). This module knows
nothing about tensors or engines.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from tessera.composition.layout import Ranges, merge_ranges, text_ranges
from tessera.config import CompositionConfig
from tessera.errors import ConfigError
from tessera.messages import PromptLayout
from tessera.registry import Registry


class CompositionPolicy(ABC):
    """Base class of composition policies (see the module docstring for the contract)."""

    name: ClassVar[str]

    @classmethod
    def from_config(cls, config: CompositionConfig) -> CompositionPolicy:
        """Build from ``[composition]`` settings; policies with options override this."""
        return cls()

    @abstractmethod
    def select(self, layout: PromptLayout) -> Ranges:
        """Ranges of prompt positions to compute; must cover every TEXT token. Pure."""


POLICIES: Registry[type[CompositionPolicy]] = Registry("composition.policy")
# class decorator: make a policy selectable as ``composition.policy = name``
register_policy = POLICIES.register
policy_names = POLICIES.names


def get_policy(name: str, **opts: Any) -> CompositionPolicy:
    return POLICIES.get(name)(**opts)


def policy_from_config(config: CompositionConfig) -> CompositionPolicy:
    return POLICIES.get(config.policy).from_config(config)


@register_policy("full")
class FullRecompute(CompositionPolicy):
    """Recompute everything: plain prefill of the composed prompt (the quality oracle)."""

    def select(self, layout: PromptLayout) -> Ranges:
        return ((0, layout.n_tokens),) if layout.n_tokens else ()


@register_policy("naive")
class NaiveConcat(CompositionPolicy):
    """Reuse every unit state as placed; compute only the request's own text."""

    def select(self, layout: PromptLayout) -> Ranges:
        return text_ranges(layout)


@register_policy("epic")
class LegoLink(CompositionPolicy):
    """EPIC LegoLink: recompute the first ``k`` tokens of every unit, plus all text.

    The first tokens of an independently prefilled unit act as its attention sink; recomputing
    them in context lets the unit's later tokens (reused) link to what precedes it.
    """

    def __init__(self, recompute_tokens: int = 16) -> None:
        if recompute_tokens < 0:
            raise ConfigError(f"composition.recompute_tokens = {recompute_tokens} is invalid: expected >= 0")
        self.k = recompute_tokens

    @classmethod
    def from_config(cls, config: CompositionConfig) -> CompositionPolicy:
        return cls(config.recompute_tokens)

    def select(self, layout: PromptLayout) -> Ranges:
        heads = [(o, o + min(self.k, len(seg.token_ids))) for o, seg in layout.unit_offsets()]
        return merge_ranges([*text_ranges(layout), *heads])
