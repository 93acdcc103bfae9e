"""The reuse receipt of one reply: where each context unit's state came from, and at what fidelity.

Every reply's ``usage.tessera.receipt`` says, per source, how many units and unit tokens were

* ``prefix``: inside the exact-prefix cache hit;
* ``local`` / ``remote``: placed from the node's local cache / fetched from the KV pool;
* ``computed``: computed for this request (a unit prefill on the node, a failed fetch, or, for
  a unit the policy recomputes whole, the final extend);
* ``coalesced``: computed once for another request on the same node, whose in-flight prefill
  this one joined (the request that ran it says ``computed``);
* ``inlined``: sent as plain text because the policy would recompute (nearly) all of it;

and how many tokens of each were recomputed in the request's final extend. ``way`` says how the
prompt past the prefix hit was served: ``exact`` (computed in full, as prefix caching does) or
``composed`` (by the policy); the ``prefix`` unit tokens are the ones served exactly from a
cache. It names the composition policy that served the request with every knob, and its
fidelity record (see :mod:`tessera.composition.calibration`). With ``return_layout`` it also
lists every unit.

The receipt is computed here from the layout as rendered and as served, the node's per-unit
sources and its prefix hit: the same pure layout math the node ran (:func:`computed_ranges`).
This module knows nothing about HTTP or metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.composition.layout import Ranges, computed_ranges
from tessera.composition.policies import CompositionPolicy
from tessera.messages.generation import RequestStats
from tessera.messages.prompt import PromptLayout

SOURCES = ("prefix", "local", "remote", "computed", "peer", "coalesced", "inlined")


@dataclass(frozen=True)
class Composition:
    """How this process composes prompts: the served policy (None: prefix mode) and what receipts say."""

    policy: CompositionPolicy | None
    description: dict[str, Any] = field(default_factory=dict)  # policy knobs, fidelity record, gate


def way(composition: Composition, stats: RequestStats) -> str:
    """How the prompt past the exact-prefix hit was served: ``exact`` (computed in full, prefix
    mode or an order-free request the node served so) or ``composed`` (the policy's ranges)."""
    return "exact" if composition.policy is None or stats.served_exactly else "composed"


def _overlap(a: int, b: int, ranges: Ranges) -> int:
    return sum(max(0, min(b, y) - max(a, x)) for x, y in ranges)


def receipt(rendered: PromptLayout, served: PromptLayout, composition: Composition, stats: RequestStats,
            per_unit: bool = False) -> dict[str, Any]:
    """The receipt of one reply (see the module docstring)."""
    prefix = stats.prefix_cached_tokens
    n = served.n_tokens
    if composition.policy is None:  # prefix mode: everything past the hit is computed in one pass
        computed: Ranges = ((prefix, n),) if prefix < n else ()
    elif composition.policy.needs_probe or stats.served_exactly:  # the node's choice, which only it can make
        computed = stats.computed_ranges
    else:
        computed = computed_ranges(served, composition.policy.select(served), prefix)
    served_units = {offset for offset, _ in served.unit_offsets()}
    units = dict.fromkeys(SOURCES, 0)
    tokens = dict.fromkeys(SOURCES, 0)
    recomputed = dict.fromkeys(SOURCES, 0)
    listed = []
    for offset, seg in rendered.unit_offsets():
        end = offset + len(seg.token_ids)
        in_prefix = max(0, min(end, prefix) - offset)
        if offset not in served_units:
            source = "inlined"
        elif in_prefix == len(seg.token_ids):
            source = "prefix"
        else:
            source = stats.unit_sources.get(seg.unit_id, "computed")
        again = _overlap(offset, end, computed)
        units[source] += 1
        tokens[source] += len(seg.token_ids)
        recomputed[source] += again
        if per_unit:
            listed.append({"unit_id": seg.unit_id, "offset": offset, "tokens": len(seg.token_ids),
                           "source": source, "prefix_tokens": in_prefix, "recomputed_tokens": again})
    out: dict[str, Any] = {"units": units, "unit_tokens": tokens, "recomputed_tokens": recomputed,
                           "way": way(composition, stats),
                           **composition.description}
    if per_unit:
        out["per_unit"] = listed
    return out
