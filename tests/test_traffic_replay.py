"""``tessera bench --trace``: a traffic trace replayed on fresh clusters and against running endpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from helpers.cluster import StartCluster, cluster_config, write_config
from helpers.http import serving
from helpers.text_server import text_server
from typer.testing import CliRunner

from tessera.benchmark.client import run_load
from tessera.benchmark.endpoints import Endpoint, detect, parse_endpoint
from tessera.benchmark.runner import recorded_rate
from tessera.benchmark.traffic import UnitTexts, read_traffic
from tessera.benchmark.workloads import synthetic_workload
from tessera.cli import app
from tessera.config import ClusterConfig
from tessera.engines.checkpoint import resolve
from tessera.engines.tokenizer import load_tokenizer
from tessera.errors import ConfigError
from tessera.launcher import LocalCluster
from tessera.retrieval.prompt import text_placement

RECORDS = [f"Record {i}: the {w} crate left dock {i} on the morning tide and reached the mill by noon."
           for i, w in enumerate(["cedar", "iron", "salt", "wool"])]
SYSTEM = {"role": "system", "content": "Answer from the records."}


def _trace(path: Path, n: int = 8) -> Path:
    lines = []
    for i in range(n):
        units: list[Any] = [RECORDS[(i + j) % 4] for j in range(2)]
        if i % 2:
            units.append({"id": "private-annex", "tokens": 24})
        lines.append({"arrival_s": 0.2 * i, "messages": [SYSTEM, {"role": "user", "content": f"Where is crate {i}?"}],
                      "units": units, "placement": "user" if i % 3 == 0 else "system", "scope": "docks",
                      "max_tokens": 2})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def running(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
            start_module_cluster: StartCluster) -> tuple[ClusterConfig, LocalCluster]:
    cfg = cluster_config(str(tiny_model), nodes=1)
    return cfg, start_module_cluster(cfg, tmp_path_factory.mktemp("replay-cluster"))


def _bench(tmp: Path, config: Path, *args: str) -> tuple[dict[str, Any], str]:
    out = tmp / "out"
    result = CliRunner().invoke(app, ["bench", "--unloaded", "0", "--warmup", "0.5", "--config", str(config),
                                      "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    return json.loads((out / "bench.json").read_text()), result.output


def test_only_loopback_or_explicitly_allowed_hosts_are_driven() -> None:
    """A non-loopback host is refused unless --allow-host names it as written."""
    assert parse_endpoint("http://127.0.0.1:8400", []).url == "http://127.0.0.1:8400"
    assert parse_endpoint("vllm=http://[::1]:8000/v1", []).name == "vllm"
    with pytest.raises(ConfigError, match=r"--allow-host 10\.0\.0\.7"):
        parse_endpoint("http://10.0.0.7:8000", [])
    assert parse_endpoint("http://10.0.0.7:8000", ["10.0.0.7"]).url == "http://10.0.0.7:8000"
    with pytest.raises(ConfigError, match="loopback"):
        parse_endpoint("http://gpu-box:8000", ["10.0.0.7"])


async def test_a_redirect_is_a_failed_request_never_followed() -> None:
    """Regression: bench followed a loopback endpoint's redirect elsewhere and sent it prompts. A 3xx
    is now a failed request (and a failed endpoint check) naming where it pointed; nothing
    reaches the other server."""
    reached: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        reached.append(f"{request.method} {request.path}")
        return web.json_response({"data": [{"id": "m", "owned_by": "someone"}]})

    target = web.Application()
    target.router.add_route("*", "/{tail:.*}", elsewhere)
    async with serving(target) as far:
        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{far}{request.path}")

        front = web.Application()
        front.router.add_route("*", "/{tail:.*}", redirect)
        async with serving(front) as near:
            url = f"http://127.0.0.1:{near}"
            with pytest.raises(ConfigError, match=rf"redirect to http://127\.0\.0\.1:{far}/v1/models.*--url"):
                await detect(Endpoint("near", url, "auto"), {})
            results = await run_load(url, synthetic_workload(4, n_units=10).requests, 0.0, progress=False)
    assert reached == []
    assert [r.status for r in results] == [307] * 4 and not any(r.ok for r in results)
    for r in results:
        assert f"redirect to http://127.0.0.1:{far}/v1/chat/completions" in r.error, r.error
        assert "does not follow redirects; pass the final URL with --url" in r.error, r.error


def test_bench_replays_a_trace_at_its_recorded_times_on_a_fresh_cluster(tiny_model: Path, tmp_path: Path) -> None:
    """One run per system at the trace's own times: the measured half all served, units composed."""
    trace = _trace(tmp_path / "t.jsonl")
    config = write_config(tmp_path, cluster_config(str(tiny_model), nodes=1))
    report, output = _bench(tmp_path, config, "--trace", str(trace), "--systems", "tessera", "--time-scale", "0.5")
    (run,) = report["systems"]["tessera"]["runs"]
    arrivals = [0.1 * i for i in range(8)]  # 0.2 s apart, at half the time
    assert run["rate"] == recorded_rate(arrivals)
    assert (run["requests"], run["ok"]) == (4, 4), run["errors"]
    assert run["hit_rate"]["local"] + run["hit_rate"]["remote"] > 0  # later requests reuse earlier units
    assert (tmp_path / "out" / "ttft_vs_rate.png").is_file() and "| tessera |" in output


def test_url_drives_a_running_tessera_and_a_plain_openai_server_side_by_side(
        running: tuple[ClusterConfig, LocalCluster], tmp_path: Path) -> None:
    """Tessera gets the units as context_units; the plain server the same text, placed in the messages."""
    cfg, _ = running
    trace = _trace(tmp_path / "t.jsonl", n=6)
    config = write_config(tmp_path, cfg)
    with text_server() as plain:
        report, _ = _bench(tmp_path, config, "--trace", str(trace), "--url", f"tessera={cfg.retrieval_url}",
                           "--url", f"plain={plain.url}", "--arrivals", "poisson", "--rates", "20",
                           "--max-concurrency", "2", "--timeout", "60", "--no-drain-warmup")
    systems = report["systems"]
    assert systems["tessera"]["config"]["api"] == "tessera" and systems["plain"]["config"]["api"] == "openai"
    for name in ("tessera", "plain"):
        (run,) = systems[name]["runs"]
        assert (run["requests"], run["ok"]) == (3, 3), run["errors"]
    assert systems["tessera"]["runs"][0]["mean_prompt_tokens"] > 0
    requests = read_traffic(trace)
    texts = UnitTexts(load_tokenizer(resolve(cfg.model)).encode_plain)
    assert len(plain.bodies) == len(requests)
    for body, req in zip(plain.bodies, requests, strict=True):
        assert "context_units" not in body and body["model"] == "plain-model"
        assert body["messages"] == text_placement(list(req.messages), [t for _, t in texts.pairs(req)],
                                                  req.placement)
