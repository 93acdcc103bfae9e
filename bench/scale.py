"""Scale-out with ``tessera simulate``'s machinery: the real control plane over 4 to 1,000 simulated nodes.

For each fleet size N (generation nodes; one memory node per 8 of them, sharing the configured
shared-tier capacity unless --shared-blocks says otherwise), the synthetic
workload (a fixed corpus of --units records, Zipf-popular, 5 per request) is offered at
N × --rate-per-node req/s, --requests-per-node × N requests per run, the first half warming up.
A fixed corpus on a growing fleet is the question a deployment asks (more traffic, same
data): each node sees 1/N of a unit's requests, so what routing and the tiers make of that
shows in the hit rates. Printed per N: mean / p90 TTFT, unit tokens local/remote/computed,
load imbalance (max/mean requests per node), the control plane's real CPU time per request
(route + finalize + reports + heartbeats, timed with perf_counter) and the share of one core
that the offered rate needs from it (> 100%: one plane process saturates). Then, at
--tier-nodes nodes, the shared tier's size is swept in multiples of the corpus's blocks.

    PYTHONPATH=. flock /tmp/tessera-cpu.lock python bench/scale.py --cost-model llama3-8b-a100 --out docs

Prints numbers and writes scale_*.png; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tessera.benchmark.runner import system_config
from tessera.benchmark.workloads import synthetic_workload
from tessera.config_file import load_config
from tessera.units import blocks_for
from tessera_lab.simulate.command import fleet
from tessera_lab.simulate.costs import load_cost_model
from tessera_lab.simulate.run import SimOptions, cluster_figures, simulate_run
from tessera_lab.simulate.workload import render, unit_texts


def one_run(nodes: int, args: argparse.Namespace, shared_blocks: int = 0) -> dict[str, Any]:
    from tessera.benchmark.report import summarize

    base = fleet(load_config(args.config), nodes=nodes, memory_nodes=max(1, nodes // 8),
                 shared_blocks=shared_blocks or args.shared_blocks)
    config = system_config(base, args.system)
    n_requests = args.requests_per_node * nodes
    wl = synthetic_workload(n_requests, n_units=args.units, seed=args.seed)
    requests = render(config, wl, unit_texts(config, wl))
    rate = args.rate_per_node * nodes
    run = simulate_run(config, load_cost_model(args.cost_model), requests, rate,
                       SimOptions([args.system], [rate], seed=args.seed))
    summary = summarize(run.results, 0.5, rate)
    c = cluster_figures(run, 0.0)
    corpus_blocks = sum(blocks_for(n, config.block_tokens)
                        for n in {u: n for r in requests for u, n in r.unit_refs()}.values())
    return {"nodes": nodes, "rate": rate, "requests": n_requests, "mean": summary.get("mean"),
            "p90": summary.get("p90"), "hit_rate": summary["hit_rate"], "imbalance": c["imbalance_requests"],
            "plane_us": c["plane_cpu_per_request_us"], "plane_p50_us": c["plane_cpu_path_p50_us"],
            "plane_core_share": rate * c["plane_cpu_per_request_us"] / 1e6,
            "utilisation": c["mean_utilisation"], "shared_blocks": sum(k.capacity_blocks for k in config.kvpools),
            "corpus_blocks": corpus_blocks, "events": c["events"]}


def plot(rows: list[dict[str, Any]], tiers: list[dict[str, Any]], out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    n = [r["nodes"] for r in rows]
    for tier in ("local", "remote", "computed"):
        axes[0].plot(n, [r["hit_rate"][tier] for r in rows], marker="o", label=tier)
    axes[0].set(xscale="log", xlabel="generation nodes", ylabel="share of unit tokens",
                title="where unit states came from")
    axes[1].plot(n, [r["mean"] for r in rows], marker="o", label="mean")
    axes[1].plot(n, [r["p90"] for r in rows], marker="o", label="p90")
    axes[1].set(xscale="log", xlabel="generation nodes", ylabel="TTFT (s)", title="TTFT at a fixed rate per node")
    axes[2].plot(n, [100 * r["plane_core_share"] for r in rows], marker="o", label="core share needed")
    axes[2].axhline(100, color="grey", ls="--", label="one core")
    axes[2].set(xscale="log", yscale="log", xlabel="generation nodes", ylabel="% of one core",
                title="control plane CPU at the offered rate")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(out / "scale_nodes.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if tiers:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        x = [t["shared_blocks"] / t["corpus_blocks"] for t in tiers]
        ax.plot(x, [t["hit_rate"]["computed"] for t in tiers], marker="o", label="computed share of unit tokens")
        ax.plot(x, [t["hit_rate"]["remote"] for t in tiers], marker="o", label="remote share")
        ax.set(xlabel="shared tier size / corpus blocks", ylabel="share of unit tokens",
               title=f"shared tier size at {tiers[0]['nodes']} nodes")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        paths.append(out / "scale_shared_tier.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cost-model", default="llama3-8b-a100")
    ap.add_argument("--system", default="tessera")
    ap.add_argument("--nodes", default="4,16,64,256,1000")
    ap.add_argument("--rate-per-node", type=float, default=4.0)
    ap.add_argument("--requests-per-node", type=int, default=40)
    ap.add_argument("--units", type=int, default=2000, help="records in the fixed synthetic corpus")
    ap.add_argument("--shared-blocks", type=int, default=0,
                    help="shared tier blocks (0: as configured per memory node)")
    ap.add_argument("--tier-nodes", type=int, default=64, help="fleet size of the shared-tier sweep (0: skip)")
    ap.add_argument("--tier-fractions", default="0.125,0.25,0.5,1,2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write scale.json and the plots here")
    args = ap.parse_args()
    rows = []
    print("| nodes | rate (req/s) | mean / p90 TTFT (s) | unit tokens local/remote/computed | load imbalance "
          "| plane CPU per request, all calls (us) | route+finalize p50 (us) | one core's share needed |")
    print("|---|---|---|---|---|---|---|---|")
    for n in [int(x) for x in args.nodes.split(",")]:
        r = one_run(n, args)
        rows.append(r)
        h = r["hit_rate"]
        print(f"| {n} | {r['rate']:g} | {r['mean']:.3f} / {r['p90']:.3f} | {h['local']:.0%}/{h['remote']:.0%}/"
              f"{h['computed']:.0%} | {r['imbalance']:.2f} | {r['plane_us']:.0f} | {r['plane_p50_us']:.0f} | "
              f"{r['plane_core_share']:.0%} |",
              flush=True)
    tiers = []
    if args.tier_nodes:
        probe = one_run(args.tier_nodes, args)
        print(f"\nshared tier at {args.tier_nodes} nodes (corpus: {probe['corpus_blocks']} blocks of units)")
        print("| shared blocks | / corpus | mean TTFT (s) | unit tokens local/remote/computed |")
        print("|---|---|---|---|")
        for f in [float(x) for x in args.tier_fractions.split(",")]:
            t = one_run(args.tier_nodes, args, shared_blocks=max(1, int(f * probe["corpus_blocks"])))
            tiers.append(t)
            h = t["hit_rate"]
            print(f"| {t['shared_blocks']} | {f:g} | {t['mean']:.3f} | {h['local']:.0%}/{h['remote']:.0%}/"
                  f"{h['computed']:.0%} |", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scale.json").write_text(json.dumps({"nodes": rows, "shared_tier": tiers}, indent=1))
        title = f"{args.system}, {args.cost_model}, {args.rate_per_node:g} req/s per node"
        for p in plot(rows, tiers, args.out, title):
            print(f"plot: {p}")


if __name__ == "__main__":
    main()
