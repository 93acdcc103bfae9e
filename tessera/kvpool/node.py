"""Memory node of the KV Pool (``tessera run --role kvpool --node NAME``).

A memory node owns one block arena in POSIX shared memory and serves it:

* same-host clients map the arena themselves (``shm`` transport, one-sided);
* the ``tcp`` block server on ``data_port`` serves reads and writes of whole slots;
* with ``[transport] name = "mooncake"`` the arena is also registered with a Mooncake
  Transfer Engine whose session is published in ``GET /info``;
* ``GET /health`` and ``GET /info`` (a :class:`NodeEndpoint`) on the control port, and
  ``GET /metrics`` (Prometheus text) for a scraper holding an admin API key, as on the
  other roles;
* it says hello to the control plane at start and then as a heartbeat. Every start has a
  new random ``boot_id``: a restarted node is empty, and the directory drops what it held.
* when a control plane answers "joined" (it restarted, or had declared this node dead), the
  node scans its arena and reports the verified blocks it holds (kvpool/inventory.py), so
  the plane can make them READY entries again instead of recomputing them.

Memory nodes hold payloads only: which slot belongs to which unit and epoch is known to the
control plane alone. The arena is sized from the model geometry (read from the checkpoint's
config.json; the weights are never loaded here) and committed up front, so the node refuses
to start rather than fail later when /dev/shm runs out.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from aiohttp import web

from tessera.auth import ClusterAuth, term_notice
from tessera.config import LOOPBACK_HOSTS, ClusterConfig, KVPoolNodeConfig
from tessera.control.client import ControlClient
from tessera.engines.checkpoint import resolve
from tessera.engines.geometry import geometry_from_checkpoint
from tessera.errors import ControlPlaneError, TesseraError
from tessera.http import application
from tessera.kvpool.inventory import scan
from tessera.messages.kvpool import MemoryNodeHello, MemoryNodeHelloAck, MemoryNodeInventory
from tessera.metrics import Metric, Metrics, counter, gauge
from tessera.ports import bind_listener
from tessera.runtime import BackgroundTasks, serve
from tessera.tenants import KeyRing, admin_middleware
from tessera.transport.arena import Arena, segment_name
from tessera.transport.base import ArenaExport, NodeEndpoint, transport_class
from tessera.transport.blocks import BlockLayout
from tessera.transport.tcp_server import BlockServer
from tessera.wire import WIRE_VERSION, to_wire

log = logging.getLogger("tessera.kvpool")
INVENTORY_CHUNK = 2048  # blocks per inventory message (~250 KB of JSON)


class MemoryNode:
    """Arena + data server (+ engine export) + heartbeats.

    The arena is created (and sized) with the node, so a node that cannot commit its memory
    refuses to start before it listens; everything else starts and stops in the app's
    ``cleanup_ctx`` (:meth:`lifecycle`), like the other roles.
    """

    def __init__(self, config: ClusterConfig, node: KVPoolNodeConfig, layout: BlockLayout) -> None:
        self.config = config
        self.node = node
        self.layout = layout
        self.boot_id = uuid.uuid4().hex
        self.arena = Arena.create(segment_name(node.name, self.boot_id), layout.slot_bytes,
                                  node.capacity_blocks, self.boot_id)
        self.auth = ClusterAuth.from_config(config)
        # the data port speaks TLS with the HTTP listeners' certificate when the cluster has one
        self.server = BlockServer(self.arena, self.boot_id, self.auth.secret, node.name, self.auth.server_ssl(),
                                  limits=config.transport)
        self.export: ArenaExport | None = None
        self.control = ControlClient(config.control_url, timeout_s=config.transport.timeout_s, auth=self.auth)
        self.tasks = BackgroundTasks(f"kvpool {node.name}")
        self.hellos_acked = 0
        self.adopted = 0  # units a restarted control plane took back from this arena
        self._inventory: asyncio.Task[None] | None = None
        self.metrics = Metrics()
        self.metrics.read_at_scrape(self._scrape)

    async def start(self) -> None:
        await self.server.start(self.node.host, self.node.data_port)
        self.export = transport_class(self.config.transport.name).export(self.arena, self.node.host,
                                                                        self.config.transport)

    async def stop(self) -> None:
        await self.tasks.drain(timeout=0)
        await self.control.close()
        await self.server.close()
        if self.export is not None:
            self.export.close()
            self.export = None

    def close_arena(self) -> None:
        """Unmap and unlink the segment (clean shutdown; a crash leaves it for the next start to sweep)."""
        self.arena.close()

    # --- what the node tells others ------------------------------------------------------

    def endpoint(self) -> NodeEndpoint:
        extra = self.export.endpoint_fields() if self.export is not None else {}
        return NodeEndpoint(WIRE_VERSION, self.node.name, self.boot_id, self.node.capacity_blocks,
                            self.layout.slot_bytes, self.arena.name, self.node.host, self.server.port, **extra)

    def hello(self) -> MemoryNodeHello:
        ep = self.endpoint()
        return MemoryNodeHello(WIRE_VERSION, ep.name, ep.boot_id, ep.capacity_blocks, ep.slot_bytes, ep.shm_name,
                               ep.data_host, ep.data_port, self.server.settled_term())

    def learn_term(self, ack: MemoryNodeHelloAck) -> None:
        """The control plane's term from its hello answer, if its MAC verifies for this node and boot.

        From then on the data port refuses capabilities of older terms even before one of the
        new term arrives, and the next hello says so (``term_settled``): the plane can end its
        restart fence instead of waiting out every earlier grant.
        """
        secret = self.auth.secret
        if secret is None or not ack.term or not ack.term_mac:
            return
        if hmac.compare_digest(term_notice(secret, self.node.name, self.boot_id, ack.term), ack.term_mac):
            self.server.terms.observe_term(ack.term)
        else:
            log.warning("kvpool %s: a hello answer claimed leader term %d with a MAC that does not verify; ignored",
                        self.node.name, ack.term)

    async def heartbeat(self) -> None:
        """Hello now and every heartbeat_timeout_s / 3; a control plane that is down is retried."""
        interval = self.config.control.heartbeat_timeout_s / 3
        warned = False
        while True:
            try:
                ack = await self.control.hello(self.hello())
                self.learn_term(ack)
                if not ack.ok:
                    log.warning("control plane refused hello of %s: %s", self.node.name, ack.reason)
                elif ack.reason == "joined" and (self._inventory is None or self._inventory.done()):
                    self._inventory = self.tasks.spawn(self.report_inventory(), name="inventory")
                self.hellos_acked += 1
                warned = False
            except ControlPlaneError as exc:
                if not warned:  # once per outage, not once per beat
                    log.warning("kvpool %s: control plane unreachable, will keep trying: %s", self.node.name, exc)
                    warned = True
            await asyncio.sleep(interval)

    async def report_inventory(self) -> None:
        """Report the verified blocks until the plane is past its fence and has adopted what it wants.

        Sent in chunks (request bodies are bounded); the plane keeps partial units across them.
        """
        while True:
            blocks = await asyncio.to_thread(scan, self.arena, self.layout)
            adopted = 0
            retry = 0.0
            try:
                for i in range(0, len(blocks), INVENTORY_CHUNK):
                    result = await self.control.inventory(MemoryNodeInventory(
                        WIRE_VERSION, self.node.name, self.boot_id, tuple(blocks[i : i + INVENTORY_CHUNK])))
                    adopted += len(result.adopted)
                    retry = result.retry_after_s
                    if retry > 0:
                        break
            except ControlPlaneError as exc:
                log.warning("kvpool %s: inventory not delivered (its entries are lost): %s", self.node.name, exc)
                return
            if retry <= 0:
                self.adopted += adopted
                if blocks:
                    log.info("kvpool %s: control plane took back %d units from %d verified blocks",
                             self.node.name, adopted, len(blocks))
                return
            # not the whole fence: it ends early once this node reports the plane's term settled
            # (a hello, every heartbeat interval)
            await asyncio.sleep(min(retry, self.config.control.heartbeat_timeout_s / 3) + 0.05)

    # --- control endpoints ---------------------------------------------------------------

    async def lifecycle(self, _: web.Application) -> AsyncIterator[None]:
        await self.start()
        log.info("kvpool %s: %d slots x %d B (%.1f MiB) in /dev/shm/%s, tcp data on %s:%d, transport %s",
                 self.node.name, self.node.capacity_blocks, self.layout.slot_bytes, self.arena.nbytes / 2**20,
                 self.arena.name, self.node.host, self.server.port, self.config.transport.name)
        self.tasks.spawn(self.heartbeat(), name=f"hello-{self.node.name}")
        if self.config.ha.enabled:  # hello to whichever replica the election says leads
            from tessera.ha.discovery import follow_leader

            self.tasks.spawn(follow_leader(self.config.ha, self.control.point_at), name="leader-watch")
        try:
            yield
        finally:
            await self.stop()  # the heartbeat loop never ends by itself: stop cancels it
            self.close_arena()

    def app(self) -> web.Application:
        # /info names the shm segment and the data port: cluster processes only. /metrics
        # takes a Prometheus scraper's admin API key instead (a scraper cannot sign), or is
        # open on a loopback-only node without keys, as on the generation nodes
        keys = KeyRing.load(self.config.security.keys_file) if self.config.security.keys_file else None
        scrapable = keys is not None or self.node.host in LOOPBACK_HOSTS
        open_paths = ("/health", "/metrics") if scrapable else ("/health",)
        app = application([self.auth.middleware(self.node.host, self.node.port, open_paths=open_paths,
                                                body_timeout_s=self.config.listener.body_timeout_s),
                           admin_middleware(keys)])
        app[KVPOOL_NODE] = self
        app.cleanup_ctx.append(self.lifecycle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/info", self._info)
        app.router.add_get("/inventory", self._inventory_now)  # for checkers (tessera_lab/hosts)
        app.router.add_get("/metrics", self._metrics)
        return app

    def _scrape(self) -> list[Metric]:
        """The arena's and the block server's figures, read at scrape time."""
        stats = self.server.stats()
        return [
            gauge("tessera_kvpool_capacity_blocks", "Slots of the arena", self.node.capacity_blocks),
            gauge("tessera_kvpool_slot_bytes", "Bytes per slot (one block of one unit, every layer)",
                  self.layout.slot_bytes),
            gauge("tessera_kvpool_data_connections", "Open connections to the tcp block server", stats["connections"]),
            counter("tessera_kvpool_data_requests_total", "Block reads and writes served over tcp", stats["requests"]),
            counter("tessera_kvpool_data_read_bytes_total", "Bytes read out of the arena over tcp (fetches)",
                    stats["bytes_read"]),
            counter("tessera_kvpool_data_written_bytes_total", "Bytes written into the arena over tcp (writebacks)",
                    stats["bytes_written"]),
            counter("tessera_kvpool_data_refused_connections_total",
                    "Data connections closed at accept: the port held transport.max_connections",
                    stats["refused_connections"]),
            counter("tessera_kvpool_data_refused_peer_connections_total",
                    "Data connections closed at accept: their address held transport.max_connections_per_peer",
                    stats["refused_peer_connections"]),
            counter("tessera_kvpool_data_late_handshakes_total",
                    "Data connections closed without a handshake within transport.handshake_timeout_s",
                    stats["late_handshakes"]),
            counter("tessera_kvpool_hellos_acked_total", "Heartbeats the control plane acknowledged",
                    self.hellos_acked),
            counter("tessera_kvpool_adopted_units_total", "Units a restarted control plane took back from the arena",
                    self.adopted),
        ]

    async def _metrics(self, _: web.Request) -> web.Response:
        return self.metrics.response()

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True, "node": self.node.name, "boot_id": self.boot_id})

    async def _inventory_now(self, _: web.Request) -> web.Response:
        """The verified blocks of the arena right now (what an inventory after a restart would report)."""
        blocks = await asyncio.to_thread(scan, self.arena, self.layout)
        return web.json_response({"node": self.node.name, "boot_id": self.boot_id,
                                  "blocks": [to_wire(b) for b in blocks]})

    async def _info(self, _: web.Request) -> web.Response:
        body: dict[str, Any] = to_wire(self.endpoint())
        body["geometry"] = asdict(self.layout.geometry)
        body["block_tokens"] = self.layout.block_tokens
        body["transport"] = self.config.transport.name
        body["stats"] = {**self.server.stats(), "hellos_acked": self.hellos_acked, "adopted": self.adopted}
        return web.json_response(body)


KVPOOL_NODE = web.AppKey("kvpool_node", MemoryNode)


def pick_node(config: ClusterConfig, name: str | None) -> KVPoolNodeConfig:
    if name is None:
        if len(config.kvpools) != 1:
            known = ", ".join(n.name for n in config.kvpools) or "none"
            raise TesseraError(f"pass --node NAME: the config declares these kvpool nodes: {known}")
        return config.kvpools[0]
    return config.kvpool_node(name)


def run_memory_node(config: ClusterConfig, name: str | None) -> int:
    """Entry point of the kvpool role; returns the process exit code."""
    from tessera.runtime import run

    try:
        node_cfg = pick_node(config, name)
        if node_cfg.data_port:  # fail at once, not after the arena is mapped (the control port: serve)
            bind_listener(node_cfg.host, node_cfg.data_port, f"kvpool {node_cfg.name} data").close()
        geometry = geometry_from_checkpoint(resolve(config.model), config.kv_dtype, config.model.max_context)
        node = MemoryNode(config, node_cfg, BlockLayout(geometry, config.block_tokens))
    except TesseraError as exc:
        log.error("kvpool cannot start: %s", exc)
        return 2
    try:
        return run(lambda: serve(node.app(), node_cfg.host, node_cfg.port, name=f"kvpool {node_cfg.name}",
                                 limits=config.listener, ssl_context=node.auth.server_ssl()))
    finally:
        node.close_arena()  # when the app never started; closing twice is harmless
