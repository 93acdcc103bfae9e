"""Memory node <-> control plane: a node's hello, the blocks it still holds, the plane's answers.

The control plane also lists the memory nodes it knows (:class:`MemoryNodeList`) to the roles
that read from them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MemoryNodeHello:
    """A memory node announces itself; a new ``boot_id`` means it restarted empty."""

    version: int
    name: str
    boot_id: str
    capacity_blocks: int
    block_bytes: int
    shm_name: str
    data_host: str
    data_port: int
    # the newest leader term the data port has seen, once no request of an older term is still
    # in progress there (0: none yet); lets the plane end its restart fence early (term_settled)
    term_settled: int = 0


@dataclass(frozen=True, slots=True)
class MemoryNodeHelloAck:
    """The plane's answer to a hello: ``ok``/``reason`` as an :class:`Ack`, plus its term.

    ``term_mac`` is an HMAC of the cluster secret over (memory node, boot id, term)
    (:func:`tessera.auth.term_notice`): a node accepts the term only with a valid one, so a
    forged answer cannot raise its term and fence out the real leader. Empty without a secret.
    """

    version: int
    ok: bool
    reason: str = ""
    term: int = 0
    term_mac: str = ""


@dataclass(frozen=True, slots=True)
class InventoryBlock:
    """One verified block a memory node holds, as its header names it (see transport/blocks.py)."""

    slot: int
    unit_key: str  # hex of the 16-byte unit digest
    epoch: int
    block_index: int
    tokens: int
    unit_tokens: int


@dataclass(frozen=True, slots=True)
class MemoryNodeInventory:
    """A memory node that (re)joined a new control plane reports the blocks it still holds.

    Only blocks whose header and payload checksums verify are listed.
    """

    version: int
    name: str
    boot_id: str
    blocks: tuple[InventoryBlock, ...]


@dataclass(frozen=True, slots=True)
class InventoryResult:
    version: int
    adopted: tuple[str, ...]  # unit ids whose entries are READY again
    # > 0: the node's slots are still fenced (writes of an earlier incarnation may land):
    # scan again and resend after this many seconds
    retry_after_s: float = 0.0


@dataclass(frozen=True, slots=True)
class MemoryNodeList:
    version: int
    nodes: tuple[MemoryNodeHello, ...]
