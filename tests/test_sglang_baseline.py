"""Unmodified SGLang as a bench system (``tessera bench --systems sglang``).

The pure checks (its command line, cores, the prompt it is sent, the refusal without SGLang)
run everywhere; the run against a real SGLang server skips, saying why, where this interpreter
cannot import ``sglang`` (docs/sglang.md says how to install it).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.cluster import REPO, child_env, cluster_config, write_config

from tessera.benchmark import sweep
from tessera.benchmark.options import LoadOptions
from tessera.benchmark.runner import system_config
from tessera.benchmark.sglang import (
    SERVED_NAME,
    SGLangServer,
    UnitTexts,
    cores,
    launch_argv,
    launch_env,
)
from tessera.benchmark.sweep import SweepOptions, run_sweep
from tessera.benchmark.workloads import BenchRequest, Workload, WorkloadName
from tessera.config import ClusterConfig, ModelConfig, SGLangConfig
from tessera.engines.sglang.runner import sglang_missing
from tessera.errors import ConfigError
from tessera.retrieval.prompt import text_placement

MISSING = sglang_missing()


def _config(threads: int = 1, nodes: int = 2, **sglang: Any) -> ClusterConfig:
    cfg = cluster_config("smollm2", nodes=nodes)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, threads=threads),
                               sglang=SGLangConfig(**sglang))


def test_the_baseline_gets_the_generation_nodes_cores_model_and_sglang_settings() -> None:
    """One launch_server process: the [sglang] dtype, backend, pool and extra flags, bound to the nodes' cores."""
    cfg = _config(threads=2, nodes=2, dtype="bfloat16", attention_backend="intel_amx", max_total_tokens=4096,
                  extra_args="--chunked-prefill-size 2048 --disable-overlap-schedule")
    argv = launch_argv(cfg, Path("/models/m"), 31234)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = dict(zip(argv[3:-3:2], argv[4:-3:2], strict=True))  # Tessera's own flags, then extra_args
    assert flags == {"--model-path": "/models/m", "--served-model-name": SERVED_NAME, "--device": "cpu",
                     "--attention-backend": "intel_amx", "--dtype": "bfloat16", "--tp-size": "1",
                     "--max-total-tokens": "4096", "--host": "127.0.0.1", "--port": "31234"}
    assert argv[-3:] == ["--chunked-prefill-size", "2048", "--disable-overlap-schedule"]
    assert cores(cfg) == 4
    env = launch_env(cfg)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0-3" and env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_sglang_settings_are_checked_when_the_config_is_built() -> None:
    """A dtype SGLang does not know or unbalanced shell words are refused, naming the key."""
    with pytest.raises(ConfigError, match=r"sglang\.dtype"):
        SGLangConfig(dtype="int4")
    with pytest.raises(ConfigError, match=r"sglang\.extra_args"):
        SGLangConfig(extra_args="--x 'unclosed")


def test_the_baseline_is_sent_the_units_as_text_where_the_prompt_builder_places_them() -> None:
    """SGLang's body carries the same units, as text, at the same place as Tessera's prompt."""
    req = BenchRequest(messages=({"role": "user", "content": "Which code opens the vault?"},), stream="s",
                       context_units=("The vault code is 7421.", "The museum opens at nine."), placement="user")
    server = SGLangServer(_config(), UnitTexts(_config(), Workload("w", [], [req], "")))
    body = server.body_of(req, 8)
    assert body == {"model": SERVED_NAME, "max_tokens": 8, "temperature": 0.0,
                    "messages": text_placement(req.messages, req.context_units, "user")}
    assert "The vault code is 7421." in json.dumps(body["messages"])


def test_asking_for_the_baseline_without_sglang_fails_before_any_load(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """Without SGLang, --systems sglang stops at once with how to install it, before any cluster starts."""
    monkeypatch.setattr(sweep, "sglang_missing", lambda: "SGLang is not installed for python: see docs/sglang.md")
    load = LoadOptions(workload=WorkloadName.synthetic, systems="prefix,sglang", rates="1", rates_for=(), requests=4,
                       warmup=0.5, unloaded=0, max_tokens=1, zipf=1.0, top_k=None, unit_words=40, placement="system",
                       conversations=0, data_dir=None, seed=0, drain_warmup=True, trace=None, time_scale=1.0)
    opts = SweepOptions(load=load, out=tmp_path, dump_trace=False, trace_only=False, saturation=10.0, fidelity=0)
    with pytest.raises(ConfigError, match="SGLang is not installed"):
        run_sweep(_config(), opts)


def test_a_system_runs_on_the_engine_its_name_gives() -> None:
    """`tessera@sglang` is the tessera system on SGLang's runner, in the baseline's dtype; unknown parts are named."""
    cfg = _config()
    on_sglang = system_config(cfg, "tessera@sglang")
    assert (on_sglang.model.engine, on_sglang.model.dtype) == ("sglang", cfg.sglang.dtype)
    assert on_sglang.control == system_config(cfg, "tessera").control
    assert system_config(cfg, "prefix@reference").model == cfg.model
    # SGLang's kernels bind cores: each node gets its own (the reference engine's nodes are left as they are)
    assert [n.cpus for n in on_sglang.generation] == ["0-0", "1-1"]
    assert [n.cpus for n in system_config(cfg, "tessera").generation] == ["", ""]
    for bad in ("tessera@nope", "nope@sglang", "tessera@"):
        with pytest.raises(ConfigError, match="sglang"):
            system_config(cfg, bad)


@pytest.mark.integration
@pytest.mark.skipif(MISSING is not None, reason=f"needs SGLang: {MISSING}")
def test_tessera_bench_runs_unmodified_sglang_beside_tessera(tmp_path: Path) -> None:
    """`tessera bench --systems sglang,tessera@sglang,tessera`: unmodified SGLang on its own server, Tessera on
    SGLang's runner and Tessera on the reference engine answer every measured request, in one report."""
    cfg = dataclasses.replace(cluster_config("smollm2", nodes=1), model=ModelConfig(source="smollm2"),
                              sglang=SGLangConfig(max_total_tokens=8192))
    path = write_config(tmp_path, cfg)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "tessera", "bench", "--workload", "synthetic", "--systems",
                           "sglang,tessera@sglang,tessera", "--requests", "6", "--rates", "1", "--unloaded", "0",
                           "--config", str(path), "--out", str(out)], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    report = json.loads((out / "bench.json").read_text())
    for system in ("sglang", "tessera@sglang", "tessera"):
        (run,) = report["systems"][system]["runs"]
        assert (run["ok"], run["requests"]) == (3, 3), (system, run)
    assert report["systems"]["tessera@sglang"]["config"]["engine"] == "sglang"
    assert report["systems"]["tessera@sglang"]["config"]["dtype"] == "bfloat16"
    assert report["systems"]["tessera"]["config"]["engine"] == "reference"
    assert report["systems"]["sglang"]["config"]["server"] == "sglang.launch_server"
    assert re.search(r"^\| sglang \| 1 \| \d+\.\d{3} ", done.stdout, re.M), done.stdout
    log = (out / "logs-sglang-1" / "sglang.log").read_text()
    assert "POST /v1/chat/completions" in log, log[-2000:]
