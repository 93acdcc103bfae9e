"""The generation role: ``tessera run --role generation --node NAME``.

HTTP API (JSON, typed messages from :mod:`tessera.messages`):

    GET  /health                        200 once the engine is loaded
    POST /v1/snapshot   SnapshotRequest -> SnapshotResponse   (pins the held units)
    POST /v1/execute    ExecuteRequest  -> NDJSON stream of TokenEvent lines, then one
                                           DoneEvent (or ErrorEvent)
    POST /v1/prefill    PrefillRequest  -> PrefillResponse    (an assist: prefill and publish
                                           units of another node's request, in the background)
    POST /v1/abort      AbortRequest    -> AbortResponse      (stops the run, or drops its pins)
    POST /v1/revoke     RevokeRequest   -> RevokeResponse     (deleted units leave the local cache)
    GET  /metrics                       Prometheus text

Only the retrieval role calls these: every route but ``/health`` needs a request signed with
the cluster secret (:mod:`tessera.auth`), so no client can pin, execute or abort here. The node never
decides admission or eviction itself;
it executes the plan it is given and reports what its local cache really holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web

from tessera.auth import ClusterAuth
from tessera.composition.calibration import Decision, decide
from tessera.composition.choice import Choices
from tessera.composition.policies import policy_from_config
from tessera.config import LOOPBACK_HOSTS, ClusterConfig, GenerationNodeConfig, parse_cpus
from tessera.control.client import NodeControl
from tessera.engines.base import load_engine
from tessera.engines.device import is_cuda
from tessera.errors import BadRequest, Overloaded, TesseraError
from tessera.generation.assists import Assists, check
from tessera.generation.executor import Executor
from tessera.generation.memory import IdleTrim
from tessera.generation.prefills import PrefillCoalescer
from tessera.generation.retention import Retainer
from tessera.generation.scheduler import Scheduler
from tessera.generation.terms import PlanTerms
from tessera.generation.unit_cache import LocalUnitCache
from tessera.http import application, body, reply
from tessera.messages.generation import (
    AbortRequest,
    AbortResponse,
    DoneEvent,
    ErrorEvent,
    ExecuteRequest,
    PrefillRequest,
    PrefillResponse,
    RevokeRequest,
    RevokeResponse,
    SnapshotRequest,
    SnapshotResponse,
)
from tessera.metrics import Metric, Metrics, counter, gauge
from tessera.runtime import BackgroundTasks, serve
from tessera.tenants import KeyRing, admin_middleware
from tessera.wire import WIRE_VERSION, encode

if TYPE_CHECKING:
    from tessera.ha.election import Leader

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
# a term above the elected leader's that went silent for this many leases was no successor
# (tessera.generation.terms): a successor shows in the election before it issues anything, so
# this is far past a watch catching up on a takeover, and still a short outage
TERM_RECOVERY_LEASES = 3


class GenerationNode:
    def __init__(self, config: ClusterConfig, name: str) -> None:
        self.config = config
        self.cfg: GenerationNodeConfig = config.generation_node(name)
        self.name = name
        self.ready = False
        self.inflight: set[str] = set()
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._pin_timers: dict[str, asyncio.TimerHandle] = {}
        # a snapshot's pins (and its admission) are dropped if its execute never arrives: the
        # retrieval role gives up on a node after its first-token deadline anyway
        control = config.control
        self.pin_timeout_s = control.connect_timeout_s + control.first_token_timeout_s
        self.background = BackgroundTasks(f"generation {name}")
        self.trim = IdleTrim()
        # the newest leader term of a plan this node ran, taken only with the leader's seal
        self.terms = PlanTerms(name, ClusterAuth.from_config(config).secret,
                               TERM_RECOVERY_LEASES * config.ha.lease_ttl_s)
        self.metrics = Metrics()
        self.m_requests = self.metrics.counter("tessera_node_requests_total", "Requests executed, by outcome",
                                               ["outcome"])
        self.m_tokens = self.metrics.counter("tessera_node_prompt_tokens_total", "Prompt tokens by source", ["source"])
        self.metrics.read_at_scrape(self._scrape)

    # --- lifecycle -----------------------------------------------------------------------

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        if cores := parse_cpus(self.cfg.cpus):
            # before any worker thread exists: threads inherit the mask of the thread that starts them
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(self.config.model.threads)
        t0 = time.perf_counter()
        self.engine = await asyncio.to_thread(load_engine, self.config, self.cfg.prefix_cache_tokens)
        log.info("%s: engine loaded in %.1fs", self.name, time.perf_counter() - t0)
        self.control = NodeControl(self.config.control_url, self.name, timeout_s=self.config.transport.timeout_s,
                                   auth=ClusterAuth.from_config(self.config))
        self.scheduler = Scheduler(self.engine, self.cfg.max_batch_tokens, self.cfg.max_batch_prompts)
        self.scheduler.start()
        self.prefills = PrefillCoalescer(self.scheduler)
        self.cache = LocalUnitCache(self.cfg.local_capacity_blocks, self.config.block_tokens)
        self.pool = None
        if self.config.kvpools:
            from tessera.generation.pool_client import KVPoolClient
            from tessera.transport.blocks import BlockLayout

            layout = BlockLayout(self.engine.geometry, self.config.block_tokens)
            self.pool = KVPoolClient(self.config, layout, control=self.control, reader=self.name,
                                     pin_memory=is_cuda(self.config.model.device))
        self.retainer = Retainer(
            self.cache, self.pool, self.control,
            staging_bytes=self.config.transport.writeback_staging_bytes,
            outstanding=self.config.transport.writeback_outstanding,
        )
        policy = policy_from_config(self._gate().served).bound(self.engine)  # a policy may read the model
        self.executor = Executor(self.scheduler, self.prefills, self.cache, self.retainer, self.pool,
                                 self.control.release_later, policy, self.config.control.mode, self._choices())
        self.assists = Assists(self.prefills, self.cache, self.retainer)
        self.background.spawn(self._heartbeat(), name="heartbeat")
        if self.config.ha.enabled:  # the control plane is wherever the election says
            from tessera.ha.discovery import follow_leader

            self.background.spawn(follow_leader(self.config.ha, self._leader_changed), name="leader-watch")
        self.ready = True
        try:
            yield
        finally:
            self.ready = False
            await self.assists.drain(timeout=1.0)
            await self.retainer.drain(timeout=10.0)
            await self.background.drain(timeout=1.0)
            await self.scheduler.stop()
            if self.pool is not None:
                await self.pool.close()
            await self.control.close()

    def _leader_changed(self, leader: Leader | None) -> None:
        """The election's leader changed: call it from now on, and know its term (:class:`PlanTerms`)."""
        self.control.point_at(leader)
        self.terms.elected(None if leader is None else leader.term)

    def _gate(self) -> Decision:
        """The fidelity gate for this node's engine (the retrieval role decides alike): what it serves."""
        c = self.config
        decision = decide(c.composition, c.control.mode, self.engine.fingerprint.model, c.model.dtype, c.kv_dtype,
                          c.model.engine)
        if decision.warning:
            log.warning("%s: %s", self.name, decision.warning)
        return decision

    def _choices(self) -> Choices | None:
        """composition.per_request: the settings a request may name, read from the same records
        as the retrieval role's and bound to this node's engine."""
        c = self.config
        if not c.composition.per_request or c.control.mode != "compose":
            return None
        choices, passed = Choices.gate(c.composition, self.engine.fingerprint.model, c.model.dtype, c.kv_dtype,
                                       c.model.engine)
        for why in passed:
            log.info("%s: calibration record passed over: %s", self.name, why)
        return choices.bound(self.engine)

    async def _heartbeat(self) -> None:
        # one beat waits at most this: a beat stuck on a stopped leader must not hold back the
        # first one to its successor by the client's whole timeout
        beat_timeout_s = max(2 * HEARTBEAT_S, self.config.control.heartbeat_timeout_s / 3)
        while True:
            try:
                s = self.scheduler
                ack = await self.control.load(len(self.inflight), s.queued_tokens, s.prefill_tokens_per_s,
                                              s.prompt_batches, timeout_s=beat_timeout_s)
                if ack.reason == "resync":
                    await self.control.resync(self.cache.residency())
            except TesseraError as exc:
                log.debug("%s: heartbeat failed: %s", self.name, exc)
            if not self.inflight and not self.scheduler.queued_tokens:
                self.trim.idle(self.scheduler.steps)  # a spell of work ended: give its freed memory back
            await asyncio.sleep(HEARTBEAT_S)

    # --- handlers ------------------------------------------------------------------------

    def _admit(self, request_id: str) -> None:
        if request_id not in self.inflight and len(self.inflight) >= self.cfg.max_inflight:
            raise web.HTTPTooManyRequests(
                text=f"node {self.name} has {len(self.inflight)} requests in flight (max_inflight = "
                     f"{self.cfg.max_inflight}); retry later", content_type="text/plain")
        self.inflight.add(request_id)

    async def snapshot(self, request: web.Request) -> web.Response:
        msg = await body(request, SnapshotRequest)
        self._admit(msg.request_id)
        held = self.cache.held(msg.request_id, msg.unit_ids)
        loop = asyncio.get_running_loop()
        self._pin_timers[msg.request_id] = loop.call_later(self.pin_timeout_s, self._expire_pins, msg.request_id)
        return reply(SnapshotResponse(WIRE_VERSION, msg.request_id, self.name, tuple(held), len(self.inflight)))

    def _expire_pins(self, request_id: str) -> None:
        self._pin_timers.pop(request_id, None)
        if request_id not in self._tasks:
            self.cache.unpin_request(request_id)
            self.inflight.discard(request_id)

    async def execute(self, request: web.Request) -> web.StreamResponse:
        msg = await body(request, ExecuteRequest)
        if msg.plan.node != self.name:
            raise BadRequest(f"plan is for node {msg.plan.node!r}, this is {self.name!r}")
        # an unsealed plan, or a deposed leader's (its grants and leases may be reused already)
        self.terms.admit(msg.plan)
        self._admit(msg.request_id)
        timer = self._pin_timers.pop(msg.request_id, None)
        if timer is not None:
            timer.cancel()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        current = asyncio.current_task()
        assert current is not None
        self._tasks[msg.request_id] = current
        outcome = "error"
        try:
            async with contextlib.aclosing(self.executor.run(msg)) as run:
                async for event in run:
                    if isinstance(event, DoneEvent):
                        self._count(event)
                        outcome = "ok"
                    await resp.write(encode(event) + b"\n")
        except asyncio.CancelledError:
            outcome = "aborted"
            raise
        except ConnectionError:
            # the caller went away (client disconnect, deadline, stop string): not a failure
            outcome = "cancelled"
            log.info("%s: request %s: the caller closed the stream", self.name, msg.request_id)
            return resp
        except Overloaded as exc:
            # refused before its work began (late start, or no KV pages): nothing reached the
            # caller, which answers 429 or tries another node; this node is not failing
            outcome = "refused"
            log.info("%s: request %s refused: %s", self.name, msg.request_id, exc)
            with contextlib.suppress(ConnectionError, RuntimeError):
                await resp.write(encode(ErrorEvent(WIRE_VERSION, str(exc), refused=True)) + b"\n")
        except Exception as exc:
            log.exception("%s: request %s failed", self.name, msg.request_id)
            with contextlib.suppress(ConnectionError, RuntimeError):
                await resp.write(encode(ErrorEvent(WIRE_VERSION, f"{type(exc).__name__}: {exc}")) + b"\n")
        finally:
            self.m_requests.labels(outcome=outcome).inc()
            self._tasks.pop(msg.request_id, None)
            self.inflight.discard(msg.request_id)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp

    async def prefill(self, request: web.Request) -> web.Response:
        """An assist (:mod:`tessera.generation.assists`): accepted at once, run in the background."""
        msg = await body(request, PrefillRequest)
        texts = check(msg, self.name)
        self.terms.admit(msg.plan)  # sealed by the leader for this node, of a current term
        self.assists.start(msg, texts)
        return reply(PrefillResponse(WIRE_VERSION, msg.plan.request_id, len(texts)))

    def _count(self, event: DoneEvent) -> None:
        for source, n in event.stats.tokens_by_source():
            self.m_tokens.labels(source=source).inc(n)

    async def abort(self, request: web.Request) -> web.Response:
        msg = await body(request, AbortRequest)
        task = self._tasks.get(msg.request_id)
        if task is not None:
            task.cancel()
        else:
            self._expire_pins(msg.request_id)
        return reply(AbortResponse(WIRE_VERSION, msg.request_id, aborted=task is not None))

    async def revoke(self, request: web.Request) -> web.Response:
        msg = await body(request, RevokeRequest)
        return reply(RevokeResponse(WIRE_VERSION, self.cache.revoke(msg.unit_ids)))

    async def cache_units(self, request: web.Request) -> web.Response:
        """The units in the local cache (what the control plane's local view of this node should say)."""
        return web.json_response({"node": self.name, "units": sorted(self.cache.unit_ids())})

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.json_response({"node": self.name, "ready": False}, status=503)
        return web.json_response({"node": self.name, "ready": True, "inflight": len(self.inflight),
                                  "fingerprint": self.engine.fingerprint.digest.hex()})

    def _scrape(self) -> list[Metric]:
        """Figures the components own, read at scrape time (none before the engine is loaded)."""
        if not self.ready:
            return []
        return [
            gauge("tessera_node_inflight", "Requests admitted and not finished", len(self.inflight)),
            gauge("tessera_node_queued_tokens", "Tokens waiting for the engine", self.scheduler.queued_tokens),
            counter("tessera_node_waiting_room_waits_total", "Requests with units to compute that waited for "
                    "their turn before deciding how to get them", self.scheduler.room.waited),
            gauge("tessera_node_local_cache_blocks", "Blocks used in the local unit cache", self.cache.used_blocks),
            gauge("tessera_node_local_cache_bytes", "Host memory held by the local unit cache's states",
                  self.cache.used_bytes),
            counter("tessera_node_coalesced_prefills_total", "Misses that joined an in-flight prefill of the same unit",
                    self.prefills.coalesced),
            counter("tessera_node_unit_prefills_total", "Unit prefills run (internal requests)", self.prefills.started),
            counter("tessera_node_assisted_units_total", "Units prefilled here for requests other nodes serve, "
                    "by outcome", {"handed_to_writeback": self.assists.units, "failed": self.assists.failed},
                    label="outcome"),
            counter("tessera_node_writebacks_published_total", "Shared writebacks published", self.retainer.published),
            counter("tessera_node_writeback_failures_total", "Shared writebacks that failed (reservation cancelled)",
                    self.retainer.write_failures),
            counter("tessera_node_writebacks_skipped_total", "Shared write grants not used, by reason",
                    {"over_budget": self.retainer.over_budget, "not_needed": self.retainer.not_needed},
                    label="reason"),
            counter("tessera_node_plans_refused_total", "Plans refused before running, by reason",
                    {"unsealed": self.terms.unsealed, "stale_term": self.terms.stale}, label="reason"),
            counter("tessera_node_terms_recovered_total", "Times the elected leader's term replaced a newer, "
                    "silent one", self.terms.recovered),
            counter("tessera_node_write_grants_renewed_total", "Write grants renewed or reissued before writing",
                    0 if self.pool is None else self.pool.renewed),
            # a copy: the engine thread adds to the dict while this reads it
            counter("tessera_node_engine_cpu_seconds_total", "Engine-thread CPU seconds by engine call",
                    dict(self.scheduler.worker.cpu_s), label="call"),
            counter("tessera_node_engine_wall_seconds_total", "Engine-thread wall seconds by engine call",
                    dict(self.scheduler.worker.wall_s), label="call"),
        ]

    async def metrics_text(self, request: web.Request) -> web.Response:
        return self.metrics.response()


