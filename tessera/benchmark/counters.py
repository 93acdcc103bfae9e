"""What a run's generation nodes counted, read from their ``/metrics`` before the cluster stops.

The bench report shows, per run, what the replies cannot: shared writebacks published,
failed, skipped (and why), write grants renewed, prefills joined by another request, the
engine threads' CPU and wall seconds by engine call. The
figures cover the whole run, warm-up included, summed over the nodes. A node that does not
answer (a chaos run killed it) is left out and named.
"""

from __future__ import annotations

import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig

log = logging.getLogger(__name__)

# the node's counter -> the report's name (a labelled counter gets one entry per label value)
NODE_COUNTERS = {
    "tessera_node_writebacks_published": "writebacks_published",
    "tessera_node_writeback_failures": "writebacks_failed",
    "tessera_node_writebacks_skipped": "writebacks_skipped",
    "tessera_node_write_grants_renewed": "write_grants_renewed",
    "tessera_node_coalesced_prefills": "coalesced_prefills",
    "tessera_node_unit_prefills": "unit_prefills",
    # the engine thread's seconds by engine call: where a node's time went, per run
    "tessera_node_engine_cpu_seconds": "engine_cpu_s",
    "tessera_node_engine_wall_seconds": "engine_wall_s",
}
SCRAPE_TIMEOUT_S = 10.0


def parse(text: str) -> dict[str, float]:
    """The :data:`NODE_COUNTERS` of one ``/metrics`` page; a label value becomes ``name:value``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = NODE_COUNTERS.get(family.name)
        if name is None:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # _created
            key = ":".join([name, *sample.labels.values()])
            out[key] = out.get(key, 0.0) + sample.value
    return out


async def node_counters(config: ClusterConfig) -> dict[str, float]:
    """:func:`parse` of every generation node's ``/metrics``, summed; ``unreachable`` counts misses."""
    auth = ClusterAuth.from_config(config)
    total: dict[str, float] = {}
    missing = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as http:
        for node in config.generation:
            url = f"{config.scheme}://{node.host}:{node.port}/metrics"
            try:
                async with http.get(url, headers=auth.headers("GET", url), ssl=auth.client_ssl(),
                                    allow_redirects=False) as resp:
                    if resp.status != 200:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                    text = await resp.text()
            except (TimeoutError, aiohttp.ClientError) as exc:
                log.warning("no counters from generation node %s: %s", node.name, exc)
                missing += 1
                continue
            for key, value in parse(text).items():
                total[key] = total.get(key, 0.0) + value
    if missing:
        total["unreachable_nodes"] = float(missing)
    return total
