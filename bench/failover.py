"""Failover of the replicated retrieval role under load: kill -9 (and SIGSTOP) the leader, measure.

Starts etcd and PostgreSQL (tessera.ha.servers, temporary folders) and a cluster of two
retrieval replicas, one memory node and one generation node (``tessera.launcher``), ingests a
few units, then sends Poisson chat requests with retrieval (``--rate`` per second, greedy,
``--max-tokens``) to the replica that does not lead. Each round kills the leader (SIGKILL; with
``--pause``, SIGSTOP past its lease then SIGCONT), waits for the first 200 served after the
fault, keeps the load on for ``--settle`` more seconds, then starts the killed replica again.

With ``--killed-rate`` the killed replica gets clients of its own too, each request retried
once on the other replica after a connection error (as the docs tell clients to).

Prints, per round and as medians: seconds from the fault to the first 200 answered through
the survivor (while no leader can be reached it serves without reuse), from the fault to
the memory node's restart fence ended by term on the new leader (``--transport tcp`` only;
-1 when it did not end within the round), the share of requests sent in that window that
were refused (503 + Retry-After), the share refused over the whole round, connection errors
or hangs from the survivor (must be 0), 503s without Retry-After (must be 0) and replies
that differ from the pre-fault reply to the same question (must be 0); for the killed
replica's clients, how many were retried and served with the right reply, the seconds from
the fault to the first of them answered, and how many were not served.

    PYTHONPATH=. flock /tmp/tessera-cpu.lock python bench/failover.py [--rounds 3] [--rate 2] [--pause]
        [--transport tcp] [--shipped-defaults] [--killed-rate 1]

Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import random
import signal
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tessera.auth import ClusterAuth
from tessera.config import ClusterConfig, HAConfig
from tessera.config_file import load_config
from tessera.ha.replicas import replica_config
from tessera.ha.servers import EtcdServer, PostgresServer, free_port
from tessera.launcher import Child, LocalCluster

STRIDE = 7
DOCS = {
    "reef": "The Great Barrier Reef is the largest coral reef system in the world, off Queensland.",
    "chip": "A transistor is a semiconductor device used to amplify or switch electronic signals.",
    "coffee": "Espresso is coffee brewed by forcing hot water through finely ground coffee beans.",
    "peak": "Mount Everest is the highest mountain above sea level, on the border of Nepal and China.",
}
QUESTIONS = ["Where is the largest reef?", "How is espresso brewed?", "Which mountain is highest?",
             "What does a transistor do?"]


def config(model: str, etcd: EtcdServer, pg: PostgresServer, ttl: int, transport: str,
           shipped: bool = False) -> ClusterConfig:
    """The bench cluster: short lease and heartbeat timeouts, or (``shipped``) the defaults."""
    base = load_config()
    ha = HAConfig(**etcd.access(), election="/bench/leader", replicas=2, replica_port_stride=STRIDE)
    if not shipped:
        ha = dataclasses.replace(ha, lease_ttl_s=ttl, renew_margin_s=0.5)
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, source=model),
        transport=dataclasses.replace(base.transport, name=transport),
        control=base.control if shipped else dataclasses.replace(base.control, heartbeat_timeout_s=3.0),
        retrieval=dataclasses.replace(base.retrieval, port=free_port(), internal_port=free_port(), store="postgres",
                                      postgres_dsn=pg.dsn),
        kvpools=(dataclasses.replace(base.kvpools[0], port=free_port(), data_port=free_port()),),
        generation=(dataclasses.replace(base.generation[0], port=free_port()),),
        ha=ha)


def post(url: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 120.0) -> tuple[int, Any, Any]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read() or b"null")


def stats(cfg: ClusterConfig, i: int) -> dict[str, Any] | None:
    """Replica ``i``'s plane counters; None unless it leads (the others answer 503)."""
    url = replica_config(cfg, i).control_url + "/control/stats"
    req = urllib.request.Request(url, headers=ClusterAuth.from_config(cfg).headers("GET", url))
    try:
        with urllib.request.urlopen(req, timeout=2.0) as resp:
            return json.loads(resp.read()) if resp.status == 200 else None
    except (OSError, urllib.error.URLError):
        return None


def leads(cfg: ClusterConfig, i: int) -> bool:
    return stats(cfg, i) is not None


