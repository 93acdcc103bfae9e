"""Start-up time and memory of a large durable unit store (SQLite records + usearch indexes).

Builds a store of N units (default 100k) in one scope with the served model's tokenizer,
synthetic texts and synthetic unit-norm 384-d embeddings (so MiniLM does not have to embed
100k texts; the real embedder is still loaded, as in the retrieval role), then measures, each
in a fresh process:

* open with the saved index (a clean restart): time of ``UnitStore(...)`` and RSS added;
* open after a crash: 1% more units were ingested (committed) after the last index save, so
  the saved index is caught up with them from the embeddings stored in SQLite;
* open with the index files removed: the index is rebuilt from SQLite (the worst case);
* retrieval latency by embedding (top-10) on the reopened store.

    PYTHONPATH=. flock /tmp/tessera-heavy.lock python bench/store_startup.py [--units 100000] [--dir PATH]

Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tessera.retrieval.store.unit_store import UnitStore

WORDS = ["river", "harbour", "lantern", "orchard", "ledger", "copper", "meadow", "falcon", "quarry", "violet",
         "signal", "marble", "thunder", "glacier", "pepper", "saddle", "canyon", "velvet", "ember", "tundra"]
DIM = 384


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def store_factory(directory: Path) -> Callable[[], UnitStore]:
    """How the retrieval role opens its store (tokenizer and MiniLM loaded first, not timed)."""
    import dataclasses

    from tessera.config_file import load_config
    from tessera.engines.checkpoint import resolve
    from tessera.engines.tokenizer import load_tokenizer, serving_fingerprint, unit_factory
    from tessera.retrieval.embedder import Embedder

    config = load_config()
    checkpoint = resolve(config.model)
    tokenizer = load_tokenizer(checkpoint)
    factory = unit_factory(config, serving_fingerprint(config, checkpoint, tokenizer), tokenizer)
    embedder = Embedder(threads=1)
    retrieval = dataclasses.replace(config.retrieval, data_dir=str(directory))
    return lambda: UnitStore(factory, embedder, retrieval)


def build(directory: Path, n: int, batch: int, first: int = 0, save: bool = True) -> dict[str, float]:
    store = store_factory(directory)()
    rng = np.random.default_rng(first)
    t0 = time.perf_counter()
    for start in range(first, first + n, batch):
        rows = range(start, min(start + batch, first + n))
        items = [("corpus", f"unit {i}: " + " ".join(rng.choice(WORDS, 40)), {"i": i}) for i in rows]
        vectors = rng.standard_normal((len(items), DIM)).astype(np.float32)
        store.ingest(items, vectors.tolist())
    ingest_s = time.perf_counter() - t0
    if not save:
        store.records.close()  # a crash: the batches are committed, the index is not saved
        return {"ingest_s": ingest_s}
    t0 = time.perf_counter()
    store.close()
    return {"ingest_s": ingest_s, "save_s": time.perf_counter() - t0}


def reopen(directory: Path) -> dict[str, float]:
    make = store_factory(directory)
    base = rss_mib()
    t0 = time.perf_counter()
    store = make()
    open_s = time.perf_counter() - t0
    added = rss_mib() - base
    rng = np.random.default_rng(1)
    lat = []
    for _ in range(200):
        v = rng.standard_normal(DIM).astype(np.float32)
        t = time.perf_counter()
        store.retrieve("corpus", embedding=v.tolist(), top_k=10)
        lat.append(time.perf_counter() - t)
    out = {"open_s": open_s, "rss_added_mib": added, "rss_total_mib": rss_mib(), "units": len(store),
           "rebuilt": float(bool(store.rebuilt)), "caught_up": float(sum(store.caught_up.values())),
           "retrieve_p50_ms": 1e3 * float(np.median(lat))}
    store.records.close()  # no save: leave the directory as it was
    return out


def child(phase: str, directory: Path, *extra: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--phase", phase, "--dir", str(directory), *extra],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--units", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--phase", choices=("all", "grow", "reopen"), default="all")
    args = ap.parse_args()
    if args.phase == "grow":  # ingest more after the saved index, then "crash"
        print(json.dumps(build(args.dir, args.units, args.batch, first=1 << 30, save=False)))
        return
    if args.phase == "reopen":
        print(json.dumps(reopen(args.dir)))
        return
    directory = args.dir or Path(tempfile.mkdtemp(prefix="tessera-store-bench-"))
    try:
        built = build(directory, args.units, args.batch)
        disk = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) / 2**20
        warm = child("reopen", directory)
        child("grow", directory, "--units", str(max(1, args.units // 100)))
        crashed = child("reopen", directory)
        for f in (directory / "index").glob("*.usearch"):
            f.unlink()  # what a crash before the first index save leaves
        cold = child("reopen", directory)
        print(f"{args.units} units, {DIM}-d embeddings; data dir {disk:.0f} MiB")
        print(f"  build: ingest {built['ingest_s']:.1f}s ({args.units / built['ingest_s']:.0f} units/s, "
              f"batches of {args.batch}), index save {built['save_s']:.1f}s")
        for name, r in (("saved index", warm), (f"crash, caught up {crashed['caught_up']:.0f}", crashed),
                        ("no index file, rebuilt", cold)):
            print(f"  open ({name}): {r['open_s']:.2f}s, RSS +{r['rss_added_mib']:.0f} MiB "
                  f"(process {r['rss_total_mib']:.0f} MiB with tokenizer + MiniLM), {r['units']:.0f} units, "
                  f"retrieve top-10 p50 {r['retrieve_p50_ms']:.2f} ms")
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
