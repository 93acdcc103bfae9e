"""GPU figures for Tessera (driven by bench/gpu.sh; prints and writes files, never asserts).

Three sections, each written to OUT as soon as it is done (a timeout keeps what finished):

1. ``prefill``: prefill tokens/s of the 8B shape (``random:llama-3.1-8b``, bfloat16) at 1k/4k/16k
   prompt tokens: full prefill vs composed prefill (the served composition policy, over units
   of 256 tokens) with unit states already on the GPU and staged in pinned host memory (the
   local-cache path), for the paged and the reference engine;
2. ``ttft``: unloaded TTFT of the served path (HTTP chat, all units cached) against its compute
   floor: the same engine composing the same layout in-process (prefix hit, placement of
   pinned-host states, final extend);
3. ``sweep``: a short ``tessera bench`` sweep of prefix vs tessera, synthetic and LoCoMo, with
   the two generation nodes of bench/gpu.toml sharing the GPU.

    python bench/gpu.py --out results/gpu                # on a GPU (bench/gpu.sh does this)
    python bench/gpu.py --cpu-smoke --out /tmp/smoke     # tiny shapes on CPU: tests this script

The composition policy is the one the run's config serves (``policy_from_config``), in every
section: ``--config`` an overlay of bench/gpu.toml to measure another policy or other settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tessera.composition.layout import layout_from_trace
from tessera.composition.policies import CompositionPolicy, policy_from_config
from tessera.config import ClusterConfig
from tessera.config_file import load_config
from tessera.engines.base import ENGINES, EngineAdapter, UnitState
from tessera.engines.device import to_host
from tessera.engines.offline import compose, prefill, prefill_units
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
from tessera.ports import on_free_ports

ROOT = Path(__file__).resolve().parents[1]
UNIT_TOKENS = 256
WORDS = ["harbour", "lighthouse", "orchard", "ferry", "ledger", "record", "notebook", "river", "bridge",
         "market", "winter", "summer", "keeper", "captain", "merchant", "village", "tower", "garden",
         "letter", "signal", "morning", "evening", "station", "island", "valley"]


@dataclasses.dataclass
class Setup:
    config: ClusterConfig
    lengths: list[int]
    repeats: int
    sweep: list[str]  # extra `tessera bench` arguments per workload, joined later
    engines: tuple[str, ...]


def setup(args: argparse.Namespace) -> Setup:
    cfg = load_config(args.config)
    if args.cpu_smoke:
        model = dataclasses.replace(cfg.model, source="random:tiny", dtype="float32", device="cpu", threads=1,
                                    max_context=2048, kv_pool_tokens=16384)
        gens = tuple(dataclasses.replace(g, local_capacity_blocks=256, max_batch_tokens=512) for g in cfg.generation)
        pools = tuple(dataclasses.replace(p, capacity_blocks=512) for p in cfg.kvpools)
        cfg = dataclasses.replace(cfg, kv_dtype="float32", model=model, generation=gens, kvpools=pools,
                                  retrieval=dataclasses.replace(cfg.retrieval, embed_threads=1))
        return Setup(cfg, [300, 600, 1200], 2, ["--requests", "8", "--rates", "1", "--unloaded", "2"],
                     ("paged", "reference"))
    lengths = [int(x) for x in args.lengths.split(",")]
    return Setup(cfg, lengths, 3, ["--requests", str(args.sweep_requests), "--rates", args.sweep_rates,
                                   "--unloaded", "3"], ("paged", "reference"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up run (device work included)."""
    fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def rag_layout(n_tokens: int, seed: int, vocab: int) -> PromptLayout:
    """System text (64) | units of 256 tokens separated by 2 | question (32): ``n_tokens`` in all."""
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in torch.randint(100, vocab, (n,), generator=g))

    n_units = max(1, (n_tokens - 96) // (UNIT_TOKENS + 2))
    segments = [Segment(SegmentKind.TEXT, toks(64))]
    for i in range(n_units):
        segments.append(Segment(SegmentKind.UNIT, toks(UNIT_TOKENS), f"u{i}"))
        segments.append(Segment(SegmentKind.TEXT, toks(2)))
    used = 64 + n_units * (UNIT_TOKENS + 2)
    segments.append(Segment(SegmentKind.TEXT, toks(max(1, n_tokens - used))))
    return PromptLayout(tuple(segments))


def engine_for(cfg: ClusterConfig, name: str) -> EngineAdapter:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, engine=name))
    return ENGINES.get(name).from_config(cfg, 1 << 16)


