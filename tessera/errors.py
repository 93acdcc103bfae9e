"""Named exceptions, by kind.

Broken internal invariants are ``assert`` statements with the offending values; integrity
failures (bad epoch, checksum mismatch, missing blocks) and bad configuration are the named
exceptions below; bad client input becomes an HTTP 4xx in the services.
"""

from __future__ import annotations


class TesseraError(Exception):
    """Base class of every error Tessera raises on purpose."""


class ConfigError(TesseraError):
    """The configuration names a bad key or value; the message says which and what is allowed."""


class BadRequest(TesseraError):
    """Client input that cannot be served (HTTP 4xx); the message says what to fix.

    Raised for client input only; internal peers that send a malformed message get a
    :class:`DecodeError`, which the edges map to 400 as well.
    """

    status = 400

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class DecodeError(BadRequest):
    """A message body does not decode into its typed message; names the field (HTTP 400)."""


class Overloaded(TesseraError):
    """A node refuses new work rather than queueing without bound (HTTP 429; retry later)."""

    status = 429

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # sent as Retry-After when known


class Unavailable(TesseraError):
    """Nothing can serve the request right now: still loading, or no node alive (HTTP 503)."""

    status = 503

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # sent as Retry-After when known


class NotLeader(Unavailable):
    """This retrieval replica does not hold the control plane now (``[ha]``): no leader is known,
    the leader cannot be reached, or this replica's term ended (HTTP 503 with Retry-After)."""


class IntegrityError(TesseraError):
    """Stored or transferred state failed a consistency check (epoch, writer, blocks, checksum)."""


class PublishRejected(IntegrityError):
    """A publish request was refused: wrong writer, stale epoch, incomplete block set."""


class TransferError(TesseraError):
    """A KV block transfer failed; the caller falls back to computing the unit."""


class TransferTimeout(TransferError):
    """A KV block transfer did not finish within its timeout."""


class ChecksumMismatch(TransferError, IntegrityError):
    """A block's header or payload checksum did not match what the reader expected."""


class PlacementError(TesseraError):
    """A unit state could not be copied to or placed on the engine's device; the caller computes it instead."""


class ControlPlaneError(TesseraError):
    """The control plane could not be reached, or answered with an error other than a rejection."""


class ModelLoadError(TesseraError):
    """A model checkpoint could not be loaded; the message says why and what is supported."""
