"""The paged engine behind a real generation node (CPU): the served path equals offline composition."""

from __future__ import annotations

from pathlib import Path

from mixed_support import mixed_config, run_mixed_scenario

from tessera.engines.checkpoint import Checkpoint
from tessera.engines.tiny import write_tiny_checkpoint
from tessera.engines.tokenizer import load_tokenizer


def test_paged_engine_serves_local_remote_and_missing_units_like_offline(tmp_path: Path) -> None:
    """model.engine = "paged": a request mixing a local hit, a remote hit and a miss returns offline's tokens."""
    model = write_tiny_checkpoint(tmp_path / "llama", "llama", seed=3)
    tokenizer = load_tokenizer(Checkpoint(model, "tiny", "x"))
    run_mixed_scenario(mixed_config(model, tokenizer, engine="paged", device="cpu"), tmp_path / "logs")

