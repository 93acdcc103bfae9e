"""What an API client is told when its chat request fails: a status, a message, a Retry-After.

A message written for the client is passed on as it is: bad input (4xx), a node or the cluster
at its limit (429), nothing alive to serve it (503), a node alive but too slow (503). A failure
inside the cluster is told in general terms only: a generation node that could not be reached
or failed, the leader's control plane out of reach, an internal call refused. Their own
messages name internal URLs and the exception that ended the call, which a client can neither
act on nor should see; the server logs them instead.

This module knows nothing about HTTP: the handler and the event stream turn a
:class:`Refusal` into their reply.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tessera.errors import BadRequest, NotLeader, Overloaded, TesseraError, Unavailable
from tessera.retrieval.chat.generation_client import NodeSlow

log = logging.getLogger(__name__)
FAILOVER = ("no retrieval replica leads the control plane right now (a failover is under way); "
            "retry after Retry-After seconds")
INSIDE = "the cluster failed to serve this request (a generation node failed or could not be reached); retry shortly"


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    retry_after_s: float | None = None  # sent as Retry-After when set


def refusal(exc: TesseraError, retry_after_s: float | None = None) -> Refusal:
    """The client's side of ``exc``; ``retry_after_s``: the Retry-After of a 503 that names none."""
    if isinstance(exc, BadRequest):
        return Refusal(exc.status, str(exc))
    if isinstance(exc, Overloaded):
        return Refusal(429, str(exc), exc.retry_after_s)
    if isinstance(exc, NotLeader):
        log.info("chat refused during a failover: %s", exc)
        return Refusal(503, FAILOVER, exc.retry_after_s or retry_after_s)
    if isinstance(exc, Unavailable):
        return Refusal(503, str(exc), exc.retry_after_s or retry_after_s)
    if isinstance(exc, NodeSlow):
        return Refusal(503, str(exc))
    log.warning("chat failed inside the cluster: %s", exc)
    return Refusal(503, INSIDE, retry_after_s)
