"""The SGLang engine's pure parts: masked attention, the batch's kernel metadata, its settings.

These need neither SGLang nor a model; the engine itself is tested in test_sglang_engine.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from tessera.config_file import load_config
from tessera.engines.sglang.attention import Batch, Seq, masked_attention, prepare, runs
from tessera.engines.sglang.runner import RunnerSpec, cpu_bind, sglang_missing
from tessera.errors import ConfigError


def _naive(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int],
           scaling: float) -> torch.Tensor:
    """Attention one query and one head at a time, in float64: key j visible iff j <= the query's position."""
    hq = q.shape[1]
    hk = keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, p in enumerate(positions):
        for h in range(hq):
            kh = h // (hq // hk)
            scores = (keys[:p + 1, kh].double() @ q[i, h].double()) * scaling
            out[i, h] = torch.softmax(scores, dim=0) @ values[:p + 1, kh].double()
    return out


def test_masked_attention_shows_each_query_only_the_keys_at_or_before_its_position() -> None:
    torch.manual_seed(0)
    keys, values = torch.randn(40, 3, 16), torch.randn(40, 3, 16)
    q = torch.randn(5, 9, 16)
    positions = [2, 3, 17, 30, 39]  # scattered, as EPIC's recompute ranges and a suffix are
    out = masked_attention(q, keys, values, positions, 0.25)
    torch.testing.assert_close(out.double(), _naive(q, keys, values, positions, 0.25), atol=1e-5, rtol=1e-5)
    # a key past every query's position changes nothing; one before the first query changes all
    later = keys.clone()
    later[35:] += 5.0
    # (same shapes on both sides: a kernel may block a different number of queries differently)
    first = masked_attention(q[:3], keys, values, positions[:3], 0.25)
    assert torch.equal(masked_attention(q[:3], later, values, positions[:3], 0.25), first)
    earlier = keys.clone()
    earlier[0] += 5.0
    assert not torch.allclose(masked_attention(q, earlier, values, positions, 0.25), out)


def test_scattered_positions_split_into_runs_of_consecutive_positions() -> None:
    assert runs([3, 4, 5, 9, 10, 20]) == [(0, 3), (3, 5), (5, 6)]
    assert runs([7]) == [(0, 1)]
    assert runs([]) == []


def test_a_batch_writes_only_requests_and_gives_the_kernel_every_run_with_its_prefix() -> None:
    locs_a = torch.arange(100, 140)
    locs_b = torch.arange(200, 260)
    seqs = [Seq("unit", 0, [0, 1, 2, 3]),
            Seq("tail", 4, [30, 31, 32], req_idx=5, locs=locs_a),
            # one request recomputing positions 3..4 and its suffix at 50, in one forward
            Seq("tail", 7, [3, 4], req_idx=6, locs=locs_b),
            Seq("tail", 9, [50], req_idx=6, locs=locs_b)]
    batch = Batch(seqs)
    prepare(batch, kernels=True)
    # K/V of the requests' tokens go to their positions' locations; the unit writes none
    assert batch.write_rows is not None and batch.write_rows.tolist() == [4, 5, 6, 7, 8, 9]
    assert batch.write_locs is not None and batch.write_locs.tolist() == [130, 131, 132, 203, 204, 250]
    # each run is an extend over the prefix below it: the unit has none, the suffix sees 0..49
    m = batch.kernel_meta
    assert m["req_pool_indices"].tolist() == [0, 5, 6, 6]
    assert m["seq_lens"].tolist() == [4, 33, 5, 51]
    assert m["extend_seq_lens"].tolist() == [4, 3, 2, 1]
    assert m["extend_start_loc"].tolist() == [0, 4, 7, 9]
    assert m["max_extend_len"] == 4
    # without kernels nothing is the kernel's
    portable = Batch([dataclasses.replace(s) for s in seqs])
    prepare(portable, kernels=False)
    assert not portable.kernel_meta


def test_sglang_settings_are_checked_before_sglang_is_touched() -> None:
    base = load_config()
    cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, engine="sglang", dtype="float32"))
    with pytest.raises(ConfigError, match=r'model\.dtype = "bfloat16"'):
        RunnerSpec.of(cfg, Path("/m"), 2048)
    allowed = sorted(os.sched_getaffinity(0))
    assert cpu_bind(1) == str(allowed[0])
    with pytest.raises(ConfigError, match=r"model\.threads"):
        cpu_bind(len(allowed) + 1)
    why = sglang_missing()
    assert why is None or "docs/sglang.md" in why
