"""Many hosts on one machine: the virtual network, its faults, the checker and the multi-host chaos run."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.cluster import cluster_config
from helpers.plane import Cluster

from tessera.engines.tiny import write_tiny_checkpoint
from tessera.messages.control import LoadReport, ResidencyReport
from tessera.wire import WIRE_VERSION
from tessera_lab.chaos.harness import FAULTS, ChaosOptions
from tessera_lab.hosts import checker
from tessera_lab.hosts.chaos import NETWORK_FAULTS, HostChaosRun
from tessera_lab.hosts.cluster import CLIENT_HOST, CONTROL_HOST, host_config, host_names
from tessera_lab.hosts.netns import Network, call_in, delete_namespace, has_nftables, remove_leftovers, unavailable
from tessera_lab.hosts.proxy import SlowLink

WHY_NOT = unavailable()
needs_network = pytest.mark.skipif(WHY_NOT is not None, reason=f"multi-host harness: {WHY_NOT}")


@pytest.fixture
def network() -> Iterator[Network]:
    net = Network.create(["a", "b"])
    try:
        yield net
    finally:
        net.destroy()


def _listen(net: Network, host: str, port: int) -> socket.socket:
    def make() -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((net.address(host), port))
        s.listen(8)
        return s

    return call_in(net.namespace(host), make)


def _connects(net: Network, src: str, dst: str, port: int, timeout: float = 1.0) -> bool:
    def attempt() -> bool:
        with socket.socket() as s:
            s.settimeout(timeout)
            try:
                s.connect((net.address(dst), port))
            except OSError:
                return False
            return True

    return call_in(net.namespace(src), attempt)


# --- the virtual network -------------------------------------------------------------------


@needs_network
def test_a_blocked_port_drops_only_that_port_and_only_that_direction(network: Network) -> None:
    """block(a, b, port): a cannot reach b:port, still reaches b's other ports, and b still reaches a."""
    listeners = [_listen(network, "b", 9000), _listen(network, "b", 9001), _listen(network, "a", 9000)]
    try:
        network.block("a", "b", port=9000)
        assert not _connects(network, "a", "b", 9000)
        assert _connects(network, "a", "b", 9001)
        assert _connects(network, "b", "a", 9000)
    finally:
        for s in listeners:
            s.close()


@needs_network
def test_a_cut_partitions_both_ways_and_a_heal_undoes_it(network: Network) -> None:
    """cut(a, b) drops every packet between them both ways; heal() restores both."""
    listeners = [_listen(network, "b", 9000), _listen(network, "a", 9000)]
    try:
        network.cut("a", "b")
        assert not _connects(network, "a", "b", 9000)
        assert not _connects(network, "b", "a", 9000)
        network.heal()
        assert _connects(network, "a", "b", 9000)
        assert _connects(network, "b", "a", 9000)
    finally:
        for s in listeners:
            s.close()


@needs_network
def test_an_unplugged_host_reaches_nobody_until_plugged_back(network: Network) -> None:
    """unplug(a) takes a's cable out of the bridge; heal() puts it back."""
    listener = _listen(network, "b", 9000)
    try:
        network.unplug("a")
        assert not _connects(network, "a", "b", 9000)
        network.heal()
        assert _connects(network, "a", "b", 9000, timeout=3.0)
    finally:
        listener.close()


@needs_network
@pytest.mark.skipif(not has_nftables(), reason="the slow link's redirect needs nftables (nft)")
def test_a_slow_link_carries_the_redirected_connection_intact(network: Network) -> None:
    """With a redirect to a slow link, a's connection to b goes through the proxy and every byte arrives in order."""
    listener = _listen(network, "b", 9000)
    payload = bytes(range(256)) * 4096  # 1 MiB
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            chunks = []
            while data := conn.recv(65536):
                chunks.append(data)
            got.append(b"".join(chunks))

    server = threading.Thread(target=serve)
    server.start()
    link = SlowLink(network.namespace("a"), (network.address("b"), 9000), delay_s=0.05, rate_bytes_s=20e6)
    port = link.start()
    try:
        network.redirect("a", "b", 9000, port)

        def send() -> None:
            with socket.create_connection((network.address("b"), 9000), timeout=10.0) as s:
                s.sendall(payload)

        call_in(network.namespace("a"), send)
        server.join(20.0)
    finally:
        link.stop()
        listener.close()
    assert link.connections == 1
    assert got == [payload]


