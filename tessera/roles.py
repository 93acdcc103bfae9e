"""Entry points of the three roles; ``tessera run --role ROLE`` dispatches here.

Each entry point takes the validated cluster config and the node name and returns the
process exit code. Imports are lazy: a memory node never imports torch models, the
retrieval node never imports the engine.
"""

from __future__ import annotations

import sys

from tessera.config import ClusterConfig, Role
from tessera.errors import TesseraError


def check_registered(config: ClusterConfig) -> None:
    """Every policy key names a registered implementation; else a ConfigError listing the names.

    Runs at start-up of every role and of ``tessera up``, so a typo fails before any process
    starts, while a policy that a user registers (``@REGISTRY.register("name")``) is accepted.
    """
    from tessera.composition.policies import POLICIES
    from tessera.control.admission import ADMISSIONS
    from tessera.control.router import ROUTERS
    from tessera.engines.base import ENGINES
    from tessera.transport.base import TRANSPORTS

    for registry, name in ((POLICIES, config.composition.policy), (ADMISSIONS, config.control.admission),
                           (ROUTERS, config.control.routing), (TRANSPORTS, config.transport.name),
                           (ENGINES, config.model.engine)):
        registry.check(name)


def run_role(role: str, config: ClusterConfig, node: str | None) -> int:
    role = Role(role)
    if role == "retrieval":
        from tessera.retrieval.app import run_retrieval_role

        return run_retrieval_role(config)
    if role == "kvpool":
        from tessera.kvpool.node import run_memory_node

        return run_memory_node(config, node)
    from tessera.generation.node import run_generation

    return run_generation(config, node)


def main_for(role: str, config: ClusterConfig, node: str | None) -> int:
    try:
        check_registered(config)
        return run_role(role, config, node)
    except TesseraError as exc:
        print(f"tessera {role}: {exc}", file=sys.stderr)
        return 2
