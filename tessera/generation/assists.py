"""Assists: this node prefills units of a request another node serves, and publishes them.

The control plane splits the units a request must compute between its serving node and an
idle one (:mod:`tessera.control.planner`, "Assists"): units are prefilled independently, so
two nodes compute them at once. Here the idle node's part runs: each unit is prefilled (or
joins a prefill of it in flight here, or comes from the local cache) and written to the KV
pool under the plan's grant; the serving node fetches it once it is published, and computes
it itself if it does not come in time. The work runs at the scheduler's usual priority: it
was given to a node with nothing else to do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from tessera.engines.base import UnitState
from tessera.errors import BadRequest
from tessera.generation.prefills import PrefillCoalescer
from tessera.generation.retention import Retainer
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages.generation import PrefillRequest
from tessera.messages.plan import Preparation, UnitPlan
from tessera.runtime import BackgroundTasks

log = logging.getLogger(__name__)


def check(msg: PrefillRequest, node: str) -> dict[str, tuple[int, ...]]:
    """The order's token ids by unit; BadRequest unless it is a well-formed assist for ``node``."""
    plan = msg.plan
    if plan.node != node:
        raise BadRequest(f"assist plan is for node {plan.node!r}, this is {node!r}")
    texts = {t.unit_id: t.token_ids for t in msg.units}
    if len(texts) != len(msg.units) or set(texts) != {u.unit_id for u in plan.units}:
        raise BadRequest("an assist names each of its plan's units once, with their token ids")
    for u in plan.units:
        if u.preparation is not Preparation.COMPUTE or u.grant is None or u.grant.writer != node:
            raise BadRequest(f"unit {u.unit_id}: an assist computes a unit under a write grant of {node!r}")
        if len(texts[u.unit_id]) != u.n_tokens or u.n_tokens == 0:
            raise BadRequest(f"unit {u.unit_id}: {len(texts[u.unit_id])} token ids for a unit of {u.n_tokens}")
    return texts


class Assists:
    """Runs accepted assists in the background (verbs ``start``, ``drain``)."""

    def __init__(self, prefills: PrefillCoalescer, cache: LocalUnitCache, retainer: Retainer) -> None:
        self.prefills = prefills
        self.cache = cache
        self.retainer = retainer
        self.tasks = BackgroundTasks("assists")
        self.units = 0  # units prefilled (or found here) and handed to the writeback for another node
        self.failed = 0  # units whose prefill failed: the serving node computes them itself

    def start(self, msg: PrefillRequest, texts: Mapping[str, tuple[int, ...]]) -> None:
        """Prefill and publish the plan's units, without waiting (``texts``: :func:`check`'s)."""
        received_at = time.monotonic()  # the grants' deadlines count from here
        group = self.prefills.scheduler.new_group()  # the order's units in one forward
        for u in msg.plan.units:
            self.tasks.spawn(self._one(u, texts[u.unit_id], received_at, group), name=f"assist-{u.unit_id[:8]}")

    async def _one(self, plan: UnitPlan, token_ids: tuple[int, ...], received_at: float, group: int) -> None:
        state: UnitState | None = self.cache.lookup(plan.unit_id)
        try:
            if state is None:
                state, _ = await self.prefills.state(plan.unit_id, token_ids, group=group)
        except Exception as exc:  # an assist is best effort: the serving node computes the unit itself
            self.failed += 1
            log.warning("assist: prefill of unit %s failed (%s); its serving node computes it", plan.unit_id, exc)
            if plan.grant is not None:
                await self.retainer.control.give_up(plan.grant)
            return
        self.units += 1
        self.retainer.retain(plan.unit_id, state, False, plan.grant, (), received_at)

    async def drain(self, timeout: float) -> None:
        await self.tasks.drain(timeout=timeout)
