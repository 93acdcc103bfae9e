"""The long commands of the README and docs/, each run as written with tiny parameters.

Every test here starts the command as a real subprocess (the installed ``tessera`` script or
``python bench/...``), on the tiny random model where the command takes a config, and checks
the exit code and the figures the command exists to print. ``test_readme_commands.py`` maps
each documented command to its test.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cluster import REPO, cluster_config, write_config
from helpers.processes import process_group

from tessera.config import ClusterConfig
from tessera_lab.hosts.netns import unavailable

PYTHON = sys.executable
_NO_HOSTS = unavailable()
needs_hosts = pytest.mark.skipif(_NO_HOSTS is not None, reason=f"multi-host harness: {_NO_HOSTS}")
# the console script `pip install -e .` puts beside the interpreter: the docs' bare `tessera`
TESSERA = [str(Path(PYTHON).with_name("tessera"))] if Path(PYTHON).with_name("tessera").is_file() \
    else [PYTHON, "-m", "tessera"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))


def _run(argv: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``argv`` from the repository root, as a shell would run it; its exit code is asserted to be 0."""
    done = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    return done


def _row(table: str, *cells: str) -> list[str]:
    """The cells of the Markdown table row whose leading cells are ``cells``."""
    for line in table.splitlines():
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if row[:len(cells)] == list(cells):
            return row
    raise AssertionError(f"no row {cells} in:\n{table}")


@pytest.fixture
def tiny_cluster(tiny_model: Path, tmp_path: Path) -> tuple[ClusterConfig, Path]:
    """The embedded cluster with one generation node serving the tiny random model, as a config file."""
    cfg = cluster_config(str(tiny_model), nodes=1)
    return cfg, write_config(tmp_path, cfg)


# --- tessera up ------------------------------------------------------------------------------


def _ports(cfg: ClusterConfig) -> list[int]:
    r = cfg.retrieval
    return [r.port, r.internal_port, *(p for kv in cfg.kvpools for p in (kv.port, kv.data_port)),
            *(g.port for g in cfg.generation)]


def _bindable(port: int) -> bool:
    """Whether a server could listen on ``port`` now (SO_REUSEADDR, as aiohttp binds: TIME_WAIT is no hold)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_for_line(proc: subprocess.Popen[str], out: Path, line: str, timeout: float = 120) -> None:
    """Until ``line`` is in the file ``proc`` writes its stdout to; fails if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while line not in out.read_text():
        assert proc.poll() is None, f"exited with {proc.returncode}: {out.read_text()}"
        assert time.monotonic() < deadline, f"no {line!r} after {timeout:.0f}s: {out.read_text()}"
        time.sleep(0.2)


def test_tessera_up_serves_an_openai_chat_request_and_stops_cleanly_on_ctrl_c(
        tiny_cluster: tuple[ClusterConfig, Path], tmp_path: Path) -> None:
    """`tessera up` starts every role, answers the openai client, and Ctrl-C stops them all with exit 0."""
    import openai

    cfg, path = tiny_cluster
    logs, out, err = tmp_path / "logs", tmp_path / "up.out", tmp_path / "up.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        # a session of its own: Ctrl-C reaches the whole foreground process group, children included
        proc = subprocess.Popen([*TESSERA, "up", "--config", str(path), "--data-dir", str(tmp_path / "data"),
                                 "--log-dir", str(logs)], cwd=REPO, env=_env(), stdout=stdout, stderr=stderr,
                                text=True, start_new_session=True)
    with process_group(proc, ctrl_c_wait_s=60):
        _wait_for_line(proc, out, f"tessera is up: OpenAI-compatible API at {cfg.retrieval_url}/v1")
        client = openai.OpenAI(base_url=cfg.retrieval_url + "/v1", api_key="unused")
        done = client.chat.completions.create(
            model="tessera", messages=[{"role": "user", "content": "When does the ferry leave?"}], max_tokens=4,
            temperature=0, extra_body={"context_units": ["The ferry leaves the harbour at nine every morning."]})
        assert done.choices[0].finish_reason in ("stop", "length")
        assert done.usage is not None and done.usage.prompt_tokens > 0 and done.usage.completion_tokens > 0
    assert proc.returncode == 0, (out.read_text(), err.read_text())
    assert "stopping tessera" in err.read_text() and "Traceback" not in err.read_text(), err.read_text()
    with pytest.raises(ProcessLookupError):  # every role of its process group has exited
        os.killpg(proc.pid, 0)
    held = [p for p in _ports(cfg) if not _bindable(p)]
    assert not held, f"ports still held after tessera up stopped: {held}"
    for log in logs.glob("*.log"):
        assert "Traceback" not in log.read_text(), log


