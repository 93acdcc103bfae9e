"""The flags of :class:`~tessera.benchmark.options.LoadOptions`, declared once for every command.

``tessera bench`` measures a load on real clusters and ``tessera simulate`` replays the same
load on simulated ones, so both take the same flags, with the same names and defaults except
the default workload. :func:`with_load_flags` gives a command those flags: the command's first
parameter is ``load: LoadOptions``, and typer sees the flags in its place.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from tessera.benchmark.options import LoadOptions
from tessera.benchmark.workloads import WorkloadName

R = TypeVar("R")


def _flags(workload: WorkloadName) -> list[inspect.Parameter]:
    """The load flags in ``LoadOptions``' field order; ``workload`` is the command's default."""
    def flag(name: str, kind: Any, default: Any, help: str) -> inspect.Parameter:
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                 annotation=Annotated[kind, typer.Option(help=help)])

    return [
        flag("workload", WorkloadName, workload, "rag (MuSiQue), locomo (agent memory) or synthetic."),
        flag("systems", str, "prefix,tessera",
             "Comma-separated: prefix, C+S, C+S+R, C+S+A, tessera, each optionally on another engine "
             "(tessera@sglang: Tessera on SGLang's model runner), and sglang (unmodified SGLang: docs/sglang.md)."),
        flag("rates", str, "0.1,0.2,0.4", "Comma-separated aggregate request rates (req/s)."),
        flag("rates_for", list[str] | None, None,
             "SYSTEM=R1,R2,...: this system's own rates instead of --rates (repeatable), e.g. "
             "tessera=1.5,2,2.5,3 to sweep each system where its curve bends."),
        flag("requests", int, 60, "Requests per run (the first --warmup share warms up)."),
        flag("warmup", float, 0.5, "Share of each run's requests excluded as warm-up."),
        flag("unloaded", int, 5, "Requests run one at a time for the unloaded TTFT (0: skip)."),
        flag("max_tokens", int, 1, "Output tokens per request."),
        flag("zipf", float, 1.0, "Zipf exponent of query/unit popularity."),
        flag("top_k", int | None, None, "Units per request (default: rag 5, locomo 6, synthetic 5)."),
        flag("unit_words", int, 0, "Truncate units to this many words (0: keep; synthetic: length)."),
        flag("placement", str, "user", "locomo: user (OpenViking style) or system (Mem0 style)."),
        flag("conversations", int, 0, "locomo: use the first N conversations (0: all 10)."),
        flag("data_dir", Path | None, None, "Folder with musique/ and locomo/ (default ../shared/data)."),
        flag("seed", int, 0, "Seed of the workload and the arrivals."),
        flag("drain_warmup", bool, True,
             "Start the measured requests once the warm-up requests have finished (steady state, no cold-start "
             "backlog)."),
        flag("trace", Path | None, None,
             "Replay this traffic trace (JSONL, see docs/bench/traces.md) instead of --workload."),
        flag("time_scale", float, 1.0, "--trace: multiply recorded arrival times by this (0.5 replays twice as fast)."),
    ]


def with_load_flags(workload: WorkloadName) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorate a command ``f(load: LoadOptions, *, own flags...)``: the result takes the load flags
    (``workload`` as the default workload) and the command's own, and calls ``f`` with one
    ``LoadOptions``. Apply it below ``@app.command()``."""
    flags = _flags(workload)
    assert [p.name for p in flags] == list(LoadOptions.__dataclass_fields__), "a LoadOptions field has no flag"

    def decorate(command: Callable[..., R]) -> Callable[..., R]:
        # eval_str: typer reads each parameter's typer.Option out of its (evaluated) annotation
        own = list(inspect.signature(command, eval_str=True).parameters.values())
        assert own and own[0].name == "load", f"{command.__name__}'s first parameter must be load: LoadOptions"
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[1:]]

        @functools.wraps(command)
        def run(**given: Any) -> R:
            values = {p.name: given.pop(p.name) for p in flags}
            values["rates_for"] = tuple(values["rates_for"] or ())
            return command(LoadOptions(**values), **given)

        params = [*flags, *own]
        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate
