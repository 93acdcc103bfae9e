"""A writer process for fault tests: ``python kvpool_writer.py CONFIG GRANT_JSON SEED``.

It connects to the grant's memory nodes, prints READY, waits for a line on stdin, then runs
the real ``KVPoolClient.store`` (write every block, then publish) and prints STORED. A test
kills it in between to play a generation node that dies mid-write.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

from tessera.auth import CapabilityIssuer, ClusterAuth
from tessera.config_file import load_config
from tessera.engines.base import DTYPES, UnitState
from tessera.engines.checkpoint import resolve
from tessera.engines.geometry import geometry_from_checkpoint
from tessera.generation.pool_client import KVPoolClient, capabilities
from tessera.messages.plan import WriteGrant
from tessera.transport.base import SlotIO
from tessera.transport.blocks import BlockLayout
from tessera.wire import decode


async def main(config_path: str, grant_path: str, seed: int) -> None:
    config = load_config(config_path)
    g = geometry_from_checkpoint(resolve(config.model), config.kv_dtype)
    grant = decode(WriteGrant, Path(grant_path).read_bytes())
    pool = KVPoolClient(config, BlockLayout(g, config.block_tokens))
    # the warm-up read needs a read capability; this harness holds the secret and signs one itself
    secret = ClusterAuth.from_config(config).secret
    assert secret is not None
    token = CapabilityIssuer(secret).issue("read", grant.blocks, grant.epoch, 60, holder=grant.writer)
    caps = capabilities(grant.blocks, grant.epoch, token)
    for node in {b.node for b in grant.blocks}:  # connect before the test freezes anything
        first = next(b.index for b in grant.blocks if b.node == node)
        await pool.transport.read(await pool.endpoints.get(node), [SlotIO(first, memoryview(bytearray(1)), caps[node])])
    print("READY", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    gen = torch.Generator().manual_seed(seed)
    shape = (g.n_layers, grant.n_tokens, g.n_kv_heads, g.head_dim)
    state = UnitState(torch.randn(shape, generator=gen).to(DTYPES[g.kv_dtype]),
                      torch.randn(shape, generator=gen).to(DTYPES[g.kv_dtype]))
    await pool.store(grant, state)
    print("STORED", flush=True)
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