@needs_network
def test_the_namespaces_of_a_dead_harness_are_removed() -> None:
    """remove_leftovers deletes tsr<pid>-* namespaces whose pid is gone, and no others."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"tsr{dead.pid}-leftover"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in remove_leftovers()
        assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        delete_namespace(name)


def test_every_node_of_a_host_config_listens_on_its_own_host(tmp_path: Path) -> None:
    """host_config: one address per node, the API and control plane on cp, tcp transport, a secret and API keys."""
    cfg, key = host_config(cluster_config(nodes=2), tmp_path)
    hosts = host_names(cfg)
    assert hosts[0] == CONTROL_HOST and hosts[-1] == CLIENT_HOST
    addresses = [cfg.retrieval.host, *(n.host for n in cfg.kvpools), *(n.host for n in cfg.generation)]
    assert len(set(addresses)) == len(addresses) == len(hosts) - 1
    assert cfg.retrieval.internal_host == cfg.retrieval.host
    assert cfg.transport.name == "tcp"
    assert cfg.security.secret_file and key in Path(cfg.security.keys_file).read_text()


# --- the checker ---------------------------------------------------------------------------


def _state(entries: list[dict[str, Any]], now: float = 100.0,
           local: dict[str, list[str]] | None = None) -> dict[str, Any]:
    return {"now": now, "entries": entries,
            "nodes": {n: {"alive": True, "local": units} for n, units in (local or {}).items()}}


def _entry(unit: str, epoch: int, slots: list[int], ready: bool = True, deadline: float = 200.0,
           leases: list[list[Any]] | None = None) -> dict[str, Any]:
    return {"unit": unit, "epoch": epoch, "ready": ready, "blocks": [["kv0", s] for s in slots], "writer": "gen0",
            "deadline": deadline, "leases": leases or []}


def _inventory(*blocks: tuple[int, int, int]) -> dict[str, Any]:
    """(slot, epoch, block_index) per verified block."""
    return {"blocks": [{"slot": s, "epoch": e, "block_index": i} for s, e, i in blocks]}


def test_a_ready_entry_over_a_block_of_another_epoch_is_a_violation() -> None:
    """unfinished_ready flags a READY entry whose slot verifies under another epoch (its writer did not finish)."""
    state = _state([_entry("u1", 7, [0, 1])])
    torn = checker.Sample(1.0, state, {"kv0": _inventory((0, 7, 0), (1, 3, 0))}, state)
    whole = checker.Sample(1.0, state, {"kv0": _inventory((0, 7, 0), (1, 7, 1))}, state)
    assert len(checker.unfinished_ready(torn)) == 1
    assert checker.unfinished_ready(whole) == []
    assert checker.unfinished_ready(torn, exempt=[("kv0", 1)]) == []


def test_an_entry_that_changed_while_the_inventory_was_read_is_not_judged() -> None:
    """unfinished_ready only judges entries READY with the same epoch before and after the scan."""
    before = _state([_entry("u1", 7, [0])])
    after = _state([_entry("u1", 9, [0])])
    assert checker.unfinished_ready(checker.Sample(1.0, before, {"kv0": _inventory()}, after)) == []


def test_a_lease_or_reservation_past_expiry_plus_grace_is_a_violation() -> None:
    """overdue flags a lease and a PENDING reservation older than their expiry + grace, not younger ones."""
    state = _state([_entry("u1", 1, [0], leases=[["L1", 97.0], ["L2", 99.5]]),
                    _entry("u2", 2, [1], ready=False, deadline=90.0)])
    found = checker.overdue(state, grace_s=2.0, at=5.0)
    assert len(found) == 2
    assert any("L1" in v for v in found) and any("u2" in v for v in found)


def test_an_acknowledged_unit_that_is_gone_is_lost() -> None:
    """lost_units names every acknowledged unit not served at the end."""
    assert checker.lost_units(["a", "b"], ["a"]) == ["unit b was acknowledged at ingest and is gone"]
    assert checker.lost_units(["a"], ["a", "c"]) == []


def test_a_local_view_that_differs_from_the_node_cache_has_not_converged() -> None:
    """differences: a view holding a unit the cache lacks, or an outstanding reservation, is not convergence."""
    inv = {"kv0": _inventory((0, 1, 0))}
    done = _state([_entry("u1", 1, [0])], local={"gen0": ["x"]})
    assert checker.differences(done, inv, {"gen0": ["x"]}, ["kv0"], ["gen0"]) == []
    assert checker.differences(done, inv, {"gen0": []}, ["kv0"], ["gen0"])
    pending = _state([_entry("u1", 1, [0]), _entry("u2", 2, [1], ready=False)], local={"gen0": ["x"]})
    assert checker.differences(pending, inv, {"gen0": ["x"]}, ["kv0"], ["gen0"])


def test_a_reply_served_by_a_node_held_dead_is_a_flap() -> None:
    """flaps: a request answered by gen0 between two samples that both held gen0 dead."""
    dead = {"now": 0.0, "entries": [], "nodes": {"gen0": {"alive": False, "local": []}}}
    alive = {"now": 0.0, "entries": [], "nodes": {"gen0": {"alive": True, "local": []}}}
    samples = [checker.Sample(t, s, {}, s) for t, s in ((1.0, dead), (2.0, dead), (3.0, alive))]
    assert len(checker.flaps([checker.Served(1.2, 1.8, "gen0")], samples)) == 1
    assert checker.flaps([checker.Served(2.2, 2.8, "gen0")], samples) == []


def test_a_node_back_from_dead_is_asked_for_its_whole_cache() -> None:
    """Regression: a node declared dead (its view cleared) and then heard again was never asked to resync.

    Found by the multi-host checker: after a one-way partition of a node's heartbeats healed,
    the control plane's local view of it stayed empty while its cache held units (routing lost
    their locality for good; only units requested again were re-learned from snapshots).
    """
    c = Cluster(admission="lru", nodes=1, join_generation=False)
    plane = c.plane
    assert plane.load(LoadReport(WIRE_VERSION, "gen0", 0)).reason == "resync"
    plane.residency(ResidencyReport(WIRE_VERSION, "gen0", ("a",), (), blocks=(2,)))
    plane.suspect("gen0")  # e.g. its heartbeats stopped arriving: declared dead, view cleared
    assert not plane.nodes["gen0"].local.holds("a")
    assert plane.load(LoadReport(WIRE_VERSION, "gen0", 0)).reason == "resync"
    assert plane.load(LoadReport(WIRE_VERSION, "gen0", 0)).reason == ""
    plane.residency(ResidencyReport(WIRE_VERSION, "gen0", ("a",), (), blocks=(2,)))
    assert plane.nodes["gen0"].local.holds("a")
    plane.check_invariants()


# --- the multi-host chaos run --------------------------------------------------------------


def _chaos(tmp_path: Path, options: ChaosOptions, faults: tuple[str, ...]) -> None:
    model = write_tiny_checkpoint(tmp_path / "llama", "llama", seed=7)
    # a local cache of a few units: most requests fetch some units from the memory node
    cfg = cluster_config(str(model), nodes=2, kv_blocks=256, local_blocks=12, connect_timeout_s=1.0,
                         first_token_timeout_s=3.0,
                         idle_timeout_s=3.0, heartbeat_timeout_s=4.0, lease_ttl_s=5.0, write_timeout_s=5.0)
    run = HostChaosRun(cfg, options, tmp_path / "logs", faults=faults)
    report = run.run()
    print(report.render())
    print(run.render())
    assert report.ok, report.render() + "\n" + run.render()
    assert set(report.faults) == set(run.fault_kinds)
    assert report.outcomes["200 verified"] > 0
    assert run.samples and run.acknowledged


@needs_network
@pytest.mark.slow  # ~60 s; the multi-host harness's faults are each tested above
def test_a_short_multi_host_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    """Every network fault once across 5 hosts (~40 s of load): replies verified, the checker's invariants hold."""
    _chaos(tmp_path, ChaosOptions(duration_s=40.0, rate=2.0, fault_every_s=7.5, max_tokens=6, seed=1),
           NETWORK_FAULTS)


@needs_network
@pytest.mark.slow
def test_a_long_multi_host_chaos_run_mixing_network_and_process_faults(tmp_path: Path) -> None:
    """Network and process faults mixed, several cycles (docs/bench/chaos.md's table: `tessera chaos --hosts`)."""
    _chaos(tmp_path, ChaosOptions(duration_s=240.0, rate=2.0, fault_every_s=8.0, max_tokens=8, seed=2),
           FAULTS + NETWORK_FAULTS)