# --- tessera hosts up / clean -----------------------------------------------------------------


def _namespaces(pid: int) -> list[str]:
    """The network namespaces of the harness process ``pid`` (named ``tsr<pid>-<host>``)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"tsr{pid}-")]


def _hosts_up(cfg_path: Path, tmp_path: Path) -> tuple[subprocess.Popen[str], Path, Path]:
    out, err = tmp_path / "hosts.out", tmp_path / "hosts.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        argv = [*TESSERA, "hosts", "up", "--config", str(cfg_path), "--log-dir", str(tmp_path / "logs")]
        proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=stdout, stderr=stderr, text=True,
                                start_new_session=True)
    _wait_for_line(proc, out, "Ctrl-C stops every role and deletes the hosts.", timeout=180)
    return proc, out, err


@needs_hosts
def test_tessera_hosts_up_serves_through_its_forward_and_ctrl_c_deletes_the_hosts(
        tiny_cluster: tuple[ClusterConfig, Path], tmp_path: Path) -> None:
    """`sudo tessera hosts up`: one namespace per role, the printed API URL and key answer the openai
    client, and Ctrl-C stops every role and deletes every namespace it made (exit 0)."""
    import openai

    _, path = tiny_cluster
    proc, out, err = _hosts_up(path, tmp_path)
    clean = functools.partial(subprocess.run, [*TESSERA, "hosts", "clean"], cwd=REPO, env=_env(), capture_output=True,
                              check=False)
    with process_group(proc, ctrl_c_wait_s=90, on_kill=clean):
        text = out.read_text()
        url = re.search(r"API \(forwarded from host \w+\): (http://127\.0\.0\.1:\d+)/v1/chat/completions", text)
        key = re.search(r"API key: (\S+)", text)
        assert url and key, text
        hosts = _namespaces(proc.pid)
        assert len(hosts) >= 4, hosts  # cp, kv0, gen0, the client host (+ the bridge's)
        with openai.OpenAI(base_url=url.group(1) + "/v1", api_key=key.group(1)) as client:
            assert [m.id for m in client.models.list().data]
            done = client.chat.completions.create(
                model="tessera", messages=[{"role": "user", "content": "When does the ferry leave?"}], max_tokens=4,
                temperature=0, extra_body={"context_units": ["The ferry leaves the harbour at nine every morning."]})
        assert done.choices[0].finish_reason in ("stop", "length")
        # the hosts' cluster has API keys: a forged one gets no answer
        with openai.OpenAI(base_url=url.group(1) + "/v1", api_key="forged") as forged, \
                pytest.raises(openai.AuthenticationError):
            forged.models.list()
    assert proc.returncode == 0, (out.read_text(), err.read_text())
    assert "Traceback" not in err.read_text(), err.read_text()
    assert _namespaces(proc.pid) == []


@needs_hosts
def test_tessera_hosts_clean_deletes_what_a_killed_hosts_up_left_behind(
        tiny_cluster: tuple[ClusterConfig, Path], tmp_path: Path) -> None:
    """kill -9 of `tessera hosts up` (and its roles) leaves its namespaces; `tessera hosts clean` deletes them."""
    _, path = tiny_cluster
    proc, _, _ = _hosts_up(path, tmp_path)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    left = _namespaces(proc.pid)
    assert left, "a killed harness cannot have deleted its namespaces"
    done = _run([*TESSERA, "hosts", "clean"])
    assert _namespaces(proc.pid) == []
    assert f"removed {len(left)} namespaces" in done.stdout, done.stdout
    assert all(name in done.stdout for name in left), done.stdout


# --- tessera bench, tessera demo (make demo), tessera eval -------------------------------------


def test_tessera_bench_sweeps_a_tiny_synthetic_workload_and_reports_ttft(
        tiny_cluster: tuple[ClusterConfig, Path], tmp_path: Path) -> None:
    """`tessera bench --workload synthetic` prints a TTFT row per system and rate, writes bench.json and its plots.

    One system and no unloaded reference (its own cluster) keep it to one cluster start; the demo's smoke
    run sweeps prefix caching and Tessera side by side.
    """
    _, path = tiny_cluster
    out = tmp_path / "out"
    done = _run([*TESSERA, "bench", "--workload", "synthetic", "--systems", "tessera", "--requests", "4",
                 "--rates", "1", "--unloaded", "0", "--config", str(path), "--out", str(out)])
    row = _row(done.stdout, "tessera", "1")
    assert all(re.fullmatch(r"\d+\.\d{3}", cell) for cell in row[2:6]) and row[7] == "2/2", done.stdout
    (run,) = json.loads((out / "bench.json").read_text())["systems"]["tessera"]["runs"]
    assert (run["rate"], run["ok"], len(run["ttfts"])) == (1.0, 2, 2), run
    assert f"plot: {out / 'ttft_vs_rate.png'}" in done.stdout and (out / "ttft_vs_rate.png").is_file()


def test_tessera_demo_compares_prefix_caching_and_tessera_on_a_tiny_run(
        tiny_cluster: tuple[ClusterConfig, Path], tmp_path: Path) -> None:
    """`tessera demo` (what `make demo` runs) prints both systems' rows, the TTFT ratio per rate, and its plots."""
    _, path = tiny_cluster
    out = tmp_path / "demo"
    done = _run([*TESSERA, "demo", "--requests", "4", "--rates", "1", "--config", str(path), "--out", str(out)])
    for system in ("prefix", "tessera"):
        assert _row(done.stdout, system, "1")[7] == "2/2", done.stdout
    assert re.search(r"at 1 req/s: prefix caching \d+\.\d+s vs Tessera \d+\.\d+s mean TTFT -> \d+\.\d+x lower",
                     done.stdout), done.stdout
    assert (out / "ttft_vs_rate.png").is_file() and (out / "ttft_cdf.png").is_file()


