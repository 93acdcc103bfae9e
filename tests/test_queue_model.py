"""``bench/queue_model.py``: a run's queueing against an ideal pooled queue fed its own service times.

The simulation is checked against the Pollaczek-Khinchine formula; the command reads access
lines written by the retrieval role's own formatter (``access_line``), so a change to the
log's wording fails here rather than silently reading nothing.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers.cluster import REPO

from tessera.messages.generation import RequestStats
from tessera.retrieval.access_log import AccessRecord, access_line


@pytest.fixture(scope="module")
def qm() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_queue_model", REPO / "bench" / "queue_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("service", "rate"), [([1.0], 0.5), ([1.0], 0.8), ([0.5, 1.5], 0.5)])
def test_one_node_matches_pollaczek_khinchine(qm: ModuleType, service: list[float], rate: float) -> None:
    """M/G/1: mean wait = rate * E[S^2] / (2 (1 - rho)); deterministic and two-point service."""
    mean = sum(service) / len(service)
    second = sum(s * s for s in service) / len(service)
    expected = rate * second / (2 * (1 - rate * mean))
    assert qm.pooled_wait(service, rate, 1, 300_000, 7) == pytest.approx(expected, rel=0.06)


def test_pooling_two_nodes_queues_less_than_two_separate_ones(qm: ModuleType) -> None:
    """Two nodes fed twice the rate wait less than one node at the same utilisation, and
    next to nothing when lightly loaded."""
    one = qm.pooled_wait([1.0], 0.7, 1, 100_000, 3)
    two = qm.pooled_wait([1.0], 1.4, 2, 100_000, 3)
    assert 0 < two < one
    assert qm.pooled_wait([1.0], 0.05, 2, 50_000, 3) < 0.01


def _line(second: int, queued: float, first: float) -> str:
    stats = RequestStats(prompt_tokens=300, prefix_cached_tokens=48, local_tokens=200, recomputed_tokens=52,
                         completion_tokens=1, node_queued_s=queued, node_first_token_s=first)
    record = AccessRecord(started=0.0, stats=stats, first_token_at=first + 0.01)
    line = access_line("POST", "/v1/chat/completions", 200, record, first + 0.02)
    return f"2026-12-05 10:00:{second:02d},000 INFO tessera.access: {line}"


def test_the_command_reads_a_bench_folder_and_prints_each_runs_split(tmp_path: Path) -> None:
    """Runs are found below a folder; 11 requests over 10 s read as 1 req/s, service = first token - queued."""
    run = tmp_path / "bench" / "logs-tessera-4"
    run.mkdir(parents=True)
    lines = ["2026-12-05 10:00:00,000 INFO tessera.access: GET /health 200 0.001s"]
    lines += [_line(s, 0.1, 0.4) for s in range(11)]
    (run / "retrieval-main.log").write_text("\n".join(lines) + "\n")
    (tmp_path / "bench" / "logs-prefix-2").mkdir()  # a run without a log is skipped
    cmd = [sys.executable, "bench/queue_model.py", str(tmp_path / "bench"), "--requests", "2000", "--last", "50"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert re.search(r"^logs-tessera-4: 11 requests at 1\.00 req/s, service 0\.300 s \(cv2 0\.000\), utilisation "
                     r"0\.15; queued 0\.100 s, pooled model \d\.\d{3} s \((\d+\.\d\dx the model|model: no queueing)\); "
                     r"mean TTFT 0\.410 s$", done.stdout, re.M), done.stdout
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    refused = subprocess.run([sys.executable, "bench/queue_model.py", str(empty)], cwd=REPO, capture_output=True,
                             text=True, timeout=60, check=False)
    assert refused.returncode == 1 and "no access log with the node split" in refused.stderr
    missing = subprocess.run([sys.executable, "bench/queue_model.py", str(tmp_path / "nope")], cwd=REPO,
                             capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode != 0 and "no such file or folder" in missing.stderr
