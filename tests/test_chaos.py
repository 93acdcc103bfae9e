"""The chaos run: faults of every kind under load, every reply verified (real processes, tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cluster import cluster_config

from tessera.engines.tiny import write_tiny_checkpoint
from tessera_lab.chaos.harness import FAULTS, ChaosOptions, ChaosRun


def _run(tmp_path: Path, options: ChaosOptions) -> None:
    model = write_tiny_checkpoint(tmp_path / "llama", "llama", seed=7)
    cfg = cluster_config(str(model), nodes=2, kv_blocks=256, connect_timeout_s=1.0, first_token_timeout_s=3.0,
                         idle_timeout_s=3.0, heartbeat_timeout_s=4.0)
    report = ChaosRun(cfg, options, tmp_path / "logs").run()
    print(report.render())
    assert report.ok, report.render()
    assert set(report.faults) == set(FAULTS)
    assert report.outcomes["200 verified"] > 0


def test_a_short_chaos_run_answers_every_request_correctly_or_refuses_it_cleanly(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Every fault kind once (~30 s of load): 200 with the offline tokens, or a clean 429/503; then normal.

    Regression: the run was silent for minutes; it says each phase and each fault as it goes.
    """
    _run(tmp_path, ChaosOptions(duration_s=30.0, rate=2.0, fault_every_s=5.5, max_tokens=6, seed=1))
    progress = [line for line in capfd.readouterr().err.splitlines() if line.startswith("tessera chaos: ")]
    for phase in ("starting the cluster", "load for 30s", "load over:", "verifying"):
        assert any(phase in line for line in progress), progress
    for kind in FAULTS:
        assert any(kind.replace("_", " ") in line for line in progress), (kind, progress)


@pytest.mark.slow
def test_a_long_chaos_run(tmp_path: Path) -> None:
    """Several cycles of every fault under steady load (docs/bench/chaos.md's figures come from `tessera chaos`)."""
    _run(tmp_path, ChaosOptions(duration_s=240.0, rate=3.0, fault_every_s=6.0, max_tokens=8, seed=2))


@pytest.mark.slow
def test_a_replicated_chaos_run_survives_leader_kills_and_pauses(tmp_path: Path) -> None:
    """Two retrieval replicas, every fault kind with the leader's kill -9 and SIGSTOP past its lease."""
    import dataclasses

    from helpers.replicated import STRIDE, port_pair

    from tessera.config import HAConfig
    from tessera.ha.local import replicated
    from tessera.ha.servers import EtcdServer, PostgresServer
    from tessera_lab.chaos.replicas import LEADER_FAULTS, ReplicatedChaosRun

    for missing in (EtcdServer.missing(), PostgresServer.missing()):
        if missing:
            pytest.skip(missing)
    model = write_tiny_checkpoint(tmp_path / "llama", "llama", seed=7)
    cfg = cluster_config(str(model), nodes=2, kv_blocks=256, connect_timeout_s=1.0, first_token_timeout_s=3.0,
                         idle_timeout_s=3.0, heartbeat_timeout_s=4.0)
    cfg = dataclasses.replace(
        cfg, retrieval=dataclasses.replace(cfg.retrieval, port=port_pair(), internal_port=port_pair()),
        ha=HAConfig(replica_port_stride=STRIDE, lease_ttl_s=2, renew_margin_s=0.5))
    options = ChaosOptions(duration_s=60.0, rate=2.0, fault_every_s=6.0, max_tokens=6, seed=3)
    with replicated(cfg, 2) as ha_cfg:
        report = ReplicatedChaosRun(ha_cfg, options, tmp_path / "logs").run()
    print(report.render())
    assert report.ok, report.render()
    assert set(LEADER_FAULTS) <= set(report.faults)
    assert report.outcomes["200 verified"] > 0