def _tiny_musique(directory: Path) -> Path:
    """A MuSiQue file of three questions in musique_s.json's shape (question, answers, ctxs[].text)."""
    places = [("ferry", "Bergen", "nine"), ("museum", "Porto", "1902"), ("bridge", "Tartu", "granite")]
    items = [{"question": f"What is said of the {thing} of {city}?", "answers": [answer],
              "ctxs": [{"text": f"The {thing} of {city} is known for {answer}, records say, item {k}."}
                       for k in range(3)]}
             for thing, city, answer in places]
    (directory / "musique").mkdir(parents=True)
    (directory / "musique" / "musique_s.json").write_text(json.dumps(items))
    return directory


def test_tessera_eval_scores_each_policy_against_gold_answers_and_full(
        tiny_cluster: tuple[ClusterConfig, Path], tmp_path: Path) -> None:
    """`tessera eval --workload rag` prints the question count and each policy's F1; naive and epic also vs full."""
    _, path = tiny_cluster
    data = _tiny_musique(tmp_path / "data")
    done = _run([*TESSERA, "eval", "--workload", "rag", "--questions", "2", "--unit-words", "20",
                 "--max-new-tokens", "4", "--data-dir", str(data), "--config", str(path)])
    assert "rag: 2 questions" in done.stdout, done.stdout
    assert re.search(r"^  full +F1 +\d+\.\d$", done.stdout, re.M), done.stdout
    for policy in ("naive", "epic"):
        assert re.search(rf"^  {policy} +F1 +\d+\.\d  \(answer F1 vs full: \d+\.\d\)$", done.stdout, re.M), done.stdout


# --- the benches -------------------------------------------------------------------------------


