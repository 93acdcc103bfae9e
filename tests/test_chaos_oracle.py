"""The chaos verifier's oracle: exact tokens on float32, a bounded near-tie on half precision."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers.cluster import cluster_config

from tessera.engines.tiny import write_tiny_checkpoint
from tessera_lab.chaos.harness import HALF_PRECISION_TIE, Oracle

TRACE = {"tokens": [5, 17, 9, 33, 41, 8, 12, 60, 22, 7, 3, 19], "units": [[2, 7]]}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Oracle:
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("oracle") / "llama", "llama", seed=7)
    return Oracle(cluster_config(str(model), nodes=1))


def test_the_offline_greedy_tokens_fall_short_of_nothing(oracle: Oracle) -> None:
    tokens = oracle.tokens(TRACE, 5)
    assert len(tokens) == 5 and oracle.shortfall(TRACE, tokens) == 0.0


def test_a_token_that_is_not_the_argmax_falls_short_by_its_logit_gap(oracle: Oracle) -> None:
    """A served token other than the offline argmax is measured by how far its logit lies below it:
    what separates a near-tie of bfloat16 kernels from a wrong state."""
    tokens = oracle.tokens(TRACE, 3)
    wrong = [tokens[0], (tokens[1] + 1) % 64, tokens[2]]
    assert oracle.shortfall(TRACE, wrong) > 0.0


def test_only_a_half_precision_engine_is_granted_a_tie(tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "llama", "llama", seed=7)
    cfg = cluster_config(str(model), nodes=1)
    assert Oracle(cfg).tie == 0.0
    half = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))
    assert Oracle(half).tie == HALF_PRECISION_TIE