def host_states(states: dict[str, UnitState]) -> dict[str, UnitState]:
    out = {}
    for uid, st in states.items():
        copy, done = to_host(st)
        if done is not None:
            done.synchronize()
        out[uid] = copy
    return out


def served_policy(cfg: ClusterConfig) -> CompositionPolicy:
    """The composition policy the cluster of ``cfg`` serves, built the way its nodes build it."""
    return policy_from_config(cfg.composition)


def _prefill_rows(engine: EngineAdapter, name: str, s: Setup) -> list[dict[str, Any]]:
    policy = served_policy(s.config)
    device = torch.device(s.config.model.device)
    rows = []
    for n in s.lengths:
        layout = rag_layout(n, seed=n, vocab=engine.geometry.vocab_size)
        states = prefill_units(engine, layout)
        pinned = host_states(states)
        full = timed(functools.partial(prefill, engine, layout.token_ids()), device, s.repeats)
        on_device = timed(functools.partial(compose, engine, layout, policy, states, use_prefix_cache=False),
                          device, s.repeats)
        from_host = timed(functools.partial(compose, engine, layout, policy, pinned, use_prefix_cache=False),
                          device, s.repeats)
        row = {"engine": name, "prompt_tokens": layout.n_tokens, "units": len(states),
               "full_s": full, "composed_device_s": on_device, "composed_host_s": from_host,
               "full_tok_s": layout.n_tokens / full, "composed_device_tok_s": layout.n_tokens / on_device,
               "composed_host_tok_s": layout.n_tokens / from_host}
        rows.append(row)
        print(f"[prefill] {name} {layout.n_tokens} tok: full {row['full_tok_s']:.0f} tok/s, composed "
              f"{row['composed_device_tok_s']:.0f} (states on device) / {row['composed_host_tok_s']:.0f} "
              f"(pinned host) tok/s -> {full / from_host:.2f}x", flush=True)
    return rows


def section_prefill(s: Setup, out: Path) -> dict[str, Any]:
    rows = []
    for name in s.engines:
        rows += _prefill_rows(engine_for(s.config, name), name, s)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result = {"shape": s.config.model.source, "dtype": s.config.model.dtype,
              "composition": dataclasses.asdict(s.config.composition), "unit_tokens": UNIT_TOKENS, "rows": rows}
    (out / "prefill.json").write_text(json.dumps(result, indent=2))
    return result


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        payload: dict[str, Any] = json.loads(resp.read())
    return payload