def test_bench_overload_drives_load_and_reports_ttft_against_the_unloaded_p99(
        tiny_cluster: tuple[ClusterConfig, Path]) -> None:
    """`python bench/overload.py` prints the unloaded TTFT, the outcomes (only 200/429/503) and the p99 ratio."""
    _, path = tiny_cluster
    done = _run([PYTHON, "bench/overload.py", "--config", str(path), "--factor", "1", "--duration", "1",
                 "--settle", "1", "--max-tokens", "2"])
    assert re.search(r"unloaded: TTFT p50 \d+ ms, p99 \d+ ms; service \d+ ms; saturation ~\d+\.\d+ req/s",
                     done.stdout), done.stdout
    outcomes = re.search(r"requests (\d+); outcomes: (.*)", done.stdout)
    assert outcomes and int(outcomes[1]) > 0, done.stdout
    counts = dict(pair.split() for pair in outcomes[2].split(", "))
    assert set(counts) <= {"200", "429", "503"} and "200" in counts, counts
    assert re.search(r"accepted TTFT p50 \d+ ms, p99 \d+ ms = \d+\.\dx the unloaded p99", done.stdout), done.stdout
    # each process's own memory, less the shared arena and the bounded local cache, before vs after
    assert re.search(r"own memory before the load -> after the settle: retrieval:\S* -?\d+ -> -?\d+ MB", done.stdout), \
        done.stdout
    assert re.search(r"generation:gen0 \d+ MB \(shm \d+, local cache \d+, own -?\d+\)", done.stdout), done.stdout


@pytest.mark.slow  # ~40 s: two clusters under py-spy; the staging rules are tests/test_profile_bench.py
def test_bench_profile_stages_each_roles_cpu_for_prefix_caching_and_tessera(
        tiny_cluster: tuple[ClusterConfig, Path], tmp_path: Path) -> None:
    """`python bench/cpu_profile.py` replays a trace on each system under py-spy and prints CPU per request by stage."""
    _, path = tiny_cluster
    out = tmp_path / "profile"
    done = _run([PYTHON, "bench/cpu_profile.py", "--trace", "bench/traces/example.jsonl", "--config", str(path),
                 "--rate", "4", "--warmup", "0.5", "--request-line", "--sample-rate", "200", "--out", str(out)])
    for system in ("prefix", "tessera"):
        assert re.search(rf"^{system}: 4/4 ok, saturation throughput \d+\.\d\d req/s, prompt \d+ tokens/request, "
                         rf"computed \d+", done.stdout, re.M), done.stdout
    assert re.search(r"throughput ratio / token ratio \d+\.\d\d \(target >= 0.8\)", done.stdout), done.stdout
    report = json.loads((out / "profile.json").read_text())
    assert report["request_line"] is True
    for run in report["runs"]:
        gen = run["roles"]["generation-gen0"]
        # /proc saw the node's CPU, and py-spy's samples split it: the engine's forward among the stages
        assert gen["cpu_ms_per_request"] > 0 and gen["samples"] > 0, gen
        assert "engine forward" in gen["stages_ms_per_request"], gen
        assert sum(gen["stages_ms_per_request"].values()) == pytest.approx(gen["cpu_ms_per_request"])
        assert (out / f"{run['system']}-generation-gen0.folded").stat().st_size > 0
    # the replayed trace, with its per-request line, for tessera analyze
    lines = (out / "trace.jsonl").read_text().splitlines()
    assert len(lines) == 8 and all("Request id: r0000" in line for line in lines)
    again = _run([PYTHON, "bench/cpu_profile.py", "--restage", "--out", str(out)])
    assert "throughput ratio / token ratio" in again.stdout


@pytest.mark.model
def test_bench_engine_times_full_and_composed_prefill_on_smollm2() -> None:
    """`python bench/engine.py` prints full prefill (ours and transformers'), unit prefill, each policy and decode."""
    done = _run([PYTHON, "bench/engine.py", "--unit-tokens", "16", "--repeats", "1"])
    for path in ("full prefill (ours)", "full prefill (transformers)", "unit prefill (5 misses, one step)",
                 "composed, naive", "composed, epic k=4", "composed, epic k=16", "composed, epic k=32"):
        assert re.search(r"\d+\.\d{3} s", "|".join(_row(done.stdout, path))), done.stdout
    decode = r"decode step at \d+ tokens of context: batch 1 \d+\.\d ms, batch 8 \d+\.\d ms"
    assert re.search(decode, done.stdout), done.stdout


