"""Per-process state of the retrieval role: the control plane and the unit store.

One :class:`RetrievalNode` lives on the aiohttp app (``app[RETRIEVAL_NODE]``); the HTTP
handlers and the in-process chat layer both go through it. The control plane runs on
the event loop (its calls are microseconds); tokenizing, embedding and index searches run
on one worker thread so that control RPCs never wait behind a model forward.

Lifecycle: ``start()`` loads the served model's tokenizer, the embedder and the unit store
(its data directory), hands the store's revoked ids and incarnation to the control plane
(with ``[ha]``: campaigns, and does so only once elected: :class:`~tessera.retrieval.leadership.office.Office`),
follows the PostgreSQL store's change sequence into its index, and starts the periodic tick
(lease/reservation expiry, heartbeats, index saves); ``stop()`` reverses it (saving the changed indexes).

Deletes and updates go store first (committed), then the plane (no new plan uses the unit),
then the generation nodes (they drop their copies); only then does the caller get its reply.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tessera.config import ClusterConfig
from tessera.control.plane import ControlPlane
from tessera.messages.kvpool import InventoryResult, MemoryNodeInventory
from tessera.retrieval.embedder import Embedder
from tessera.retrieval.follow import IndexFollower
from tessera.retrieval.leadership.office import Office
from tessera.retrieval.limits import INGEST_CHUNK_UNITS
from tessera.retrieval.revocation import Revoker
from tessera.retrieval.store.postgres import PgUnitRecords
from tessera.retrieval.store.unit_store import Deleted, Hit, Ingested, Owner, StoredUnit, UnitStore
from tessera.runtime import BackgroundTasks
from tessera.units import ContextUnit, ServingFingerprint

log = logging.getLogger(__name__)
T = TypeVar("T")
FOLLOW_S = 0.25  # how often a replica reads the PostgreSQL store's change sequence


class RetrievalNode:
    """Control plane + retrieval pool of one retrieval process."""

    def __init__(self, config: ClusterConfig, plane: ControlPlane | None = None) -> None:
        self.config = config
        self.office = Office(config, plane or ControlPlane(config))
        self.follower: IndexFollower | None = None  # the PostgreSQL store's change sequence, followed
        self.pool: UnitStore | None = None
        self.fingerprint: ServingFingerprint | None = None
        self.tokenizer: Any = None  # tessera.engines.tokenizer.Tokenizer once started
        self.tasks = BackgroundTasks("retrieval")
        self._executor: ThreadPoolExecutor | None = None
        self._tick_s = min(1.0, config.control.heartbeat_timeout_s / 4)
        self.revoker = Revoker(config)

    @property
    def ready(self) -> bool:
        return self.pool is not None

    @property
    def plane(self) -> ControlPlane:
        """The current plane (with ``[ha]``: this term's; a follower's is idle, see :class:`Office`)."""
        return self.office.plane

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieval")
        self.pool = await self._run(self._load)
        if isinstance(self.pool.records, PgUnitRecords):
            self.follower = IndexFollower(self.pool, self.pool.change_cursor)
            self.tasks.spawn(self._follow(), name="index-follower")
        if self.config.ha.enabled:
            self.office.start(self._take_office)
        else:
            self.plane.revoked.update(await self._run(self.pool.revoked))
            self.plane.begin_incarnation(self.pool.incarnation)
        self.tasks.spawn(self._ticker(), name="control-tick")
        self.tasks.spawn(self._index_saver(), name="index-saver")

    async def _take_office(self, term: int) -> ControlPlane | None:
        """A plane for ``term``, rebuilt as after a restart; None if the store knows a newer term."""
        pool = self._pool()
        assert isinstance(pool.records, PgUnitRecords), "[ha] needs retrieval.store = 'postgres'"
        if not await self._run(pool.records.record_term, term):
            log.error("refusing to lead under term %d: the store recorded a newer term (%d); was etcd reset?",
                      term, await self._run(pool.records.term))
            return None
        plane = ControlPlane(self.config)
        plane.revoked.update(await self._run(pool.revoked))
        plane.begin_incarnation(term)  # every epoch and plan of this term carries it
        return plane

    async def _follow(self) -> None:
        """Keep this replica's index up to date with what the other replicas wrote."""
        assert self.follower is not None
        while True:
            await asyncio.sleep(FOLLOW_S)
            try:
                await self._run(self.follower.step)
            except Exception as exc:  # the database restarts or is unreachable: keep trying
                log.warning("following the unit store's changes failed (retrying): %s", exc)
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        await self.office.stop()
        await self.tasks.drain(timeout=0.0)  # the ticker has nothing to finish
        await self.revoker.close()
        if self.pool is not None:
            await self._run(self.pool.close)
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def _load(self) -> UnitStore:
        from tessera.engines.checkpoint import resolve
        from tessera.engines.tokenizer import load_tokenizer, serving_fingerprint, unit_factory

        checkpoint = resolve(self.config.model)
        self.tokenizer = load_tokenizer(checkpoint)
        self.fingerprint = serving_fingerprint(self.config, checkpoint, self.tokenizer)
        factory = unit_factory(self.config, self.fingerprint, self.tokenizer)
        embedder = Embedder(threads=self.config.retrieval.embed_threads)
        log.info("retrieval ready: model %s, embedder dim %d", self.fingerprint.model, embedder.dim)
        return UnitStore(factory, embedder, self.config.retrieval)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            self.plane.tick()

    async def _index_saver(self) -> None:
        while True:
            await asyncio.sleep(self.config.retrieval.index_save_s)
            await self._run(self._pool().save_indexes)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        assert self._executor is not None, "retrieval node is not started"
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    @property
    def embedding_dim(self) -> int:
        """Dimension of the embedder's vectors (a query or unit embedding must have it)."""
        return self._pool().embedder.dim

    def _pool(self) -> UnitStore:
        assert self.pool is not None, "retrieval node is not started"
        return self.pool

    # --- retrieval (worker thread) -------------------------------------------------------

    async def ingest(self, items: Sequence[tuple[str, str, Mapping[str, Any]]],
                     embeddings: Sequence[Sequence[float] | None] | None = None,
                     external_ids: Sequence[str | None] | None = None, tenant: str = "") -> Ingested:
        """Ingest (committed), then revoke the units that updated external ids replaced.

        Without external ids, in bounded chunks, one worker job (and transaction) each: a big
        ingest never holds the worker (and so every chat request's retrieval and tokenizing)
        for longer than one chunk; re-sending a batch cut by a failure is idempotent. A batch
        that updates external ids stays one transaction: its replacements are checked as a whole.
        """
        step = len(items) if external_ids is not None else INGEST_CHUNK_UNITS
        units: list[tuple[ContextUnit, bool]] = []
        revoked: list[str] = []
        for at in range(0, len(items), max(step, 1)):
            chunk = None if embeddings is None else embeddings[at:at + step]
            part = await self._run(self._pool().ingest, items[at:at + step], chunk, external_ids, tenant)
            units += part.units
            revoked += part.revoked
        done = Ingested(units, tuple(revoked))
        await self.office.units_changed([], [u.unit_id for u, _ in done.units])
        await self._revoke(done.revoked)
        return done

    async def in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking work (tokenizing a prompt) on the worker thread, off the event loop."""
        return await self._run(fn, *args)

    async def get(self, unit_id: str) -> StoredUnit | None:
        return await self._run(self._pool().get, unit_id)

    async def adopt(self, msg: MemoryNodeInventory) -> InventoryResult:
        """A memory node's inventory after this role restarted: entries of units that still exist."""
        plane = self.office.held()
        if plane.directory.fenced_for(msg.name) > 0:
            return plane.adopt(msg, {})  # answers "retry later" without reading the store
        units = await self._run(self._pool().by_digest, sorted({b.unit_key for b in msg.blocks}))
        return self.office.held().adopt(msg, units)  # held again: the term may have ended meanwhile

    async def delete(self, unit_ids: Sequence[str], owns: Owner | None = None) -> Deleted:
        done = await self._run(self._pool().delete, unit_ids, owns)
        await self._revoke(done.deleted)
        return done

    async def delete_where(self, scope: str, where: Mapping[str, Any] | None, tenant: str = "") -> Deleted:
        done = await self._run(self._pool().delete_where, scope, where, tenant)
        await self._revoke(done.deleted)
        return done

    async def _revoke(self, unit_ids: Sequence[str]) -> None:
        if unit_ids:
            await self.office.units_changed(list(unit_ids), [])
            await self.revoker.broadcast(unit_ids)

    async def retrieve(self, scope: str, *, query: str | None = None, embedding: Sequence[float] | None = None,
                       top_k: int | None = None, tenant: str = "") -> list[Hit]:
        return await self._run(self._pool().retrieve, scope, query=query, embedding=embedding, top_k=top_k,
                               tenant=tenant)

    async def identify(self, scope: str, texts: Sequence[str], tenant: str = "") -> list[ContextUnit]:
        """Units a request brings itself (retrieval skipped): same identity, not indexed."""
        pool = self._pool()
        return await self._run(lambda: [pool.identify(scope, t, f"units[{i}]", tenant) for i, t in enumerate(texts)])

    def store_stats(self) -> dict[str, Any]:
        """The unit store's figures, added to ``/control/stats``."""
        return {"units_indexed": 0 if self.pool is None else len(self.pool),
                "units_revoked": len(self.plane.revoked), "revocations_missed": self.revoker.missed}

    def stats(self) -> dict[str, object]:
        return {**self.plane.report(), **self.store_stats()}
