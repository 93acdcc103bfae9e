"""SGLang's model runner, built in this process for a Tessera generation node.

The runner is SGLang's own ``ModelRunner``: its model code and kernels, its KV pool and its
request-to-token table, built the way SGLang's single-batch benchmark builds it (no
scheduler, no tokenizer process, no radix cache): Tessera's node schedules, and
:mod:`tessera.engines.sglang.engine` drives the runner's model one forward at a time.

Everything here imports SGLang lazily, so the rest of Tessera imports without it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.config import ClusterConfig
from tessera.errors import ConfigError

log = logging.getLogger(__name__)

# SGLang's CPU kernels compute in these; float32 has no kernel there
KERNEL_DTYPES = ("bfloat16", "float16")
# SGLang sizes its pool from a share of free memory, capped by max_total_tokens (which Tessera
# always gives); the share only has to pass SGLang's check, which nodes loading side by side
# on one host fail at small shares (each sees the other's weights arrive)
MEMORY_FRACTION = 0.9


def sglang_missing() -> str | None:
    """Why this interpreter cannot run SGLang (the engine or the bench baseline), or None when it can."""
    if importlib.util.find_spec("sglang") is None:
        return (f"SGLang is not installed for {sys.executable}: install it into this environment (docs/sglang.md "
                "says how and which version was tested) to use model.engine = \"sglang\" or the sglang baseline")
    return None


@dataclass(frozen=True)
class RunnerSpec:
    """What the runner is built from: the generation node's ``[model]`` and ``[sglang]`` sections."""

    model_path: Path
    device: str
    dtype: str
    attention_backend: str
    max_total_tokens: int
    context_length: int
    max_requests: int
    threads: int

    @classmethod
    def of(cls, cfg: ClusterConfig, model_path: Path, context_length: int) -> RunnerSpec:
        if cfg.model.device == "cpu" and cfg.model.dtype not in KERNEL_DTYPES:
            raise ConfigError(f"model.engine = \"sglang\" on CPU computes in bfloat16 or float16 (SGLang's CPU "
                              f"kernels have no {cfg.model.dtype}); set model.dtype = \"bfloat16\"")
        return cls(model_path, cfg.model.device, cfg.model.dtype, cfg.sglang.attention_backend,
                   cfg.sglang.max_total_tokens, context_length, cfg.sglang.max_requests, cfg.model.threads)


def cpu_bind(threads: int) -> str:
    """The cores this process's kernels run on: the first ``threads`` of its affinity mask.

    SGLang binds its OpenMP threads itself (every core of the NUMA node unless told); a node
    gets exactly ``model.threads`` cores, and nodes sharing a host are given disjoint cores
    by starting each under its own affinity mask (``taskset``)."""
    allowed = sorted(os.sched_getaffinity(0))
    if threads > len(allowed):
        raise ConfigError(f"model.threads = {threads} but this process may run on {len(allowed)} cores "
                          f"({allowed}); lower model.threads or widen the affinity mask")
    return ",".join(str(c) for c in allowed[:threads])


def build_runner(spec: RunnerSpec) -> Any:
    """SGLang's ``ModelRunner`` with the model loaded, its pools allocated and attention set up."""
    if (why := sglang_missing()) is not None:
        raise ConfigError(why)
    with warnings.catch_warnings():
        # SGLang warns at import about every platform feature this device lacks (AWQ, GGUF on CUDA)
        warnings.filterwarnings("ignore", module=r"sglang(\.|$)")
        return _build(spec)


def _build(spec: RunnerSpec) -> Any:
    if spec.device == "cpu":
        # SGLang selects its CPU platform from this; the kernels bind to these cores
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_bind(spec.threads)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import PortArgs, ServerArgs

    server_args = ServerArgs(
        model_path=str(spec.model_path), device=spec.device, attention_backend=spec.attention_backend,
        dtype=spec.dtype, tp_size=1, mem_fraction_static=MEMORY_FRACTION, max_total_tokens=spec.max_total_tokens,
        context_length=spec.context_length, max_running_requests=spec.max_requests,
        chunked_prefill_size=-1, disable_radix_cache=True, disable_cuda_graph=True,
        disable_overlap_schedule=True, skip_tokenizer_init=True, log_level="warning", random_seed=0)
    initialize_moe_config(server_args)
    initialize_fp8_gemm_config(server_args)
    initialize_fp4_gemm_config(server_args)
    ps = ParallelState.trivial(dp_rank=None, moe_dp_rank=None)
    port_args = PortArgs.init_new(server_args)
    runner = ModelRunner(model_config=ModelConfig.from_server_args(server_args),
                         mem_fraction_static=server_args.mem_fraction_static, gpu_id=0, ps=ps,
                         nccl_port=port_args.nccl_port, server_args=server_args)
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    log.info("SGLang runner: %s, %s on %s, KV pool of %d tokens", type(runner.model).__name__, spec.dtype,
             spec.device, runner.max_total_num_tokens)
    return runner
