"""``bench/cpu_profile.py``: where a role's CPU goes, staged by the code on each sampled stack.

The staging rules are pure logic over py-spy's folded stacks and are checked on stacks written
the way py-spy writes them; the docs' command itself (a real cluster, real py-spy) is run with
tiny parameters in ``test_readme_smoke.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from helpers.cluster import REPO


@pytest.fixture(scope="module")
def profile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_cpu_profile", REPO / "bench" / "cpu_profile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stack(*frames: str) -> list[str]:
    return ["_bootstrap (threading.py:1002)", *frames]


def test_a_call_under_a_placement_is_the_placements_even_where_the_model_has_the_same_code(
        profile: ModuleType) -> None:
    rope = "rotate_into (tessera/kernels/rope.py:89)"
    placed = _stack("EngineWorker._timed (tessera/generation/scheduler.py:87)",
                    "place_units (tessera/engines/offline.py:41)",
                    "ReferenceEngine.place (tessera/engines/reference.py:106)", rope)
    forward = _stack("ReferenceEngine.step (tessera/engines/reference.py:140)",
                     "Model.attention_inputs (tessera/engines/model.py:145)", rope)
    assert profile.stage_of(placed) == "placement"
    assert profile.stage_of(forward) == "engine forward"


def test_a_library_call_counts_toward_the_tessera_code_that_made_it(profile: ModuleType) -> None:
    seal = _stack("KVPoolClient.store.<locals>.<lambda> (tessera/generation/pool_client.py:155)",
                  "encode_unit (tessera/transport/unit_blocks.py:51)",
                  "block_mac (tessera/transport/blocks.py:90)", "HMAC.update (hmac.py:120)")
    verify = _stack("KVPoolClient.fetch.<locals>.<lambda> (tessera/generation/pool_client.py:111)",
                    "decode_unit (tessera/transport/unit_blocks.py:72)", "HMAC.update (hmac.py:120)")
    norm = _stack("Model._norm (tessera/engines/model.py:78)", "rms_norm (torch/nn/functional.py:3006)")
    assert profile.stage_of(seal) == "writeback"
    assert profile.stage_of(verify) == "fetch"
    assert profile.stage_of(norm) == "engine forward"


def test_http_and_the_event_loop_are_their_own_stages_and_unknown_code_is_other(profile: ModuleType) -> None:
    write = _stack("Reply.stream.<locals>.send (tessera/retrieval/chat/reply.py:188)",
                   "StreamWriter.write (aiohttp/http_writer.py:203)")
    loop = _stack("run (tessera/runtime.py:49)", "Runner.run (asyncio/runners.py:118)")
    assert profile.stage_of(write) == "http"
    assert profile.stage_of(loop) == "event loop"
    assert profile.stage_of(_stack("_worker (concurrent/futures/thread.py:81)")) == "other"
    assert profile.stage_of(_stack("plan (tessera/control/planner.py:10)")) == "plan+route"


def test_folded_stacks_are_counted_by_stage_and_a_cpu_total_split_in_their_proportions(
        profile: ModuleType, tmp_path: Path) -> None:
    folded = tmp_path / "x.folded"
    folded.write_text("a (tessera/engines/model.py:1);b (torch/x.py:2) 30\n"
                      "a (tessera/control/plane.py:1) 10\n"
                      "garbage line without a count\n")
    stages = profile.read_folded(folded)
    assert stages == {"engine forward": 30, "plan+route": 10}
    assert profile.stage_split(80.0, stages) == {"engine forward": 60.0, "plan+route": 20.0}
    assert profile.read_folded(tmp_path / "missing.folded") == {}
    assert profile.stage_split(5.0, profile.read_folded(tmp_path / "missing.folded")) == {}
