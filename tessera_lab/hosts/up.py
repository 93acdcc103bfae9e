"""``tessera hosts up``: every role of a config on a host of its own, until Ctrl-C.

The hosts are network namespaces of this machine (tessera_lab/hosts/netns.py); their network
cannot be reached from the machine's own one, so the API is forwarded to a loopback port
here. Ctrl-C (or SIGTERM) drains the roles and deletes every namespace; after a crash the
next ``tessera hosts up`` (or ``tessera hosts clean``) deletes what the dead one left.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tessera.config import ClusterConfig
from tessera.launcher import ClusterError, supervise_until_signalled
from tessera_lab.hosts.cluster import CLIENT_HOST, CONTROL_HOST, HostCluster
from tessera_lab.hosts.netns import namespace_name, remove_leftovers, unavailable
from tessera_lab.hosts.proxy import SlowLink


def serve_hosts(config: ClusterConfig, log_dir: Path | None, api_port: int = 0) -> int:
    """Start the hosts and the roles, print how to reach the API, supervise until a signal; the exit code."""
    why = unavailable()
    if why is not None:
        print(f"tessera hosts up: {why}", file=sys.stderr)
        return 2
    cluster = HostCluster(config, log_dir=log_dir)
    cfg = cluster.config
    # started before the hosts exist, from this (the machine's own) namespace: it listens here
    # and connects from inside the client host
    forward = SlowLink(None, (cfg.retrieval.host, cfg.retrieval.port), connect_namespace=namespace_name(CLIENT_HOST),
                       listen_port=api_port)
    port = forward.start()
    try:
        cluster.start()
    except ClusterError as exc:
        forward.stop()
        print(f"tessera hosts up: {exc}", file=sys.stderr, flush=True)
        return 1
    hosts = cluster.net.hosts
    print("tessera hosts are up:", flush=True)
    for h in hosts.values():
        print(f"  {h.name:<8} {h.address:<12} netns {h.namespace}", flush=True)
    print(f"API (forwarded from host {CONTROL_HOST}): {cfg.scheme}://127.0.0.1:{port}/v1/chat/completions\n"
          f"  API key: {cluster.api_key}   (header Authorization: Bearer <key>)\n"
          f"  from inside the virtual network: ip netns exec {hosts[CLIENT_HOST].namespace} "
          f"curl {cfg.retrieval_url}/v1/models -H 'Authorization: Bearer {cluster.api_key}'\n"
          f"  logs and config ({cluster.config_path.name}, the same on every host) in {cluster.log_dir}\n"
          "Ctrl-C stops every role and deletes the hosts.", flush=True)
    try:
        supervise_until_signalled(cluster, "stopping (draining in-flight requests), then deleting the hosts...")
    finally:
        forward.stop()
    return 0


def clean() -> int:
    """``tessera hosts clean``: delete the namespaces of harnesses that are gone."""
    why = unavailable()
    if why is not None:
        print(f"tessera hosts clean: {why}", file=sys.stderr)
        return 2
    removed = remove_leftovers()
    print(f"removed {len(removed)} namespaces" + (": " + ", ".join(removed) if removed else ""))
    return 0
