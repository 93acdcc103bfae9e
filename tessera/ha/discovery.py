"""Find the leader without reconfiguration: watch the election key, tell the caller every change.

Every role that talks to the control plane (generation nodes, memory nodes, follower
replicas) runs :func:`follow_leader` with the cluster's ``[ha]`` section. The leader's
election value is the URL of its internal plane (``/control/*``); ``on_change`` gets that URL
each time another replica takes office, and ``None`` while no key is left (the old leader's
lease ran out and nobody has campaigned yet). A watch that breaks (etcd restarted, a network
fault) is opened again after ``ha.lease_ttl_s / 5``; meanwhile the last leader stays in use.

This module knows nothing about control clients or the plane; the caller decides what a
leader change means.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aetcd.exceptions

from tessera.config import HAConfig
from tessera.ha.election import Election, Leader
from tessera.ha.etcd_client import connect, expired_token

log = logging.getLogger(__name__)


def election_of(ha: HAConfig) -> Election:
    """The cluster's election (one client per call: a role holds one for its life)."""
    return Election(connect(ha), ha.election, ttl_s=ha.lease_ttl_s, margin_s=ha.renew_margin_s)


async def follow_leader(ha: HAConfig, on_change: Callable[[Leader | None], None]) -> None:
    """Until cancelled: ``on_change(leader)`` now and at every change of the election's leader."""
    election = election_of(ha)
    retry_s = max(0.2, ha.lease_ttl_s / 5)
    try:
        while True:
            try:
                async for leader in election.observe():
                    on_change(leader)
            except (aetcd.exceptions.ClientError, OSError) as exc:
                log.warning("watching the election %s on %s failed (%s); watching again in %.1fs",
                            ha.election, ha.etcd, exc, retry_s)
                if expired_token(exc):
                    await election.client.close()
            await asyncio.sleep(retry_s)
    finally:
        await election.client.close()