@pytest.mark.model
def test_bench_forward_cost_splits_a_forward_into_fixed_and_per_token_cost() -> None:
    """`python bench/forward_cost.py` times each size, fits the line and prints the two requests' ratio."""
    done = _run([PYTHON, "bench/forward_cost.py", "--tokens", "1,4,8", "--context", "12", "--compare", "8,4",
                 "--batch", "3", "--fused", "5", "--repeats", "1"])
    sizes = re.findall(r"^\s+(\d+) tokens:\s+\d+\.\d ms$", done.stdout, re.M)
    assert sizes == ["1", "4", "8"], done.stdout
    assert re.search(r"^fit: -?\d+\.\d ms per forward \+ -?\d+\.\d\d ms per computed token$", done.stdout, re.M), \
        done.stdout
    assert re.search(r"engine-time ratio -?\d+\.\d\dx \(token ratio 2\.00x\)$", done.stdout, re.M), done.stdout
    batches = re.findall(r"^(\d) requests of 8 tokens in one forward: \d+ ms vs \d+ ms apart; the batch shares -?\d+ "
                         r"ms per extra request \(fit's fixed part -?\d+ ms\), and each member waits \d+ ms, not \d+, "
                         r"for its first token$", done.stdout, re.M)
    assert batches == ["2", "3"], done.stdout
    assert re.search(r"^a 4-token request missing a 5-token unit: \d+ ms as prefill \+ place \+ extend, \d+ ms as one "
                     r"fused extend \(-?\d+ ms saved, \d+\.\d\dx\)$", done.stdout, re.M), done.stdout
    refused = subprocess.run([PYTHON, "bench/forward_cost.py", "--tokens", "4,4", "--context", "8", "--compare", "4,2"],
                             cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240, check=False)
    assert refused.returncode != 0 and "two different sizes" in refused.stderr, refused.stderr


def test_bench_store_startup_reopens_a_saved_a_crashed_and_an_index_less_store(tmp_path: Path) -> None:
    """`bench/store_startup.py` builds a store, then opens it saved, caught up after a crash, and rebuilt."""
    env_python = ["env", "PYTHONPATH=.", PYTHON]  # docs/bench/store-startup.md's `PYTHONPATH=. python ...`
    done = _run([*env_python, "bench/store_startup.py", "--units", "200", "--batch", "64"])
    assert re.search(r"^200 units, 384-d embeddings; data dir \d+ MiB$", done.stdout, re.M), done.stdout
    assert re.search(r"build: ingest \d+\.\ds \(\d+ units/s, batches of 64\)", done.stdout), done.stdout
    opened = re.findall(r"open \((.*?)\): \d+\.\d\ds, RSS \+-?\d+ MiB .*?, (\d+) units, "
                        r"retrieve top-10 p50 \d+\.\d\d ms", done.stdout)
    # the crash added 1% (2 units) after the index was saved; the rebuild reads all from SQLite
    assert opened == [("saved index", "200"), ("crash, caught up 2", "202"), ("no index file, rebuilt", "202")], \
        done.stdout


def test_bench_transport_measures_every_transport_next_to_its_ceilings() -> None:
    """`python bench/transport.py` prints memcpy and socket ceilings and read/write GB/s per transport.

    Regression: it started its memory node with `--log-level WARNING`, which `tessera run` refuses.
    """
    done = _run([PYTHON, "bench/transport.py", "--seconds", "0.1", "--total-mib", "1", "--sizes", "16 KiB"])
    rows = {m[1]: m[2].split() for m in re.finditer(r"^ *16 KiB +(\S+) +([\d. ]+)$", done.stdout, re.M)}
    assert len(rows["memcpy"]) == len(rows["socket"]) == 1, done.stdout  # one-way: one column
    expected = {"shm", "tcp", "tcp+tls"} | ({"mooncake"} if "# mooncake skipped" not in done.stdout else set())
    for name in expected:
        assert len(rows.get(name, [])) == 2 and all(float(x) > 0 for x in rows[name]), done.stdout