def fence_ended(cfg: ClusterConfig, i: int) -> bool:
    """The new leader lifted the memory node's restart fence by term (tcp only; shm keeps the time fence)."""
    got = stats(cfg, i)
    return got is not None and got.get("fences_lifted_by_term", 0) > 0


def leader(cfg: ClusterConfig, timeout: float = 60.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for i in (0, 1):
            if leads(cfg, i):
                return i
        time.sleep(0.05)
    raise TimeoutError("no leader")


def chat(base: str, question: str, max_tokens: int) -> tuple[int, Any, Any]:
    return post(base + "/v1/chat/completions", {
        "model": "tessera", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
        "temperature": 0, "retrieval": {"scope": "bench", "query": question, "top_k": 2}})


@dataclasses.dataclass
class Outcome:
    sent: float
    status: int  # 0: a connection error or a timeout
    retry_after: bool
    text: str
    question: str
    done: float = 0.0  # when the answer (or the error) came
    retried: bool = False  # its first replica refused the connection; retried on the other


def load(bases: list[str], rate: float, stop: threading.Event, max_tokens: int, seed: int) -> list[Outcome]:
    """Poisson chat to ``bases[0]``; a connection error is retried once on ``bases[1]`` (if
    given), as the docs tell clients of a replica to do."""
    rng = random.Random(seed)
    out: list[Outcome] = []
    lock = threading.Lock()

    def one(q: str) -> None:
        sent = time.monotonic()
        got = Outcome(sent, 0, False, "", q)
        for i, base in enumerate(bases[:2]):
            try:
                status, headers, body = chat(base, q, max_tokens)
            except Exception:
                continue  # the replica is gone: the next one, as a client's retry would
            text = body["choices"][0]["message"]["content"] if status == 200 else ""
            got = Outcome(sent, status, "Retry-After" in headers, text, q, retried=i > 0)
            break
        got.done = time.monotonic()
        with lock:
            out.append(got)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        while not stop.is_set():
            pool.submit(one, rng.choice(QUESTIONS))
            time.sleep(rng.expovariate(rate))
    return out


def child(cluster: LocalCluster, i: int) -> Child:
    return next(c for c in cluster.children if c.role == "retrieval" and c.node == f"r{i}")


def round_(cfg: ClusterConfig, cluster: LocalCluster, args: argparse.Namespace, n: int,
           expected: dict[str, str]) -> dict[str, float]:
    lead = leader(cfg)
    survivor = 1 - lead
    base = replica_config(cfg, survivor).retrieval_url
    stop = threading.Event()
    results: list[Outcome] = []
    killed: list[Outcome] = []  # the killed replica's own clients, retrying on the survivor
    runners = [threading.Thread(target=lambda: results.extend(load([base], args.rate, stop, args.max_tokens, n)))]
    if args.killed_rate > 0:
        bases = [replica_config(cfg, lead).retrieval_url, base]
        runners.append(threading.Thread(
            target=lambda: killed.extend(load(bases, args.killed_rate, stop, args.max_tokens, 1000 + n))))
    for r in runners:
        r.start()
    time.sleep(args.settle)
    proc = child(cluster, lead).proc
    fault = time.monotonic()
    proc.send_signal(signal.SIGSTOP if args.pause else signal.SIGKILL)
    first_ok = lifted = None
    while first_ok is None and time.monotonic() - fault < 120:
        if lifted is None and fence_ended(cfg, survivor):
            lifted = time.monotonic()
        status, _, _ = chat(base, QUESTIONS[0], args.max_tokens)
        if status == 200:
            first_ok = time.monotonic()  # its answer came: the first 200 as a client sees it
        time.sleep(0.05)
    if args.pause:
        proc.send_signal(signal.SIGCONT)
    settled = time.monotonic() + args.settle
    while time.monotonic() < settled:
        if lifted is None and fence_ended(cfg, survivor):
            lifted = time.monotonic()
        time.sleep(0.1)
    stop.set()
    for r in runners:
        r.join()
    if not args.pause:
        cluster.restart_child(child(cluster, lead), wait_timeout=180)
    # the load's own first 200 after the fault may come earlier than the probe's (when its
    # answer came, not when it was sent)
    oks = [r.done for r in results if r.sent > fault and r.status == 200]
    recovered = min([*oks, first_ok or float("inf")])
    retried = [r for r in killed if r.sent >= fault and r.retried]
    window = [r for r in results if fault <= r.sent <= recovered]
    after = [r for r in results if r.sent >= fault]
    return {
        "fault_to_first_200_s": recovered - fault,
        # -1: the fence did not end by term within the round (shm: it ends by time, ~40 s)
        "fault_to_fence_end_s": -1.0 if lifted is None else lifted - fault,
        "requests": len(results),
        "in_window": len(window),
        "refused_in_window": sum(r.status == 503 for r in window) / max(1, len(window)),
        "refused_after_fault": sum(r.status == 503 for r in after) / max(1, len(after)),
        "connection_errors": sum(r.status == 0 for r in results),
        "other_status": sum(r.status not in (0, 200, 503) for r in results),
        "503_without_retry_after": sum(r.status == 503 and not r.retry_after for r in results),
        "wrong_replies": sum(r.status == 200 and r.text != expected[r.question] for r in results),
        # the killed replica's clients: requests whose connection failed, retried on the survivor
        "killed_clients_retried": len(retried),
        "killed_clients_served": sum(r.status == 200 and r.text == expected[r.question] for r in retried),
        "killed_clients_fault_to_200_s": min((r.done for r in retried if r.status == 200), default=fault) - fault,
        "killed_clients_unserved": sum(r.status != 200 for r in killed if r.sent >= fault),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=2.0, help="chat requests per second to the surviving replica")
    ap.add_argument("--killed-rate", type=float, default=0.0,
                    help="chat requests per second to the replica that is killed, each retried once on the other "
                         "replica after a connection error (as the docs tell clients)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--lease-ttl", type=int, default=2, help="ha.lease_ttl_s")
    ap.add_argument("--settle", type=float, default=4.0, help="seconds of load before the fault and after recovery")
    ap.add_argument("--pause", action="store_true", help="SIGSTOP the leader past its lease instead of kill -9")
    ap.add_argument("--shipped-defaults", action="store_true",
                    help="the shipped [ha] and [control] defaults instead of --lease-ttl and a 3 s heartbeat timeout")
    ap.add_argument("--transport", default="shm", choices=("shm", "tcp"),
                    help="transport.name; on tcp the shared tier's fence after the failover ends by term")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tessera-failover-"))
    etcd, pg = EtcdServer(root / "etcd").start(), PostgresServer().start()
    try:
        cfg = config(args.model, etcd, pg, args.lease_ttl, args.transport, args.shipped_defaults)
        cluster = LocalCluster(cfg, log_dir=root / "logs", quiet=True)
        cluster.start(timeout=300)
        cfg = cluster.config
        try:
            base = replica_config(cfg, leader(cfg)).retrieval_url
            status, _, out = post(base + "/v1/units", {"version": 1, "units": [
                {"scope": "bench", "text": t, "metadata": {"name": k}} for k, t in DOCS.items()]})
            assert status == 200, out
            time.sleep(1.0)  # the other replica's index follows the store
            expected = {q: chat(base, q, args.max_tokens)[2]["choices"][0]["message"]["content"] for q in QUESTIONS}
            rounds = [round_(cfg, cluster, args, n, expected) for n in range(args.rounds)]
        finally:
            cluster.stop()
    finally:
        etcd.stop()
        pg.remove()
    fault = "SIGSTOP past the lease" if args.pause else "kill -9"
    timing = (f"ha.lease_ttl_s {cfg.ha.lease_ttl_s}, control.heartbeat_timeout_s {cfg.control.heartbeat_timeout_s:g}"
              + (" (the shipped defaults)" if args.shipped_defaults else ""))
    print(f"failover ({fault} of the leader), model {args.model}, {args.rate} req/s Poisson to the other replica, "
          f"max_tokens {args.max_tokens}, {timing}, transport {args.transport}")
    for n, r in enumerate(rounds):
        cells = (f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
        print(f"  round {n}: " + ", ".join(cells))
    for key in ("fault_to_first_200_s", "fault_to_fence_end_s", "refused_in_window", "refused_after_fault",
                "killed_clients_fault_to_200_s"):
        print(f"  median {key}: {statistics.median(r[key] for r in rounds):.2f}")
    for key in ("connection_errors", "other_status", "503_without_retry_after", "wrong_replies",
                "killed_clients_retried", "killed_clients_served", "killed_clients_unserved"):
        print(f"  total {key}: {sum(int(r[key]) for r in rounds)}")


if __name__ == "__main__":
    main()
