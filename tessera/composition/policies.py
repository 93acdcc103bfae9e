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

Contract of :meth:`CompositionPolicy.inline`: it returns the layout with the units the policy
would recompute (nearly) whole turned into TEXT; the serving path applies it before planning,
so such a unit is neither prefilled as a miss, nor planned, nor retained for that request.

Policies are registered by name (``composition.policy`` in tessera.toml). This module knows
nothing about tensors or engines.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from tessera.composition.layout import Ranges, merge_ranges, text_ranges
from tessera.config import CompositionConfig
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
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

    def inline(self, layout: PromptLayout) -> PromptLayout:
        """``layout`` with the units this policy serves as plain text; by default none. Pure."""
        return layout


POLICIES: Registry[type[CompositionPolicy]] = Registry("composition.policy")
# class decorator: make a policy selectable as ``composition.policy = name``
register_policy = POLICIES.register
policy_names = POLICIES.names


def policy_from_config(config: CompositionConfig) -> CompositionPolicy:
    """The policy ``config.policy`` built from the ``[composition]`` settings: what is served."""
    return POLICIES.get(config.policy).from_config(config)


def get_policy(name: str, **settings: Any) -> CompositionPolicy:
    """The policy ``name`` as served with the default ``[composition]`` settings, ``settings``
    replacing some of them (``get_policy("epic", recompute_tokens=4)``). Settings are fields of
    :class:`CompositionConfig`, validated there; a policy that has no use for one ignores it,
    as :func:`policy_from_config` does."""
    return policy_from_config(CompositionConfig(policy=name, **settings))


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


# the served settings: LegoLink's defaults are CompositionConfig's, never numbers of its own
_DEFAULTS = CompositionConfig()


@register_policy("epic")
class LegoLink(CompositionPolicy):
    """EPIC LegoLink: recompute the leading tokens of every unit, plus all text.

    The first tokens of an independently prefilled unit act as its attention sink; recomputing
    them in context lets the unit's later tokens (reused) link to what precedes it. A unit of
    ``n`` tokens recomputes ``min(k, ceil(fraction * n))`` (length-aware: a 25-token record is
    not mostly recomputed when ``fraction < 1``). A unit whose recomputed share reaches
    ``inline_share`` is plain text (:meth:`inline`): reusing its last few tokens would save
    less than preparing, planning and retaining it costs.
    """

    def __init__(self, recompute_tokens: int = _DEFAULTS.recompute_tokens,
                 recompute_fraction: float = _DEFAULTS.recompute_fraction,
                 inline_share: float = _DEFAULTS.inline_share) -> None:
        # the [composition] checks, so a policy built in code obeys the same rules (ConfigError)
        CompositionConfig(recompute_tokens=recompute_tokens, recompute_fraction=recompute_fraction,
                          inline_share=inline_share)
        self.k = recompute_tokens
        self.fraction = recompute_fraction
        self.inline_share = inline_share

    @classmethod
    def from_config(cls, config: CompositionConfig) -> CompositionPolicy:
        return cls(config.recompute_tokens, config.recompute_fraction, config.inline_share)

    def recompute_count(self, n_tokens: int) -> int:
        """Leading tokens recomputed of a unit of ``n_tokens`` tokens."""
        return min(self.k, n_tokens, math.ceil(self.fraction * n_tokens - 1e-9))

    def select(self, layout: PromptLayout) -> Ranges:
        heads = [(o, o + self.recompute_count(len(seg.token_ids))) for o, seg in layout.unit_offsets()]
        return merge_ranges([*text_ranges(layout), *heads])

    def inline(self, layout: PromptLayout) -> PromptLayout:
        def whole(seg: Segment) -> bool:
            n = len(seg.token_ids)
            return seg.kind is SegmentKind.UNIT and self.recompute_count(n) >= self.inline_share * n

        if not any(whole(seg) for seg in layout.segments):
            return layout
        out: list[Segment] = []
        for seg in layout.segments:
            if whole(seg) or seg.kind is SegmentKind.TEXT:
                if out and out[-1].kind is SegmentKind.TEXT:
                    out[-1] = Segment(SegmentKind.TEXT, out[-1].token_ids + seg.token_ids)
                else:
                    out.append(Segment(SegmentKind.TEXT, seg.token_ids))
            else:
                out.append(seg)
        return PromptLayout(tuple(out))