def _units(rng: random.Random, n: int, words: int) -> list[str]:
    return [f"Record {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "." for i in range(n)]


def section_ttft(s: Setup, out: Path, n_requests: int = 5) -> dict[str, Any]:
    from tessera.launcher import LocalCluster

    cfg = on_free_ports(s.config)  # every listener, the internal plane too
    rng = random.Random(0)
    requests = [(_units(rng, 5, 180), f"Question {i}: which record mentions the {rng.choice(WORDS)}?")
                for i in range(n_requests)]
    url = cfg.retrieval_url + "/v1/chat/completions"
    served: list[tuple[float, dict[str, Any]]] = []
    cluster = LocalCluster(cfg, log_dir=out / "logs-ttft", quiet=True)
    cluster.start(timeout=600)
    try:
        for rnd in range(3):  # 0: compute and retain; 1: warm; 2: measured (all units local)
            for units, question in requests:
                body = {"model": "tessera", "messages": [{"role": "system", "content": "Answer briefly."},
                                                         {"role": "user", "content": question}],
                        "context_units": units, "max_tokens": 1, "temperature": 0, "return_layout": True}
                t = time.perf_counter()
                response = _post(url, body)
                if rnd == 2:
                    served.append((time.perf_counter() - t, response))
            time.sleep(1.0)  # let retention land between rounds
    finally:
        cluster.stop()
    engine = engine_for(cfg, cfg.model.engine)
    device = torch.device(cfg.model.device)
    policy = served_policy(cfg)
    rows = []
    for ttft, response in served:
        # inline is idempotent: a no-op on a served layout, which the retrieval role already inlined
        layout = policy.inline(layout_from_trace(response["tessera_layout"]))
        states = host_states(prefill_units(engine, layout))
        compose(engine, layout, policy, states, insert_prefix=True)  # the system prompt's prefix hit
        floor = timed(functools.partial(compose, engine, layout, policy, states), device, s.repeats)
        usage = response["usage"]["tessera"]
        rows.append({"prompt_tokens": layout.n_tokens, "ttft_s": ttft, "floor_s": floor, "ratio": ttft / floor,
                     "local_units": usage.get("local_units"), "remote_units": usage.get("remote_units"),
                     "computed_units": usage.get("computed_units")})
        print(f"[ttft] {layout.n_tokens} tok: served {ttft * 1e3:.1f} ms vs floor {floor * 1e3:.1f} ms "
              f"-> {ttft / floor:.2f}x (units local/remote/computed {usage.get('local_units')}/"
              f"{usage.get('remote_units')}/{usage.get('computed_units')})", flush=True)
    result = {"rows": rows, "median_ratio": statistics.median(r["ratio"] for r in rows)}
    (out / "ttft.json").write_text(json.dumps(result, indent=2))
    return result


def section_sweep(s: Setup, out: Path, data_dir: Path | None) -> dict[str, Any]:
    from tessera.config_file import dump_toml

    config_path = out / "sweep.toml"
    config_path.write_text(dump_toml(s.config))
    results = {}
    for workload, extra in (("synthetic", []), ("locomo", ["--conversations", "1"])):
        target = out / f"bench-{workload}"
        cmd = [sys.executable, "-m", "tessera", "bench", "--workload", workload, "--systems", "prefix,tessera",
               "--config", str(config_path), "--out", str(target), *s.sweep, *extra]
        if data_dir is not None:
            cmd += ["--data-dir", str(data_dir)]
        print("[sweep] " + " ".join(cmd), flush=True)
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        (out / f"sweep-{workload}.log").write_text(done.stdout + done.stderr)
        print(done.stdout[-3000:], flush=True)
        results[workload] = {"returncode": done.returncode}
    (out / "sweep.json").write_text(json.dumps(results, indent=2))
    return results


SECTIONS = ("prefill", "ttft", "sweep")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "gpu")
    ap.add_argument("--config", type=Path, default=ROOT / "bench" / "gpu.toml",
                    help="the cluster config (composition policy included) every section runs")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (tests this script)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--sweep-rates", default="8")
    ap.add_argument("--sweep-requests", type=int, default=40)
    ap.add_argument("--data-dir", type=Path, default=None, help="folder with locomo/ (default ../shared/data)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; expected some of {', '.join(SECTIONS)}")
    return args


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    s = setup(args)
    print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}; torch {torch.__version__}; "
          f"shape {s.config.model.source} {s.config.model.dtype} on {s.config.model.device}; "
          f"composition {s.config.composition}", flush=True)
    sections = args.sections.split(",")
    summary: dict[str, Any] = {}
    if "prefill" in sections:
        summary["prefill"] = section_prefill(s, args.out)
    if "ttft" in sections:
        summary["ttft"] = section_ttft(s, args.out)
    if "sweep" in sections:
        summary["sweep"] = section_sweep(s, args.out, args.data_dir)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
