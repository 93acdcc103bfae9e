"""A replica's life in the election: campaign, hold office while the lease lives, campaign again.

:func:`hold_office` runs until cancelled. Each time this candidate is elected it asks
``take_office(leadership)`` (the caller builds its state for the term; False refuses it: the
candidate resigns and campaigns again later), then waits until the leadership is lost (the
lease could not be renewed in time, or etcd said it expired), calls ``left()`` and resigns. A
failed campaign (etcd unreachable, the lease lost while waiting) is retried after
``ha.lease_ttl_s / 5`` (after an expired etcd auth token, with a client that authenticates again).

This module knows nothing about the control plane.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aetcd.exceptions

from tessera.config import HAConfig
from tessera.ha.discovery import election_of
from tessera.ha.election import Leadership, LeadershipLost
from tessera.ha.etcd_client import expired_token

log = logging.getLogger(__name__)


async def hold_office(ha: HAConfig, value: bytes, take_office: Callable[[Leadership], Awaitable[bool]],
                      left: Callable[[], None]) -> None:
    election = election_of(ha)
    retry_s = max(0.2, ha.lease_ttl_s / 5)
    try:
        while True:
            try:
                leadership = await election.campaign(value)
            except (LeadershipLost, aetcd.exceptions.ClientError, OSError) as exc:
                log.warning("campaign for %s failed (%s); again in %.1fs", ha.election, exc, retry_s)
                if expired_token(exc):
                    await election.client.close()
                await asyncio.sleep(retry_s)
                continue
            try:
                if not await take_office(leadership) or not leadership.valid:
                    await asyncio.sleep(retry_s)
                    continue
                log.info("took office under term %d", leadership.term)
                await leadership.lost.wait()
                log.warning("term %d ended: stopped issuing; campaigning again", leadership.term)
                left()
            finally:
                await leadership.resign()
    finally:
        await election.client.close()
