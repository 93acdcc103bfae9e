"""Pieces every role's messages share: the protocol version check, block references, the plain answer.

Every top-level message (one frozen dataclass, encoded with :mod:`tessera.wire`) carries
``version`` so that a node speaking another protocol version is refused with a clear error
instead of being misread. Time values on the wire are *durations* (seconds from receipt), never
absolute clock readings: roles do not share a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import BadRequest
from tessera.wire import WIRE_VERSION


def check_version(version: int) -> None:
    if version != WIRE_VERSION:
        raise BadRequest(f"protocol version {version} is not supported; this node speaks version {WIRE_VERSION}")


@dataclass(frozen=True, slots=True)
class BlockRef:
    """One storage block: a slot index in a memory node's arena."""

    node: str
    index: int


@dataclass(frozen=True, slots=True)
class Ack:
    version: int
    ok: bool
    reason: str = ""
