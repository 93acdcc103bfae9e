"""Invariants over a recorded history of a multi-host chaos run (in the spirit of Jepsen's checkers).

The run (tessera_lab/hosts/chaos.py) records; this module only judges. Its inputs:

* the replies (each one already checked against the offline composition by
  :class:`~tessera_lab.chaos.harness.ChaosRun`);
* :class:`Sample` s taken about once a second while faults run: the control plane's state
  (``GET /control/state``) before and after every memory node's verified blocks
  (``GET /inventory``) and every generation node's cache (``GET /v1/cache``);
* the units the API acknowledged at ingest, and which of them it still serves at the end.

Each check returns the violations it found, as sentences with the numbers; none = holds.
Nothing here talks to a cluster.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

State = dict[str, Any]  # GET /control/state (tessera/control/observe.py)
Inventory = dict[str, Any]  # GET /inventory of a memory node


@dataclass
class Sample:
    at: float  # run time, s
    before: State
    inventories: dict[str, Inventory]  # memory node -> its inventory (missing: unreachable)
    after: State
    caches: dict[str, list[str]] = field(default_factory=dict)  # generation node -> units (missing: unreachable)


def _ready(state: State) -> dict[tuple[str, int], tuple[tuple[str, int], ...]]:
    return {(e["unit"], e["epoch"]): tuple((b[0], b[1]) for b in e["blocks"]) for e in state["entries"] if e["ready"]}


def _blocks_by_slot(inventory: Inventory) -> dict[int, Mapping[str, Any]]:
    return {b["slot"]: b for b in inventory["blocks"]}


def unfinished_ready(sample: Sample, exempt: Iterable[tuple[str, int]] = ()) -> list[str]:
    """No READY entry references a block its writer did not finish.

    Only entries READY with the same epoch and blocks both before and after the inventories
    were read count (an entry evicted in between may have had its slots reused). A block
    passes when the memory node's scan verified it (header and payload checksums) under the
    entry's epoch at the entry's block index. ``exempt``: (node, slot) a fault corrupted.
    """
    skip = set(exempt)
    before, after = _ready(sample.before), _ready(sample.after)
    slots = {node: _blocks_by_slot(inv) for node, inv in sample.inventories.items()}
    out = []
    for key, blocks in before.items():
        if after.get(key) != blocks:
            continue
        unit, epoch = key
        for index, (node, slot) in enumerate(blocks):
            if node not in slots or (node, slot) in skip:
                continue
            found = slots[node].get(slot)
            if found is None or found["epoch"] != epoch or found["block_index"] != index:
                seen = "no verified block" if found is None else f"epoch {found['epoch']} block {found['block_index']}"
                out.append(f"t={sample.at:.1f}s: READY {unit[:12]} epoch {epoch} block {index} at {node}:{slot} "
                           f"holds {seen}")
    return out


def overdue(state: State, grace_s: float, at: float) -> list[str]:
    """No read lease outlives its expiry, and no write reservation its deadline, by more than ``grace_s``."""
    now = state["now"]
    out = []
    for e in state["entries"]:
        for lease_id, expires_at in e["leases"]:
            if now > expires_at + grace_s:
                out.append(f"t={at:.1f}s: lease {lease_id} on {e['unit'][:12]} is {now - expires_at:.1f}s past expiry")
        if not e["ready"] and now > e["deadline"] + grace_s:
            out.append(f"t={at:.1f}s: reservation of {e['unit'][:12]} epoch {e['epoch']} (writer {e['writer']}) "
                       f"is {now - e['deadline']:.1f}s past its deadline")
    return out


def lost_units(acknowledged: Sequence[str], served: Iterable[str]) -> list[str]:
    """Every unit the API acknowledged at ingest is still served at the end."""
    have = set(served)
    return [f"unit {u[:12]} was acknowledged at ingest and is gone" for u in acknowledged if u not in have]


def differences(state: State, inventories: Mapping[str, Inventory], caches: Mapping[str, list[str]],
                memory_nodes: Sequence[str], generation_nodes: Sequence[str]) -> list[str]:
    """Why the cluster has not converged (empty: it has).

    Converged: no reservation or lease is outstanding; every READY entry's blocks verify on
    their memory node (the directory agrees with the inventories wherever it places a unit);
    no slot belongs to two entries; and each generation node's local view in the control
    plane holds exactly the units of its cache.
    """
    out = []
    missing = [n for n in memory_nodes if n not in inventories] + [n for n in generation_nodes if n not in caches]
    if missing:
        out.append("unreachable: " + ", ".join(missing))
    pending = [e for e in state["entries"] if not e["ready"]]
    if pending:
        out.append(f"{len(pending)} reservations outstanding")
    leases = sum(len(e["leases"]) for e in state["entries"])
    if leases:
        out.append(f"{leases} read leases outstanding")
    owner: dict[tuple[str, int], str] = {}
    slots = {node: _blocks_by_slot(inv) for node, inv in inventories.items()}
    for (unit, epoch), blocks in _ready(state).items():
        for index, (node, slot) in enumerate(blocks):
            if (node, slot) in owner:
                out.append(f"slot {node}:{slot} belongs to {owner[node, slot][:12]} and {unit[:12]}")
            owner[node, slot] = unit
            found = slots.get(node, {}).get(slot)
            if node in slots and (found is None or found["epoch"] != epoch or found["block_index"] != index):
                out.append(f"directory places {unit[:12]} epoch {epoch} block {index} at {node}:{slot}, "
                           "the memory node does not hold it")
    for name in generation_nodes:
        view = set(state["nodes"].get(name, {}).get("local", ()))
        if name in caches and view != set(caches[name]):
            extra, gone = sorted(view - set(caches[name])), sorted(set(caches[name]) - view)
            out.append(f"local view of {name} differs from its cache: {len(extra)} only in the view, "
                       f"{len(gone)} only in the cache")
    return out


@dataclass(frozen=True)
class Served:
    """One 200 reply: when it was sent and answered, and which generation node served it."""

    sent_at: float
    done_at: float
    node: str


def flaps(served: Iterable[Served], samples: Sequence[Sample]) -> list[str]:
    """No request is served by a node the control plane held dead for the whole of its life.

    A reply whose send and answer both fall between two consecutive samples that saw its
    node dead was routed to a node the plane considered dead.
    """
    seen = [(s.at, {n: v["alive"] for n, v in s.before["nodes"].items()}) for s in samples]
    out = []
    for reply in served:
        for (t0, alive0), (t1, alive1) in itertools.pairwise(seen):
            if t0 <= reply.sent_at and reply.done_at <= t1 and alive0.get(reply.node) is False \
                    and alive1.get(reply.node) is False:
                out.append(f"a request sent at t={reply.sent_at:.1f}s was served by {reply.node}, "
                           f"which the control plane held dead from t={t0:.1f}s to t={t1:.1f}s")
                break
    return out


@dataclass
class Verdict:
    """Violations by invariant (an invariant with an empty list held)."""

    violations: dict[str, list[str]] = field(default_factory=dict)
    converged_after_s: float | None = None  # after the last heal; None: not within the bound

    def add(self, invariant: str, found: list[str]) -> None:
        self.violations.setdefault(invariant, []).extend(found)

    @property
    def ok(self) -> bool:
        return self.converged_after_s is not None and not any(self.violations.values())

    def render(self) -> str:
        lines = []
        for name, found in self.violations.items():
            lines.append(f"  {name}: {'holds' if not found else f'{len(found)} violations'}")
            lines += [f"    - {v}" for v in found[:10]]
        conv = "NOT within the bound" if self.converged_after_s is None else f"{self.converged_after_s:.1f}s"
        lines.append(f"  converged after the last heal: {conv}")
        return "\n".join(lines)
