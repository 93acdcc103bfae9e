"""bench/gpu.py on CPU: its arguments, and that every section measures the policy its config serves.

The figures themselves need a GPU (bench/gpu.sh); these checks run the script's CPU-importable
parts on the tiny checkpoint, so a policy the bench cannot build fails here, not on the GPU machine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers.cluster import REPO

from tessera.composition.policies import CompositionPolicy, policy_from_config, policy_names
from tessera.config_file import load_config


@pytest.fixture(scope="module")
def gpu_bench() -> Iterator[ModuleType]:
    """bench/gpu.py imported as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def overlay(tmp_path: Path, composition: str) -> Path:
    """A config over bench/gpu.toml whose [composition] table is ``composition``."""
    path = tmp_path / "policy.toml"
    path.write_text(f'base = "{REPO / "bench" / "gpu.toml"}"\n[composition]\n{composition}\n')
    return path


def test_the_default_config_is_bench_gpu_toml(gpu_bench: ModuleType) -> None:
    """Without --config the sections run bench/gpu.toml, all three of them."""
    args = gpu_bench.parse_args([])
    assert args.config == REPO / "bench" / "gpu.toml" and args.sections == "prefill,ttft,sweep"
    assert gpu_bench.setup(args).config == load_config(REPO / "bench" / "gpu.toml")


def test_cpu_smoke_runs_the_chosen_config_on_cpu(gpu_bench: ModuleType, tmp_path: Path) -> None:
    """--cpu-smoke shrinks the shapes to CPU sizes but keeps the config's composition settings."""
    path = overlay(tmp_path, 'policy = "epic"\nrecompute_fraction = 0.5\ninline_share = 0.9')
    s = gpu_bench.setup(gpu_bench.parse_args(["--cpu-smoke", "--config", str(path)]))
    assert (s.config.model.device, s.config.model.source) == ("cpu", "random:tiny")
    assert s.config.composition == load_config(path).composition
    policy = gpu_bench.served_policy(s.config)
    assert (policy.k, policy.fraction, policy.inline_share) == (16, 0.5, 0.9)  # type: ignore[attr-defined]


def test_an_unknown_section_is_refused_naming_the_known_ones(gpu_bench: ModuleType,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--sections prefil exits with a usage error that lists prefill, ttft and sweep."""
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--sections", "prefil,ttft"])
    assert "unknown section(s) prefil; expected some of prefill, ttft, sweep" in capsys.readouterr().err


@pytest.mark.parametrize("name", policy_names())
def test_the_prefill_section_composes_with_the_served_policy(gpu_bench: ModuleType, tiny_model: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             name: str) -> None:
    """Regression: the bench built its own policies, EPIC with k only (not the served
    fraction and inline share) and, for the ttft floor, naive and full with a k they refuse."""
    path = overlay(tmp_path, f'policy = "{name}"')
    served = policy_from_config(load_config(path).composition)
    s = gpu_bench.setup(gpu_bench.parse_args(["--cpu-smoke", "--config", str(path)]))
    model = dataclasses.replace(s.config.model, source=str(tiny_model), kv_pool_tokens=4096)
    s = dataclasses.replace(s, config=dataclasses.replace(s.config, model=model), lengths=[400], repeats=1,
                            engines=("reference",))
    used: list[CompositionPolicy] = []
    real_compose = gpu_bench.compose

    def recording_compose(engine: Any, layout: Any, policy: CompositionPolicy, *args: Any, **kw: Any) -> Any:
        used.append(policy)
        return real_compose(engine, layout, policy, *args, **kw)

    monkeypatch.setattr(gpu_bench, "compose", recording_compose)
    gpu_bench.section_prefill(s, tmp_path)
    assert used and all(type(p) is type(served) and vars(p) == vars(served) for p in used)
    written = json.loads((tmp_path / "prefill.json").read_text())
    assert written["composition"] == dataclasses.asdict(load_config(path).composition)
    [row] = written["rows"]
    assert row["engine"] == "reference" and row["units"] == 1 and row["composed_host_s"] > 0


def _pypi_reachable() -> bool:
    import socket

    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _pypi_reachable(), reason="bench/gpu.sh prepare downloads wheels: pypi.org is unreachable")
def test_gpu_sh_prepare_fills_dot_gpu_with_what_the_gpu_machine_lacks_within_the_carry_limit(tmp_path: Path) -> None:
    """`bench/gpu.sh prepare` (docs/gpu.md's first GPU step, run here): cp312 wheels of the four packages
    the GPU machine lacks, SmolLM2's config and tokenizer without weights, a float16 embedder, LoCoMo
    when the data sets are there; all of it under the device tool's 64 MiB carry limit."""
    import shutil
    import subprocess

    from safetensors import safe_open

    (tmp_path / "bench").mkdir()
    shutil.copy(REPO / "bench" / "gpu.sh", tmp_path / "bench" / "gpu.sh")  # it writes .gpu/ beside bench/
    data = REPO.parent / "shared" / "data"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "TESSERA_DATA": str(data)}
    done = subprocess.run(["bash", str(tmp_path / "bench" / "gpu.sh"), "prepare"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    gpu = tmp_path / ".gpu"
    wheels = sorted(p.name.split("-")[0].lower() for p in (gpu / "whl").glob("*.whl"))
    assert wheels == ["gguf", "orjson", "pytest_asyncio", "usearch"], wheels
    assert all("cp312" in p.name or "py3-none" in p.name for p in (gpu / "whl").glob("*.whl"))
    assert (gpu / "smollm2" / "config.json").is_file() and (gpu / "smollm2" / "tokenizer.json").is_file()
    assert not list((gpu / "smollm2").glob("*.gguf")) and not list((gpu / "smollm2").glob("*.safetensors"))
    (weights,) = (gpu / "site").rglob("model.safetensors")
    with safe_open(str(weights), "pt") as f:
        floats = [f.get_slice(k).get_dtype() for k in f.keys()]  # noqa: SIM118 (safe_open is not iterable)
    assert floats and all(d in ("F16", "I64") for d in floats), set(floats)
    assert (gpu / "data" / "locomo" / "locomo10.json").is_file() == (data / "locomo" / "locomo10.json").is_file()
    size = sum(p.stat().st_size for p in gpu.rglob("*") if p.is_file())
    assert size < 64 << 20, f".gpu is {size / 2**20:.1f} MiB: over the device tool's carry limit"
