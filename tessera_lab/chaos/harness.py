"""A chaos run against a whole cluster of real processes (``tessera chaos``).

While Poisson load runs for a bounded time, faults are injected in a shuffled cycle (each
kind once per cycle): ``kill -9`` of a generation node or of a memory node (started again
right after), ``SIGSTOP`` of a generation node for longer than the first-token deadline,
a flipped byte in a stored block of a memory node's shared-memory arena, and a restart of
the retrieval role.

The verifier checks every reply:

* 200: exactly the tokens the offline composition (:mod:`tessera.engines.offline`, same
  engine and config, in this process) gives for the layout the reply returned (greedy);
* 429 or 503 with a JSON error (nothing was streamed to the client: requests are not
  streamed);
* a lost connection only while the retrieval role itself is down (nothing can answer then);
* nothing else, and no reply later than the deadlines allow.

Afterwards every role is up again, the cluster must serve normally, and the roles' total
RSS must stay within ``rss_growth`` of what it was after warm-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from tessera.composition.layout import layout_from_trace
from tessera.config import ClusterConfig
from tessera.launcher import Child, LocalCluster
from tessera.ports import on_free_ports

if TYPE_CHECKING:
    from tessera.engines.offline import Composition

FAULTS = ("kill_generation", "kill_memory", "stop_generation", "corrupt_block", "restart_retrieval")
TOPICS = ("harbour", "orchard", "lighthouse", "ferry", "library", "market", "observatory", "mill")


@dataclass(frozen=True)
class ChaosOptions:
    duration_s: float = 30.0  # how long load runs (faults stop with it)
    rate: float = 2.0  # Poisson arrivals per second
    fault_every_s: float = 5.0  # time between two faults
    max_tokens: int = 8
    units: int = 12  # distinct context units the requests draw from
    seed: int = 0
    rss_growth: float = 1.5  # RSS after / RSS after warm-up must stay below this
    rss_slack_mb: float = 300.0  # ... plus this (allocator noise of fresh processes)
    progress: bool = True  # a line on stderr per phase and per fault


VERIFIED = ("200 verified", "200 within the tie")  # what a correct 200 is


@dataclass
class Reply:
    status: int  # HTTP status; 0 = the connection was lost
    sent_at: float
    latency_s: float
    body: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    replica: int = 0  # which retrieval replica it was sent to (tessera_lab.chaos.replicas)


@dataclass
class ChaosReport:
    requests: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    rss_warm_mb: float = 0.0
    rss_after_mb: float = 0.0
    largest_tie: float = 0.0  # the largest shortfall of a reply served within the tie
    recovered: bool = False

    @property
    def ok(self) -> bool:
        return self.recovered and not self.violations

    def percentile(self, q: float) -> float:
        if not self.ttft_ms:
            return float("nan")
        return statistics.quantiles(self.ttft_ms, n=100, method="inclusive")[int(q) - 1] \
            if len(self.ttft_ms) > 1 else self.ttft_ms[0]

    def render(self) -> str:
        lines = [
            f"requests: {self.requests}",
            "faults injected: " + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())),
            "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())),
            f"TTFT of verified replies (server): p50 {self.percentile(50):.0f} ms, p99 {self.percentile(99):.0f} ms",
            f"RSS of all roles: {self.rss_warm_mb:.0f} MB after warm-up, {self.rss_after_mb:.0f} MB after the run",
            f"served normally afterwards: {'yes' if self.recovered else 'NO'}",
            *([f"half-precision near-ties: {self.outcomes['200 within the tie']} replies part from the offline "
               f"tokens, each served token within {self.largest_tie:.2f} of the offline argmax logit"]
              if self.outcomes["200 within the tie"] else []),
            f"violations: {len(self.violations)}",
        ]
        lines += [f"  - {v}" for v in self.violations[:20]]
        return "\n".join(lines)


# How far below the offline argmax (in logits) a served token of a half-precision engine may be:
# its kernels are not batch-invariant (a row's sums depend on the batch's shape), so a near-tie
# can go either way between a node's batch and the oracle's; a wrong unit state or a corrupt
# block does not stay within this of the argmax at every position
HALF_PRECISION_TIE = 0.5


class Oracle:
    """Offline greedy composition with the served engine and config (loaded once, in this process).

    A float32 engine serves exactly the offline tokens. A half-precision one (SGLang's bfloat16
    kernels) may part from them at a near-tie: a reply whose tokens differ is then teacher-forced
    through the offline composition, and every served token must be within ``tie`` of that
    position's argmax logit (:meth:`shortfall`).
    """

    def __init__(self, config: ClusterConfig) -> None:
        from tessera.composition.policies import policy_from_config
        from tessera.engines.base import load_engine

        # the nodes' engine (model.engine): a reply is checked against what that engine composes
        self.engine = load_engine(config, 0)
        self.policy = policy_from_config(config.composition)
        self.tie = 0.0 if config.model.dtype == "float32" else HALF_PRECISION_TIE

    def tokens(self, trace: dict[str, Any], n: int) -> list[int]:
        comp = self._compose(trace, max_new_tokens=n, stop_ids=self.engine.eos_token_ids)
        return list(comp.generated)

    def shortfall(self, trace: dict[str, Any], served: list[int]) -> float:
        """The largest gap between the offline argmax logit and the served token's logit, over
        the served tokens teacher-forced through the offline composition (0: each was the argmax)."""
        forced = self._compose(trace, forced=served).forced_logits
        return max(float(row.max() - row[token]) for row, token in zip(forced, served, strict=True))

    def _compose(self, trace: dict[str, Any], **how: Any) -> Composition:
        """The offline composition of a reply's layout, its units prefilled independently."""
        from tessera.engines.offline import compose, prefill_units

        layout = layout_from_trace(trace)
        return compose(self.engine, layout, self.policy, prefill_units(self.engine, layout), **how)


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class ChaosRun:
    def __init__(self, config: ClusterConfig, options: ChaosOptions, log_dir: Path | None = None) -> None:
        config = self.config = on_free_ports(config)  # beside a cluster on the configured ports
        self.options = options
        self.cluster = LocalCluster(config, log_dir=log_dir, quiet=True)
        self.rng = random.Random(options.seed)
        self.report = ChaosReport()
        self.retrieval_down: list[tuple[float, float, int]] = []  # (from, to) in run time, replica
        self.fault_kinds: tuple[str, ...] = FAULTS  # a subclass adds kinds of its own (tessera_lab/hosts)
        self.replicas = 1  # retrieval replicas the load is spread over (round robin)
        self.headers: dict[str, str] = {}  # sent with every API request (an API key)
        self.corrupted: list[tuple[str, int]] = []  # (memory node, slot) a fault flipped a byte in
        self.t0 = 0.0
        self.answered = 0  # replies received (progress lines)
        control = config.control
        # the longest a reply may take: every attempt's first-token deadline (the slack; the work
        # of these short prompts is well under a second), or, on a stopped node, its heartbeats
        # timing out; then every token
        attempt_s = control.connect_timeout_s + max(control.first_token_timeout_s, control.heartbeat_timeout_s + 1.0)
        self.deadline_s = attempt_s * control.max_attempts + control.idle_timeout_s * options.max_tokens + 10.0
        self.units = [f"Record {i}: the {TOPICS[i % len(TOPICS)]} ledger notes {i * 7} visitors and "
                      f"{i * 3 + 1} deliveries in week {i}. " * 2 for i in range(options.units)]

    # --- the run -------------------------------------------------------------------------

    def run(self) -> ChaosReport:
        # progress on stderr, one line per phase and per fault: a run is minutes long
        self._say(f"starting the cluster (logs in {self.cluster.log_dir}) and loading the offline oracle")
        oracle = Oracle(self.config)
        self.cluster.start(timeout=300)
        try:
            asyncio.run(self._warm_up())
            self.report.rss_warm_mb = self._rss()
            self._say(f"load for {self.options.duration_s:.0f}s with a fault every {self.options.fault_every_s:.0f}s")
            replies = asyncio.run(self._drive())
            self._say(f"load over: {self.answered} replies; bringing every role back")
            self._recover()
            final = asyncio.run(self._final_check())
            self.report.rss_after_mb = self._rss()
        finally:
            self.cluster.stop()
        self._say(f"verifying {len(replies)} replies against the offline composition")
        self._verify(replies, oracle, final)
        return self.report

    def _say(self, message: str) -> None:
        if self.options.progress:
            print(f"tessera chaos: {message}", file=sys.stderr, flush=True)

    def _rss(self) -> float:
        return sum(rss_mb(c.proc.pid) for c in self.cluster.alive())

    def _body(self, i: int) -> dict[str, Any]:
        picks = self.rng.sample(self.units, k=min(3, len(self.units)))
        return {"model": "tessera", "messages": [{"role": "system", "content": "Answer briefly."},
                                                 {"role": "user", "content": f"Question {i}: what do they say?"}],
                "context_units": picks, "max_tokens": self.options.max_tokens, "temperature": 0,
                "return_layout": True, "logprobs": True, "top_logprobs": 0}

    def _url(self, replica: int) -> str:
        """The public API of retrieval replica ``replica`` (one replica here)."""
        return self.config.retrieval_url

    async def _send(self, session: aiohttp.ClientSession, body: dict[str, Any], replica: int = 0) -> Reply:
        sent = time.monotonic() - self.t0
        start = time.perf_counter()
        try:
            async with session.post(self._url(replica) + "/v1/chat/completions", json=body, headers=self.headers,
                                    timeout=aiohttp.ClientTimeout(total=self.deadline_s)) as resp:
                try:
                    payload = await resp.json(content_type=None)
                except ValueError:
                    payload = {}
                self.answered += 1
                return Reply(resp.status, sent, time.perf_counter() - start,
                             payload if isinstance(payload, dict) else {}, replica=replica)
        except TimeoutError:
            return Reply(-1, sent, time.perf_counter() - start, error="no reply within the deadlines", replica=replica)
        except aiohttp.ClientError as exc:
            return Reply(0, sent, time.perf_counter() - start, error=repr(exc), replica=replica)

    async def _warm_up(self) -> None:
        async with aiohttp.ClientSession() as session:
            for i in range(4):
                reply = await self._send(session, self._body(-i))
                if reply.status != 200:
                    raise RuntimeError(f"warm-up request failed: {reply.status} {reply.body or reply.error}")

    async def _drive(self) -> list[Reply]:
        self.t0 = time.monotonic()
        opts = self.options
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            faults = asyncio.create_task(self._faults())
            pending: list[asyncio.Task[Reply]] = []
            at, i = 0.0, 0
            while True:
                at += self.rng.expovariate(opts.rate)
                if at >= opts.duration_s:
                    break
                await asyncio.sleep(max(0.0, at - (time.monotonic() - self.t0)))
                pending.append(asyncio.create_task(self._send(session, self._body(i), i % self.replicas)))
                i += 1
            await faults
            return list(await asyncio.gather(*pending))

    # --- faults --------------------------------------------------------------------------

    async def _faults(self) -> None:
        cycle: list[str] = []
        at = self.options.fault_every_s / 2
        while at < self.options.duration_s - self.options.fault_every_s / 2:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - self.t0)))
            if not cycle:
                cycle = list(self.fault_kinds)
                self.rng.shuffle(cycle)
            kind = cycle.pop()
            self._say(f"[{time.monotonic() - self.t0:5.0f}s] {kind.replace('_', ' ')} ({self.answered} replies so far)")
            await getattr(self, "_" + kind)()
            self.report.faults[kind] += 1
            at += self.options.fault_every_s

    def _pick(self, role: str) -> Child:
        return self.rng.choice([c for c in self.cluster.children if c.role == role])

    async def _kill_and_restart(self, child: Child, down_s: float) -> None:
        os.kill(child.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(child.proc.wait)
        await asyncio.sleep(down_s)
        # spawned from this (the main) thread: a child dies with the thread that started it
        self.cluster.restart_child(child)

    async def _kill_generation(self) -> None:
        await self._kill_and_restart(self._pick("generation"), down_s=1.0)

    async def _kill_memory(self) -> None:
        await self._kill_and_restart(self._pick("kvpool"), down_s=1.0)

    async def _stop_generation(self) -> None:
        child = self._pick("generation")
        os.kill(child.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(self.config.control.first_token_timeout_s + 1.0)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.proc.pid, signal.SIGCONT)

    async def _corrupt_block(self) -> None:
        """Flip one byte in one of the first slots of a memory node's arena (where blocks go first)."""
        from tessera.transport.arena import SHM_DIR, Arena

        node = self._pick("kvpool").node
        segments = sorted(SHM_DIR.glob(f"tessera-{node}-*"), key=lambda p: p.stat().st_mtime)
        if not segments:
            return
        arena = Arena.attach(segments[-1].name)
        try:
            index = self.rng.randrange(min(8, arena.capacity))
            slot = arena.slot(index)
            slot[self.rng.randrange(64, len(slot))] ^= 0x40
            self.corrupted.append((node, index))
        finally:
            arena.close()

    async def _restart_retrieval(self) -> None:
        child = self._pick("retrieval")
        down = time.monotonic() - self.t0
        os.kill(child.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(child.proc.wait)
        new = self.cluster.restart_child(child)
        await asyncio.to_thread(self.cluster._wait, [new], 120.0)
        await asyncio.to_thread(self.cluster._wait_heard, [g.name for g in self.config.generation], 60.0)
        self.retrieval_down.append((down, time.monotonic() - self.t0, 0))
        assert new.proc.poll() is None

    # --- afterwards ----------------------------------------------------------------------

    def _recover(self) -> None:
        for child in list(self.cluster.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.proc.pid, signal.SIGCONT)
            if child.proc.poll() is not None:
                self.cluster.restart_child(child, wait_timeout=120)
        for child in self.cluster.children:
            self.cluster._wait([child], 120)
        self.cluster._wait_heard([g.name for g in self.config.generation], 60)

    async def _final_check(self) -> list[Reply]:
        async with aiohttp.ClientSession() as session:
            return [await self._send(session, self._body(10_000 + i)) for i in range(4)]

    def _verify(self, replies: list[Reply], oracle: Oracle, final: list[Reply]) -> None:
        r = self.report
        r.requests = len(replies)
        for reply in replies:
            kind = self._check(reply, oracle)
            r.outcomes[kind] += 1
        r.recovered = all(self._check(reply, oracle) in VERIFIED for reply in final)
        if not r.recovered:
            r.violations.append("after the run: " + ", ".join(str(f.status) for f in final))
        growth_ok = r.rss_after_mb <= r.rss_warm_mb * self.options.rss_growth + self.options.rss_slack_mb
        if not growth_ok:
            r.violations.append(f"RSS grew from {r.rss_warm_mb:.0f} MB to {r.rss_after_mb:.0f} MB")

    def _check(self, reply: Reply, oracle: Oracle) -> str:
        violations = self.report.violations
        if reply.status == 200:
            try:
                served = [e["token_id"] for e in reply.body["choices"][0]["logprobs"]["content"]]
                expected = oracle.tokens(reply.body["tessera_layout"], len(served))
            except (KeyError, IndexError, TypeError) as exc:
                violations.append(f"200 without tokens or layout at t={reply.sent_at:.1f}s: {exc!r}")
                return "200 malformed"
            ended_at_once = not served and (not expected or expected[0] in oracle.engine.eos_token_ids)
            outcome = "200 verified"
            if served != expected[: len(served)] or (not served and not ended_at_once):
                gap = oracle.shortfall(reply.body["tessera_layout"], served) if served and oracle.tie else math.inf
                if gap > oracle.tie:
                    violations.append(f"wrong tokens at t={reply.sent_at:.1f}s: served {served}, offline {expected}"
                                      + (f" (a served token {gap:.2f} below the argmax)" if gap < math.inf else ""))
                    return "200 wrong tokens"
                outcome = "200 within the tie"  # a near-tie of a half-precision engine went the other way
                self.report.largest_tie = max(self.report.largest_tie, gap)
            ttft = reply.body.get("usage", {}).get("tessera", {}).get("ttft_ms")
            if ttft is not None:
                self.report.ttft_ms.append(float(ttft))
            return outcome
        if reply.status in (429, 503) and isinstance(reply.body.get("error"), dict):
            return f"{reply.status} refused"
        if reply.status == 0 and self._during_retrieval_restart(reply):
            return "lost with the retrieval role"
        if reply.status == -1:
            violations.append(f"hang: no reply within {self.deadline_s:.0f}s (sent at t={reply.sent_at:.1f}s)")
            return "hang"
        violations.append(f"status {reply.status} at t={reply.sent_at:.1f}s: {reply.body or reply.error}")
        return f"{reply.status} unexpected"

    def _during_retrieval_restart(self, reply: Reply) -> bool:
        end = reply.sent_at + reply.latency_s
        return any(reply.sent_at <= to and end >= down - 0.5 and replica == reply.replica
                   for down, to, replica in self.retrieval_down)
