"""The paged engine behind a real generation node (CPU): the served path equals offline composition."""

from __future__ import annotations

from pathlib import Path

from helpers.cluster import StartCluster
from helpers.mixed import mixed_config, run_mixed_scenario

from tessera.engines.checkpoint import Checkpoint
from tessera.engines.tokenizer import load_tokenizer


def test_paged_engine_serves_local_remote_and_missing_units_like_offline(
        tiny_model: Path, start_cluster: StartCluster, tmp_path: Path) -> None:
    """model.engine = "paged": a request mixing a local hit, a remote hit and a miss returns offline's tokens."""
    tokenizer = load_tokenizer(Checkpoint(tiny_model, "tiny", "x"))
    run_mixed_scenario(mixed_config(tiny_model, tokenizer, engine="paged", device="cpu"), start_cluster,
                       tmp_path / "logs")

