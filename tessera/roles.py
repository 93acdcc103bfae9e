"""Entry points of the three roles; ``tessera run --role ROLE`` dispatches here.

Each entry point takes the validated cluster config and the node name and returns the
process exit code. Imports are lazy: a memory node never imports torch models, the
retrieval node never imports the engine.
"""

from __future__ import annotations

import sys

from tessera.config import LOOPBACK_HOSTS, ClusterConfig, Role
from tessera.errors import ConfigError, TesseraError


def check_registered(config: ClusterConfig, role: str | None = None) -> None:
    """Every policy key names a registered implementation; else a ConfigError listing the names.

    Runs at start-up of every role and of ``tessera up`` (``role`` None), so a typo fails before
    any process starts, while a policy that a user registers (``@REGISTRY.register("name")``) is
    accepted. A memory node skips ``model.engine``: it never builds an engine, and the engine
    contract (where that registry lives) imports torch, which a memory node never loads.
    """
    from tessera.composition.policies import POLICIES
    from tessera.control.admission import ADMISSIONS
    from tessera.control.router import ROUTERS
    from tessera.transport.base import TRANSPORTS

    POLICIES.check(config.composition.policy)
    ADMISSIONS.check(config.control.admission)
    ROUTERS.check(config.control.routing)
    TRANSPORTS.check(config.transport.name)
    if role != Role.kvpool:
        from tessera.engines.base import ENGINES

        ENGINES.check(config.model.engine)


def check_secret(role: str, config: ClusterConfig, node: str | None) -> None:
    """A role whose listeners reach beyond loopback must hold a cluster secret.

    Every listener of a kvpool or generation node is internal: without a secret anyone who
    reaches it could drive it. (The retrieval role checks its two planes itself.)
    """
    if config.security.secret_file or role == Role.retrieval:
        return
    nodes = config.kvpools if role == Role.kvpool else config.generation
    hosts = {n.host for n in nodes if node is None or n.name == node}
    exposed = sorted(hosts - set(LOOPBACK_HOSTS))
    if exposed:
        raise ConfigError(f"{role} listens on {', '.join(exposed)} without security.secret_file: its API would be "
                          "open to the network; set a cluster secret (tessera up creates one)")


def run_role(role: str, config: ClusterConfig, node: str | None) -> int:
    role = Role(role)
    if role == "retrieval":
        from tessera.retrieval.app import run_retrieval_role

        return run_retrieval_role(config, node)
    if role == "kvpool":
        from tessera.kvpool.node import run_memory_node

        return run_memory_node(config, node)
    from tessera.generation.node import run_generation

    return run_generation(config, node)


def main_for(role: str, config: ClusterConfig, node: str | None) -> int:
    try:
        check_registered(config, role)
        check_secret(role, config, node)
        return run_role(role, config, node)
    except TesseraError as exc:
        print(f"tessera {role}: {exc}", file=sys.stderr)
        return 2
