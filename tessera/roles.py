"""Entry points of the three roles; ``tessera run --role ROLE`` dispatches here.

Each entry point takes the validated cluster config and the node name and returns the
process exit code. A role that is not implemented says so and returns non-zero.
"""

from __future__ import annotations

import sys

from tessera.config import ROLES, ClusterConfig


class RoleNotImplemented(Exception):
    pass


def run_role(role: str, config: ClusterConfig, node: str | None) -> int:
    assert role in ROLES, role
    if role == "kvpool":
        from tessera.kvpool.node import run_memory_node

        return run_memory_node(config, node)
    raise RoleNotImplemented(
        f"role {role!r} is not implemented yet in this build of tessera; nothing was started"
    )


def main_for(role: str, config: ClusterConfig, node: str | None) -> int:
    try:
        return run_role(role, config, node)
    except RoleNotImplemented as exc:
        print(f"tessera: {exc}", file=sys.stderr)
        return 2