GENERATION_NODE = web.AppKey("generation_node", GenerationNode)


def build_app(config: ClusterConfig, name: str) -> web.Application:
    node = GenerationNode(config, name)
    cfg = config.generation_node(name)
    # the whole API is internal: only the retrieval role (holding the cluster secret) calls it;
    # /metrics takes a Prometheus scraper's admin API key instead, or is open on a loopback-only
    # node without keys (a scraper cannot sign)
    keys = KeyRing.load(config.security.keys_file) if config.security.keys_file else None
    scrapable = keys is not None or cfg.host in LOOPBACK_HOSTS
    open_paths = ("/health", "/metrics") if scrapable else ("/health",)
    app = application([ClusterAuth.from_config(config).middleware(
        cfg.host, cfg.port, open_paths=open_paths, body_timeout_s=config.listener.body_timeout_s),
        admin_middleware(keys)])
    app[GENERATION_NODE] = node
    app.cleanup_ctx.append(node.lifecycle)
    app.router.add_get("/health", node.health)
    app.router.add_post("/v1/snapshot", node.snapshot)
    app.router.add_post("/v1/execute", node.execute)
    app.router.add_post("/v1/prefill", node.prefill)
    app.router.add_post("/v1/abort", node.abort)
    app.router.add_post("/v1/revoke", node.revoke)
    app.router.add_get("/metrics", node.metrics_text)
    app.router.add_get("/v1/cache", node.cache_units)  # for checkers (tessera/hosts)
    return app


def run_generation(config: ClusterConfig, name: str | None) -> int:
    from tessera.runtime import run

    if name is None:
        if len(config.generation) != 1:
            raise BadRequest(f"--node is required: the config has generation nodes "
                             f"{', '.join(n.name for n in config.generation)}")
        name = config.generation[0].name
    cfg = config.generation_node(name)
    app = build_app(config, name)
    ssl_context = ClusterAuth.from_config(config).server_ssl()
    return run(lambda: serve(app, cfg.host, cfg.port, name=f"generation {name}", limits=config.listener,
                             drain_s=30.0, ssl_context=ssl_context))
