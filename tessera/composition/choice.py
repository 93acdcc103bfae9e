"""The per-request choice under the fidelity gate (``composition.per_request``).

With it on, a role decides at start-up which settings may compose: every setting a calibration
record calibrates for this model, engine and dtypes and that meets ``max_kl`` and
``min_agreement`` (:func:`~tessera.composition.calibration.calibrated_settings`). For each
prompt the retrieval role then serves the one whose final extend computes the fewest positions
(:meth:`~tessera.composition.policies.CompositionPolicy.extend_tokens` of the layout as that
setting serves it, after its inlining), the lower calibrated KL on a tie, and full prefill when
no setting is calibrated: a missing or failing record never composes. The generation node
serves the setting the request names, from the same records; it refuses one it did not
calibrate itself (the roles' records differ). How much of an order-free request is served
exactly instead is the node's choice (:mod:`tessera.generation.executor`).

This module knows nothing about servers or engines beyond binding a policy to one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tessera.composition.calibration import Decision, Fingerprint, calibrated_settings, setting_label
from tessera.composition.policies import CompositionPolicy, ModelProbe, policy_from_config
from tessera.config import CompositionConfig
from tessera.messages.prompt import PromptLayout


@dataclass(frozen=True)
class Choice:
    """One setting a request may be served with."""

    label: str  # setting_label: every knob, named (what an ExecuteRequest carries)
    policy: CompositionPolicy
    decision: Decision


class Choices:
    """The settings this role may serve per request (verbs ``choose``, ``named``)."""

    def __init__(self, options: Sequence[Choice], fallback: Choice) -> None:
        self.options = list(options)
        self.fallback = fallback  # full prefill: what a request gets when no setting is calibrated
        self._by_label = {c.label: c for c in (*self.options, self.fallback)}

    @classmethod
    def gate(cls, config: CompositionConfig, model: str, dtype: str, kv_dtype: str,
             engine: str) -> tuple[Choices, list[str]]:
        """The calibrated settings of ``config``'s records (and why others were passed over)."""
        calibrated, passed = calibrated_settings(config, model, dtype, kv_dtype, engine)
        fallback = Decision(config, dataclasses.replace(config, policy="full"), "fallback-full",
                            Fingerprint.of(config, model, dtype, kv_dtype, engine), None,
                            "no calibrated setting meets the targets; serving full prefill; measure settings "
                            "with: tessera verify --calibrate")
        return cls([_choice(d) for d in calibrated], _choice(fallback)), passed

    def bound(self, probe: ModelProbe) -> Choices:
        """The same choices, their policies reading ``probe`` (the node's engine)."""
        return Choices([dataclasses.replace(c, policy=c.policy.bound(probe)) for c in self.options], self.fallback)

    def choose(self, layout: PromptLayout) -> tuple[Choice, PromptLayout]:
        """The setting that computes the fewest positions for ``layout`` (as rendered), and the
        layout as it serves it; full prefill when no setting is calibrated."""
        best: tuple[tuple[int, float], Choice, PromptLayout] | None = None
        for c in self.options:
            served = c.policy.inline(layout)
            record = c.decision.record
            key = (c.policy.extend_tokens(served), float(record["kl"]["mean"]) if record else 0.0)
            if best is None or key < best[0]:
                best = (key, c, served)
        if best is None:
            return self.fallback, self.fallback.policy.inline(layout)
        return best[1], best[2]

    def named(self, label: str) -> Choice | None:
        """The choice ``label`` names, or None: not a setting this role calibrated."""
        return self._by_label.get(label)

    @property
    def labels(self) -> list[str]:
        return [c.label for c in self.options]


def _choice(decision: Decision) -> Choice:
    return Choice(setting_label(decision.served), policy_from_config(decision.served), decision)
