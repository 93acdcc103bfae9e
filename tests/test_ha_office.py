"""Which plane a retrieval replica may use (Office): pure logic, no etcd (the failover tests run the real thing)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.cluster import cluster_config

from tessera.config import ClusterConfig, HAConfig
from tessera.control.plane import ControlPlane
from tessera.errors import NotLeader
from tessera.ha.election import Leader
from tessera.messages.control import LoadReport
from tessera.retrieval.leadership.office import Office
from tessera.retrieval.leadership.path import LocalPath, RemotePath
from tessera.wire import WIRE_VERSION


class FakeLeadership:
    """A term that is valid until ``end()``, as Leadership.valid turns false when the lease may have run out."""

    def __init__(self) -> None:
        self.valid = True
        self.term = 7

    def end(self) -> None:
        self.valid = False


def replicated() -> ClusterConfig:
    cfg = cluster_config(nodes=1)
    return dataclasses.replace(cfg, retrieval=dataclasses.replace(cfg.retrieval, store="postgres",
                                                                  postgres_dsn="host=127.0.0.1"),
                               ha=HAConfig(etcd="127.0.0.1:2379", replicas=2, retry_after_s=2))


def test_without_ha_the_one_process_always_holds_its_plane() -> None:
    """The default: held() is the plane and chat uses it in process."""
    plane = ControlPlane(cluster_config(nodes=1))
    office = Office(plane.config, plane)
    assert office.held() is plane and isinstance(office.path(), LocalPath)


def test_a_replica_without_a_known_leader_refuses_with_retry_after() -> None:
    """No leader elected yet: NotLeader (503) carrying ha.retry_after_s, both for the plane and for chat."""
    cfg = replicated()
    office = Office(cfg, ControlPlane(cfg))
    for ask in (office.held, office.path):
        with pytest.raises(NotLeader) as refused:
            ask()
        assert refused.value.retry_after_s == 2


def test_a_follower_sends_chat_to_the_leader_it_saw_and_never_issues_itself() -> None:
    """A leader elsewhere: chat through its RPCs at the URL the election key holds; /control/* refuses here."""
    cfg = replicated()
    office = Office(cfg, ControlPlane(cfg))
    office._saw(Leader(b"http://127.0.0.1:9999", 5))
    assert isinstance(office.path(), RemotePath) and office.remote.base_url == "http://127.0.0.1:9999"
    with pytest.raises(NotLeader, match="another replica leads") as refused:
        office.held()
    assert "http" not in str(refused.value)  # a follower's client may be shown this refusal


def test_a_leader_stops_issuing_the_moment_its_term_is_no_longer_valid() -> None:
    """Regression guard for the paused leader: once valid is false, held() and path() refuse, even if the
    election key still names this replica."""
    cfg = replicated()
    office = Office(cfg, ControlPlane(cfg))
    term = FakeLeadership()
    office.leadership = term  # type: ignore[assignment]
    office._saw(Leader(office.url.encode(), term.term))
    assert office.held() is office.plane and isinstance(office.path(), LocalPath)
    term.end()
    with pytest.raises(NotLeader):
        office.held()
    with pytest.raises(NotLeader):
        office.path()


def test_readiness_waits_for_a_generation_node_and_on_a_follower_for_a_leader() -> None:
    """Regression: /health was 200 seconds before chat could be served (503 "no generation node is alive").

    Without [ha] (or on the leader) a chat is servable once a node reported in; a follower needs a
    leader elsewhere; a replica whose term ended is not ready until a new leader is seen."""
    plane = ControlPlane(cluster_config(nodes=1))
    office = Office(plane.config, plane)
    assert "no generation node is alive" in (office.unready() or "")
    plane.load(LoadReport(WIRE_VERSION, "gen0", 0))
    assert office.unready() is None
    follower = Office(replicated(), ControlPlane(replicated()))
    assert "failover" in (follower.unready() or "")
    follower._saw(Leader(b"http://127.0.0.1:9999", 5))
    assert follower.unready() is None
    follower._saw(Leader(follower.url.encode(), 6))  # the key names this replica, whose term is not valid
    assert "failover" in (follower.unready() or "")
