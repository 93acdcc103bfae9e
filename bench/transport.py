"""Transport throughput: GB/s per transport and block size, next to two ceilings measured in the same run.

For each block size a real memory node process is started (its model geometry chosen so that
one slot is one block of that size) and a batch of blocks (``--total-mib`` per batch) is read
and written repeatedly through every transport. Baselines, same sizes, same run:

* ``memcpy``: one thread copying block by block between two buffers (bare memcpy per block);
* ``socket``: a plain blocking TCP socket on loopback to a sink process, ``sendall`` per block.

``tcp+tls`` is the tcp transport against a second memory node whose listeners, data port
included, speak TLS with a self-signed certificate (``openssl``), as a cluster with
``security.tls_cert_file`` runs across hosts.

    flock /tmp/tessera-cpu.lock python bench/transport.py [--seconds 1.0] [--total-mib 64]
    sudo flock /tmp/tessera-cpu.lock python bench/transport.py --hosts   # across network namespaces

``--hosts`` puts the memory node on a host of its own (tessera_lab/hosts/netns.py: a network
namespace with its own address, a veth into a bridge) and measures from a second host, so
every byte crosses two veths and a bridge: the network transports only (``shm`` needs one
host); the ceilings stay on loopback.

Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from tessera.auth import CapabilityIssuer, ClusterAuth, create_secret
from tessera.config import (
    ClusterConfig,
    GenerationNodeConfig,
    KVPoolNodeConfig,
    ModelConfig,
    SecurityConfig,
    TransportConfig,
)
from tessera.config_file import dump_toml
from tessera.errors import ConfigError
from tessera.generation.pool_client import capabilities
from tessera.messages.common import BlockRef
from tessera.transport.arena import SHM_DIR
from tessera.transport.base import NodeEndpoint, SlotIO, create_transport
from tessera.transport.handshake import DataPlaneCredentials
from tessera.wire import from_wire

SIZES = {"16 KiB": 16 << 10, "256 KiB": 256 << 10, "4 MiB": 4 << 20}
BLOCK_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mooncake_available() -> bool:
    from tessera.transport.mooncake import load_engine_class

    try:
        load_engine_class()
    except ConfigError as exc:
        print(f"# mooncake skipped: {exc}")
        return False
    return True


# --- baselines ------------------------------------------------------------------------------


def bench_memcpy(block: int, n: int, seconds: float) -> float:
    src = memoryview(np.random.default_rng(0).integers(0, 255, block * n, dtype=np.uint8).tobytes())
    dst = memoryview(bytearray(block * n))
    pairs = [(dst[i * block : (i + 1) * block], src[i * block : (i + 1) * block]) for i in range(n)]
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for d, s in pairs:
            d[:] = s  # a bare memcpy per block
        done += block * n
    return done / (time.perf_counter() - start) / 1e9


SINK_DEADLINE_S = 120.0  # a fresh interpreter on a loaded machine: generous, never a figure being measured


class NotStarted(RuntimeError):
    """A helper process this bench needs did not come up; the message is one line that says why."""


def _sink(ready: Connection, block: int) -> None:
    """Listen on a free loopback port, tell the parent which one, then drain one connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ready.send(server.getsockname()[1])  # listening: the parent's connect cannot be refused now
        ready.close()
        conn, _ = server.accept()
        buf = memoryview(bytearray(block))
        with conn:
            while conn.recv_into(buf):
                pass


