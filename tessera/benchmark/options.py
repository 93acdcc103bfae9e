"""Comma-separated option values of the ``tessera`` commands, and how a command prints a line.

The commands' run functions (:mod:`~tessera.benchmark.sweep`, :mod:`~tessera.benchmark.verify_run`,
...) take their options as typed on the command line and parse the lists here. A bad value
raises :class:`OptionError` (a malformed list, named by its flag) or :class:`ConfigError` (a
value the command cannot use); the CLI prints either as one line and exits 2.
:class:`LoadOptions` is the load ``tessera bench`` and ``tessera simulate`` share; its flags are
declared once, in :mod:`~tessera.benchmark.load_flags`. This module knows nothing of typer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from tessera.benchmark.workloads import Workload, WorkloadName, select_workload
from tessera.errors import ConfigError


class OptionError(ConfigError):
    """A comma-separated option value does not parse; the message names the flag (printed as ``tessera: ...``)."""


def say(line: str = "", *, err: bool = False) -> None:
    """One line to stdout (results) or stderr (progress, failures), flushed so the two interleave in order."""
    print(line, file=sys.stderr if err else sys.stdout, flush=True)


def names(text: str) -> list[str]:
    """The non-empty comma-separated names of ``text``, in order."""
    return [x.strip() for x in text.split(",") if x.strip()]


def floats(text: str, what: str) -> list[float]:
    """Positive comma-separated numbers (rates), sorted; ``what`` is the flag the message names."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise OptionError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise OptionError(f"{what} must be positive numbers, got {text!r}")
    return sorted(values)


def ints(text: str, what: str) -> list[int]:
    """Comma-separated integers, in order; ``what`` is the flag the message names."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise OptionError(f"{what} must be comma-separated integers, got {text!r}") from None


@dataclass(frozen=True)
class LoadOptions:
    """The load ``tessera bench`` measures and ``tessera simulate`` simulates, as typed on the
    command line (``tessera bench --help`` gives each one's meaning)."""

    workload: WorkloadName
    systems: str  # comma-separated names of tessera.benchmark.runner.SYSTEMS (each may be SYSTEM@ENGINE), or sglang
    rates: str  # comma-separated req/s
    rates_for: tuple[str, ...]  # SYSTEM=R1,R2,... each
    requests: int
    warmup: float  # share of each run's requests that warms up
    unloaded: int  # requests run one at a time for the unloaded TTFT
    max_tokens: int
    zipf: float
    top_k: int | None
    unit_words: int
    placement: str
    conversations: int
    data_dir: Path | None
    seed: int
    drain_warmup: bool
    trace: Path | None  # a traffic trace replayed instead of the workload
    time_scale: float  # recorded arrival times are multiplied by this (0.5: twice as fast)

    def select_workload(self) -> Workload:
        """The named workload (``--workload`` and its shaping flags; not ``--trace``)."""
        return select_workload(self.workload, self.requests, self.data_dir, self.zipf, self.top_k, self.unit_words,
                               self.placement, self.seed, self.conversations)
