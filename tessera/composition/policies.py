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

A policy may read the model too: one that ``needs_probe`` selects unit tokens by what the
model computes from the prompt's tokens (a :class:`ModelProbe`, which the engine is), and
serves only once :meth:`CompositionPolicy.bound` to one. The generation node binds its engine,
offline composition the engine it composes on; the retrieval role, which has no model, reads
what such a policy computed from the node's report.

Policies are registered by name (``composition.policy`` in tessera.toml). This module knows
nothing about tensors or engines.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from tessera.composition.layout import Ranges, merge_ranges, text_ranges
from tessera.config import CompositionConfig
from tessera.errors import ConfigError
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
from tessera.registry import Registry


class ModelProbe(Protocol):
    """What a policy that reads the model asks of it (engines that can answer set ``probes_model``).

    Both answers depend on the prompt's tokens alone, never on what is cached."""

    probes_model: bool

    def first_layer_attention(self, token_ids: Sequence[int], query_from: int) -> Sequence[float]:
        """Per position of the prompt ``token_ids``: the attention the tokens at ``query_from`` and
        after pay it in the model's first layer, summed over heads and those tokens (causal):
        what full prefill computes there."""
        ...

    def second_layer_deviation(self, token_ids: Sequence[int], units: Sequence[tuple[int, int]]) -> Sequence[float]:
        """Per position: the squared distance between the second layer's keys and values (before
        RoPE) of a token of the half-open spans ``units`` prefilled alone, as unit states are,
        and in the whole prompt (0 outside them)."""
        ...


class CompositionPolicy(ABC):
    """Base class of composition policies (see the module docstring for the contract)."""

    name: ClassVar[str]
    # True: select() reads the model (bound() to a ModelProbe); the retrieval role then
    # takes the computed positions from the node's report instead of selecting them itself
    needs_probe: ClassVar[bool] = False
    # the [composition] keys it reads besides the unit lead and BOS (calibration records, labels)
    knobs: ClassVar[tuple[str, ...]] = ()

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

    def extend_tokens(self, layout: PromptLayout) -> int:
        """Positions the final extend computes for ``layout`` (as served: after :meth:`inline`)
        with no prefix hit: the price the per-request choice compares. Known without the model,
        for every policy. Pure."""
        return sum(b - a for a, b in self.select(layout))

    def bound(self, probe: ModelProbe) -> CompositionPolicy:
        """This policy reading ``probe`` (the engine that serves it); a policy that reads no model is itself."""
        return self


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

    knobs: ClassVar[tuple[str, ...]] = ("recompute_tokens", "recompute_fraction", "inline_share")

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


class ScoredRecompute(LegoLink):
    """EPIC's leading tokens, plus the unit tokens the model scores highest.

    Besides what :class:`LegoLink` recomputes (all text, the first tokens of every unit), it
    recomputes ``ceil(recompute_budget * m)`` of the ``m`` other unit tokens of the prompt, the
    highest by :meth:`scores` (ties to the earlier position), a budget over the whole prompt
    (a unit that matters more gets more of it). Scores are read from the model
    (:class:`ModelProbe`) and depend on the tokens alone, so serving a choice equals offline
    composition on the same engine. ``recompute_tokens = 0`` selects by the scores alone.
    """

    needs_probe = True
    knobs = (*LegoLink.knobs, "recompute_budget")

    def __init__(self, recompute_tokens: int = _DEFAULTS.recompute_tokens,
                 recompute_fraction: float = _DEFAULTS.recompute_fraction,
                 inline_share: float = _DEFAULTS.inline_share, recompute_budget: float = _DEFAULTS.recompute_budget,
                 probe: ModelProbe | None = None) -> None:
        super().__init__(recompute_tokens, recompute_fraction, inline_share)
        CompositionConfig(recompute_budget=recompute_budget)
        self.budget = recompute_budget
        self.probe = probe

    @classmethod
    def from_config(cls, config: CompositionConfig) -> CompositionPolicy:
        return cls(config.recompute_tokens, config.recompute_fraction, config.inline_share, config.recompute_budget)

    def bound(self, probe: ModelProbe) -> CompositionPolicy:
        if not getattr(probe, "probes_model", False):
            raise ConfigError(f"composition.policy = \"{self.name}\" selects unit tokens by reading the model, and "
                              f"{type(probe).__name__} cannot; serve it with model.engine = \"reference\" "
                              "or \"paged\", or choose composition.policy = \"epic\"")
        return type(self)(self.k, self.fraction, self.inline_share, self.budget, probe)

    @abstractmethod
    def scores(self, probe: ModelProbe, layout: PromptLayout) -> Sequence[float]:
        """A score per prompt position (only unit positions are read): higher, recomputed first."""

    def _candidates(self, layout: PromptLayout) -> tuple[list[int], int]:
        """The unit positions past EPIC's heads, and how many of them the budget recomputes."""
        candidates = [p for o, seg in layout.unit_offsets()
                      for p in range(o + self.recompute_count(len(seg.token_ids)), o + len(seg.token_ids))]
        return candidates, math.ceil(self.budget * len(candidates) - 1e-9)

    def extend_tokens(self, layout: PromptLayout) -> int:
        # the picks lie outside LegoLink's ranges (past the heads, in units): how many, not which
        return sum(b - a for a, b in LegoLink.select(self, layout)) + self._candidates(layout)[1]

    def select(self, layout: PromptLayout) -> Ranges:
        base = super().select(layout)
        candidates, picks = self._candidates(layout)
        if not picks:
            return base
        if self.probe is None:
            raise ConfigError(f"composition.policy = \"{self.name}\" reads the model: bind the engine that serves "
                              "it (policy.bound(engine)) before selecting")
        score = self.scores(self.probe, layout)
        chosen = sorted(candidates, key=lambda p: (-score[p], p))[:picks]
        return merge_ranges([*base, *((p, p + 1) for p in chosen)])


@register_policy("query")
class QueryAware(ScoredRecompute):
    """The unit tokens the request's own text attends to most (in the spirit of ProphetKV).

    The score of a unit token is the attention the request's text after the last unit (its
    question and the generation prompt) pays it in the model's first layer. Which tokens a
    question needs from its context differs per question; a query-agnostic policy recomputes
    the same ones for all. The first layer is the only one whose attention the cached states
    do not change: the choice is the one full prefill would make there.
    """

    def scores(self, probe: ModelProbe, layout: PromptLayout) -> Sequence[float]:
        return probe.first_layer_attention(layout.token_ids(), query_start(layout))


@register_policy("deviation")
class Deviation(ScoredRecompute):
    """The unit tokens whose cached state is furthest from full prefill's (in the spirit of CacheBlend).

    The score of a unit token is the squared distance between the second layer's keys and
    values (before RoPE) it gets prefilled alone, as its cached state was, and in the whole
    prompt: the first place where context changes a state, and a token whose early state
    deviates most is the one whose recompute corrects most. Query-agnostic, like EPIC, but
    chosen per token from the context the unit lands in.
    """

    def scores(self, probe: ModelProbe, layout: PromptLayout) -> Sequence[float]:
        spans = [(o, o + len(seg.token_ids)) for o, seg in layout.unit_offsets()]
        return probe.second_layer_deviation(layout.token_ids(), spans)


def query_start(layout: PromptLayout) -> int:
    """Where the request's own text after the last unit begins (its last token if none follows)."""
    end = max((o + len(seg.token_ids) for o, seg in layout.unit_offsets()), default=0)
    return min(end, layout.n_tokens - 1)
