"""Unmodified SGLang as a bench system: its own server, radix cache on, sent the prompts Tessera builds.

``tessera bench --systems sglang`` starts ``python -m sglang.launch_server`` afresh for every
run (no run inherits another's radix cache), on the generation nodes' model, device and cores
(``[model]``), in SGLang's dtype and attention backend (``[sglang]``). Each request's units are
rendered into its messages as text where Tessera's prompt builder places them
(:func:`tessera.retrieval.prompt.text_placement`); a workload whose units come from retrieval
has them retrieved once, in process, by the same unit store the retrieval role runs. So SGLang
sees the very prompt text Tessera composes, and reuses what its prefix cache can.

SGLang must be importable by this interpreter (docs/sglang.md); this module never imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.benchmark.endpoints import Endpoint
from tessera.benchmark.workloads import BenchRequest, Workload
from tessera.config import ClusterConfig
from tessera.engines.checkpoint import resolve
from tessera.engines.sglang.runner import sglang_missing
from tessera.errors import ConfigError
from tessera.ports import bind_listener

# the system name of unmodified SGLang in ``tessera bench --systems``
BASELINE_SYSTEM = "sglang"
# the name the baseline serves under; the bench sends it as every request's "model"
SERVED_NAME = "sglang-baseline"
# how requests are sent: as ``tessera bench --url`` sends any OpenAI-compatible server (the URL is per run)
ENDPOINT = Endpoint(BASELINE_SYSTEM, "", "openai", SERVED_NAME)
# a cold start loads the model and builds SGLang's kernels' workspaces: minutes on a busy host
START_DEADLINE_S = 900.0
STOP_GRACE_S = 30.0


def cores(config: ClusterConfig) -> int:
    """The cores Tessera's generation nodes use together: the baseline gets the same."""
    return config.model.threads * len(config.generation)


def launch_argv(config: ClusterConfig, model_path: Path, port: int) -> list[str]:
    """``launch_server``'s command line: one process, every core of the generation nodes."""
    s = config.sglang
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--served-model-name", SERVED_NAME, "--device", config.model.device,
            "--attention-backend", s.attention_backend, "--dtype", s.dtype, "--tp-size", "1",
            "--max-total-tokens", str(s.max_total_tokens), "--host", "127.0.0.1", "--port", str(port),
            *shlex.split(s.extra_args)]


def launch_env(config: ClusterConfig) -> dict[str, str]:
    env = dict(os.environ)
    if config.model.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang picks its CPU platform from this
        # the generation nodes' cores, no more: SGLang would otherwise bind every core of the NUMA node
        env["SGLANG_CPU_OMP_THREADS_BIND"] = f"0-{cores(config) - 1}"
    env.setdefault("HF_HUB_OFFLINE", "1")  # the checkpoint is a local directory
    return env


class UnitTexts:
    """Each request's unit texts: its own, or those the retrieval role's store retrieves for it."""

    def __init__(self, config: ClusterConfig, workload: Workload) -> None:
        self._texts: dict[int, tuple[str, ...]] = {}
        retrieving = [r for r in workload.requests if r.retrieval is not None]
        if retrieving:
            from tessera.benchmark.render import PromptRenderer

            renderer = PromptRenderer(config)
            renderer.ingest(workload)
            self._texts = {id(r): tuple(u.text for u in renderer.units(r)) for r in retrieving}

    def of(self, req: BenchRequest) -> tuple[str, ...]:
        return self._texts.get(id(req), req.context_units)


@dataclass
class SGLangServer:
    """A fresh unmodified SGLang server per run (a bench :class:`~tessera.benchmark.targets.Target`)."""

    config: ClusterConfig
    units: UnitTexts
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def description(self) -> dict[str, Any]:
        s = self.config.sglang
        return {"server": "sglang.launch_server", "radix_cache": True, "dtype": s.dtype,
                "attention_backend": s.attention_backend, "device": self.config.model.device,
                "cores": cores(self.config), "max_total_tokens": s.max_total_tokens, "extra_args": s.extra_args}

    @property
    def counters(self) -> dict[str, float]:
        return {}  # unmodified SGLang keeps no shared tier

    def body_of(self, req: BenchRequest, max_tokens: int) -> dict[str, Any]:
        """The plain OpenAI body ``--url`` sends any server, with this request's units as text."""
        return ENDPOINT.body(dataclasses.replace(req, context_units=self.units.of(req)), max_tokens)

    @asynccontextmanager
    async def open(self, log_dir: Path, progress: bool) -> AsyncIterator[str]:
        log_dir.mkdir(parents=True, exist_ok=True)
        server = await asyncio.to_thread(Server.start, self.config, log_dir / "sglang.log")
        try:
            yield server.url
        finally:
            await asyncio.to_thread(server.stop)


class Server:
    """One ``launch_server`` process group on a free loopback port, logging to ``log``."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    @classmethod
    def start(cls, config: ClusterConfig, log: Path, deadline_s: float = START_DEADLINE_S) -> Server:
        with bind_listener("127.0.0.1", 0, "sglang baseline") as sock:
            port = int(sock.getsockname()[1])
        with open(log, "wb") as out:
            proc = subprocess.Popen(launch_argv(config, resolve(config.model).path, port), stdout=out,
                                    stderr=subprocess.STDOUT, env=launch_env(config), start_new_session=True)
        server = cls(proc, f"http://127.0.0.1:{port}", log)
        try:
            server._wait_ready(deadline_s)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self, deadline_s: float) -> None:
        """Until the server lists its model; stops at once, with its log's last line, if it exits."""
        deadline = time.monotonic() + deadline_s
        while True:
            with contextlib.suppress(OSError, urllib.error.URLError), \
                    urllib.request.urlopen(self.url + "/v1/models", timeout=2.0) as resp:
                if resp.status == 200:
                    return
            if self.proc.poll() is not None:
                raise ConfigError(f"SGLang's server exited with code {self.proc.returncode} before it served: "
                                  f"{last_line(self.log)} (log {self.log})")
            if time.monotonic() > deadline:
                raise ConfigError(f"SGLang's server did not serve within {deadline_s:.0f} s: {last_line(self.log)} "
                                  f"(log {self.log})")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the whole group (SGLang's scheduler and detokenizer are children), then SIGKILL."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # children that outlived their parent
        self.proc.wait()


def last_line(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return lines[-1] if lines else "(empty log)"


def sglang_target(config: ClusterConfig, workload: Workload,
                   headers: Mapping[str, str] | None = None) -> SGLangServer:
    """The baseline's target for this workload (units retrieved once, up front, where it retrieves)."""
    if (why := sglang_missing()) is not None:
        raise ConfigError(why)
    return SGLangServer(config, UnitTexts(config, workload), dict(headers or {}))