def start_sink(block: int, deadline_s: float = SINK_DEADLINE_S,
               target: Callable[[Connection, int], None] = _sink) -> tuple[BaseProcess, int]:
    """A sink process (``target``) and the port it listens on, once it says it listens.

    The sink is a fresh interpreter (``spawn``) that imports this module again, which on a busy
    machine can take many seconds: the parent waits for the sink's own word, not for a number of
    connection attempts, and stops at ``deadline_s`` or as soon as the sink dies."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    sink = ctx.Process(target=target, args=(theirs, block), daemon=True)
    sink.start()
    theirs.close()  # only the sink holds the sending end: its death reads as EOF, which ends the poll
    deadline = time.monotonic() + deadline_s
    try:
        while not ours.poll(0.1):
            if time.monotonic() > deadline:
                sink.kill()
                raise NotStarted(f"socket sink process did not listen within {deadline_s:.0f} s")
        try:
            port = int(ours.recv())
        except EOFError:
            sink.join(5)
            raise NotStarted(f"socket sink process exited with code {sink.exitcode} before it listened") from None
    finally:
        ours.close()
    return sink, port


def bench_socket(block: int, n: int, seconds: float) -> float:
    sink, port = start_sink(block)
    payload = memoryview(bytearray(os.urandom(block)))
    done, start = 0, time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=SINK_DEADLINE_S) as sock:
            while time.perf_counter() - start < seconds:
                for _ in range(n):
                    sock.sendall(payload)
                done += block * n
    except OSError as exc:
        sink.kill()
        sink.join(5)
        raise NotStarted(f"socket sink stopped reading (exit code {sink.exitcode}): {exc}") from None
    elapsed = time.perf_counter() - start
    sink.join(5)
    return done / elapsed / 1e9


# --- a memory node whose slot is one block of the given size ----------------------------------


class Node:
    def __init__(self, workdir: Path, block: int, n: int, transport: str, tls: bool = False,
                 host: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        # 1 layer, 1 kv head, fp16: token = 4 * head_dim bytes; B tokens = block - header
        head_dim = max(1, (block - 64) // (4 * BLOCK_TOKENS))
        model = workdir / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text(json.dumps({
            "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": head_dim,
            "hidden_size": head_dim, "vocab_size": 16, "max_position_embeddings": 64}))
        node = KVPoolNodeConfig("kvb", host=host, port=free_port(), data_port=free_port(), capacity_blocks=n)
        config = ClusterConfig(block_tokens=BLOCK_TOKENS, model=ModelConfig(source=str(model)),
                               transport=TransportConfig(name=transport, timeout_s=30.0), kvpools=(node,),
                               generation=(GenerationNodeConfig("gen0", port=free_port()),))
        config = dataclasses.replace(config, retrieval=dataclasses.replace(config.retrieval, port=free_port()))
        # a cluster secret, as every deployment has: the node demands the handshake and capabilities
        self.secret = create_secret(workdir / "secret")
        config = dataclasses.replace(config, security=SecurityConfig(secret_file=str(workdir / "secret")))
        self.ssl: ssl.SSLContext | None = None
        if tls:
            cert, key = workdir / "cert.pem", workdir / "key.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                            "-out", str(cert), "-days", "1", "-subj", f"/CN={host}",
                            "-addext", f"subjectAltName=IP:{host}"], check=True, capture_output=True)
            key.chmod(0o600)
            security = dataclasses.replace(config.security, tls_cert_file=str(cert), tls_key_file=str(key))
            config = dataclasses.replace(config, security=security)
            self.ssl = ssl.create_default_context(cafile=str(cert))
        self.config = config
        path = workdir / "tessera.toml"
        path.write_text(dump_toml(config))
        self.log = open(workdir / "kvpool.log", "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "tessera", "run", "--role", "kvpool", "--config",
                                      str(path), "--log-level", "warning"], stdout=self.log, stderr=subprocess.STDOUT)
        url = f"{config.scheme}://{host}:{node.port}/info"
        deadline = time.monotonic() + SINK_DEADLINE_S
        while True:
            try:
                signed = urllib.request.Request(url, headers=ClusterAuth(self.secret).headers("GET", url))
                with urllib.request.urlopen(signed, timeout=1, context=self.ssl) as resp:
                    self.endpoint = from_wire(NodeEndpoint, json.loads(resp.read()))
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise NotStarted(f"memory node exited with code {self.proc.returncode} before it answered: "
                                     f"{self._last_log_line()}") from None
                if time.monotonic() > deadline:
                    self.proc.kill()
                    raise NotStarted(f"memory node did not answer {url} within {SINK_DEADLINE_S:.0f} s: "
                                     f"{self._last_log_line()}") from None
                time.sleep(0.1)

    def _last_log_line(self) -> str:
        self.log.flush()
        lines = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(its log is empty)"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        (SHM_DIR / self.endpoint.shm_name).unlink(missing_ok=True)


async def bench_transport(name: str, node: Node, seconds: float) -> tuple[float, float]:
    ep = node.endpoint
    transport = create_transport(dataclasses.replace(node.config.transport, name=name.removesuffix("+tls")),
                                 DataPlaneCredentials(node.secret, "gen0", node.ssl))
    bufs = [memoryview(bytearray(os.urandom(ep.slot_bytes))) for _ in range(ep.capacity_blocks)]
    issuer, blocks = CapabilityIssuer(node.secret), tuple(BlockRef(ep.name, i) for i in range(len(bufs)))
    epochs = iter(range(1, 1 << 40))

    def batch(op: str) -> list[SlotIO]:
        """The batch under a fresh capability, as the control plane signs one per lease or grant."""
        epoch = next(epochs)
        cap = capabilities(blocks, epoch, issuer.issue(op, blocks, epoch, 60.0, holder="gen0"))[ep.name]
        return [SlotIO(i, b, cap) for i, b in enumerate(bufs)]

    batch_bytes = ep.slot_bytes * len(bufs)
    out = []
    try:
        for name_op, op in (("read", transport.read), ("write", transport.write)):
            await op(ep, batch(name_op))  # warm: connections, mappings, staging buffers
            done, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                await op(ep, batch(name_op))  # a write grant is single-use: one per batch
                done += batch_bytes
            out.append(done / (time.perf_counter() - start) / 1e9)
    finally:
        await transport.close()
    return out[0], out[1]


def measure(args: argparse.Namespace, transports: list[str]) -> list[tuple[str, str, float, float]]:
    """One row (block size, path, read GB/s, write GB/s) per measurement."""
    rows: list[tuple[str, str, float, float]] = []
    for label in args.sizes.split(","):
        block = SIZES[label]
        n = max(1, (args.total_mib << 20) // block)
        rows.append((label, "memcpy", bench_memcpy(block, n, args.seconds), float("nan")))
        rows.append((label, "socket", bench_socket(block, n, args.seconds), float("nan")))
        with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp, contextlib.ExitStack() as stack:
            where: dict[str, Any] = {}
            if args.hosts:
                from tessera_lab.hosts.netns import Network, unavailable

                if (why := unavailable()) is not None:
                    sys.exit(f"--hosts: {why}")
                net = stack.enter_context(Network.create(["kvb", "client"]))
                where = {"host": net.address("kvb"), "prefix": ("ip", "netns", "exec", net.namespace("kvb"))}
                stack.enter_context(net.inside("client"))  # the measuring thread: on the other host
            node = Node(Path(tmp) / "plain", block, n, "mooncake" if "mooncake" in transports else "tcp", **where)
            stack.callback(node.stop)
            tls = None
            if "tcp+tls" in transports:
                tls = Node(Path(tmp) / "tls", block, n, "tcp", tls=True, **where)
                stack.callback(tls.stop)
            for name in transports:
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    on = tls if name == "tcp+tls" and tls is not None else node
                    read, write = runner.run(bench_transport(name, on, args.seconds))
                rows.append((label, name, read, write))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    parser.add_argument("--total-mib", type=int, default=64, help="bytes per batch (MiB)")
    parser.add_argument("--transports", default="shm,tcp,tcp+tls,mooncake", help="comma-separated subset")
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of " + ", ".join(SIZES))
    parser.add_argument("--hosts", action="store_true",
                        help="memory node and client on two hosts (network namespaces; needs root)")
    args = parser.parse_args()
    wanted = [t for t in args.transports.split(",") if not (args.hosts and t == "shm")]
    with_mooncake = "mooncake" in wanted and mooncake_available()
    transports = [t for t in wanted if t != "mooncake" or with_mooncake]
    try:
        rows = measure(args, transports)
    except NotStarted as exc:
        sys.exit(f"bench/transport.py: {exc}")
    print(f"\n{'block':>8}  {'path':<9} {'read GB/s':>10} {'write GB/s':>11}")
    for label, name, read, write in rows:
        w = "" if write != write else f"{write:11.2f}"
        print(f"{label:>8}  {name:<9} {read:10.2f} {w:>11}")
    print("(memcpy: one thread, a bare memcpy per block; socket: blocking sendall per block to a sink process "
          "on loopback; one-way, so one column)" + ("; transports: across two hosts" if args.hosts else ""))


if __name__ == "__main__":
    main()
