"""Entry points of the three roles; ``tessera run --role ROLE`` dispatches here.

Each entry point takes the validated cluster config and the node name and returns the
process exit code. Imports are lazy: a memory node never imports torch models, the
retrieval node never imports the engine.
"""

from __future__ import annotations

import sys

from tessera.config import ROLES, ClusterConfig
from tessera.errors import TesseraError


def run_role(role: str, config: ClusterConfig, node: str | None) -> int:
    assert role in ROLES, role
    if role == "retrieval":
        from tessera.serving.app import run_retrieval_role

        return run_retrieval_role(config)
    if role == "kvpool":
        from tessera.kvpool.node import run_memory_node

        return run_memory_node(config, node)
    from tessera.generation.node import run_generation

    return run_generation(config, node)


def main_for(role: str, config: ClusterConfig, node: str | None) -> int:
    try:
        return run_role(role, config, node)
    except TesseraError as exc:
        print(f"tessera {role}: {exc}", file=sys.stderr)
        return 2