@needs_hosts
def test_bench_transport_across_hosts_measures_the_network_transports() -> None:
    """`sudo python bench/transport.py --hosts`: memory node and client on two hosts; no shm row."""
    done = _run([PYTHON, "bench/transport.py", "--hosts", "--seconds", "0.1", "--total-mib", "1", "--sizes", "16 KiB"])
    rows = {m[1]: m[2].split() for m in re.finditer(r"^ *16 KiB +(\S+) +([\d. ]+)$", done.stdout, re.M)}
    assert "shm" not in rows and "across two hosts" in done.stdout, done.stdout
    expected = {"tcp", "tcp+tls"} | ({"mooncake"} if "# mooncake skipped" not in done.stdout else set())
    for name in expected:
        assert len(rows.get(name, [])) == 2 and all(float(x) > 0 for x in rows[name]), done.stdout



def test_bench_control_plane_plans_requests_and_prints_its_rates() -> None:
    """`PYTHONPATH=. python bench/control_plane.py` (fewer requests) drives the real plane over the simulated cluster.

    Regression: the bench's own copy of the simulated cluster never sent a heartbeat, so every
    route failed with "no generation node is alive" once a node became routable only when heard.
    """
    done = _run(["env", "PYTHONPATH=.", PYTHON, "bench/control_plane.py", "--requests", "3000", "--digest"])
    assert re.search(r"plans/s \(route\+finalize\+complete only\): [\d,]+$", done.stdout, re.M), done.stdout
    assert re.search(r"plan digest \(sha256 of every plan's repr, in order\): [0-9a-f]{64}$", done.stdout, re.M)
    assert re.search(r"gen2 \d+ \(max [\d.]+ ms, cpu max [\d.]+ ms\)", done.stdout), done.stdout
    assert re.search(r"after the loop: [\d,]+ tracked objects not frozen; a full collection takes [\d.]+ ms",
                     done.stdout), done.stdout
    assert re.search(r"plan latency p50 [\d.]+ us, p99 [\d.]+ us", done.stdout), done.stdout
    shares = re.search(r"preparations: local ([\d.]+)%, remote ([\d.]+)%, compute ([\d.]+)%", done.stdout)
    assert shares is not None and abs(sum(float(x) for x in shares.groups()) - 100) < 0.5, done.stdout


@pytest.mark.slow  # ~30 s under valgrind; the bench itself runs in the default test above
def test_bench_control_plane_under_callgrind_counts_only_the_plans(tmp_path: Path) -> None:
    """`valgrind --tool=callgrind ... bench/control_plane.py --callgrind` counts the warm requests' plan steps.

    docs/bench/control-plane.md divides the collected instructions by the warm requests the bench prints; per
    plan that must be more than nothing (libpython has the ``_operator_call`` symbol) and far
    less than the whole process (about 10^9 instructions: start-up, workload, node traffic).
    """
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed (apt-get install -y valgrind)")
    out = tmp_path / "cp.out"
    done = _run(["env", "PYTHONPATH=.", "valgrind", "--tool=callgrind", "--collect-atstart=no",
                 "--toggle-collect=_operator_call", f"--callgrind-out-file={out}", PYTHON,
                 "bench/control_plane.py", "--requests", "300", "--callgrind"], timeout=600)
    warm = re.search(r"callgrind: measured steps of (\d+) warm requests", done.stdout)
    assert warm is not None and int(warm[1]) == 270, done.stdout
    collected = re.search(r"Collected : ([\d,]+)", done.stderr)
    assert collected is not None, done.stderr[-2000:]
    per_plan = int(collected[1].replace(",", "")) / int(warm[1])
    assert 10_000 < per_plan < 10_000_000, per_plan  # a plan is thousands of bytecodes, not none or a whole run
    assert out.is_file()
