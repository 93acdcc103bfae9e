"""The speed–fidelity frontier of ``tessera verify --frontier``: one plot, two panels.

x: each setting's composed prefill time offline (unit states ready); y: mean KL and greedy
agreement against full prefill, with their 95% intervals. Knows nothing about engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tessera.benchmark.extras import pyplot
from tessera.benchmark.verify import Row


def plot_frontier(rows: Sequence[Row], path: Path, title: str) -> Path:
    """Speed–fidelity frontier: composed prefill time against mean KL and greedy agreement."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, ylabel in ((axes[0], "kl", "mean KL vs full prefill"),
                            (axes[1], "prefix", "greedy agreement (share before first difference)")):
        for lead, marker in (("", "o"), ("lead", "s")):
            pts = [r for r in rows if bool(r.setting.unit_lead) == bool(lead)]
            if not pts:
                continue
            xs = [r.seconds for r in pts]
            ys = [getattr(r, key).mean for r in pts]
            errs = [[getattr(r, key).mean - getattr(r, key).lo for r in pts],
                    [getattr(r, key).hi - getattr(r, key).mean for r in pts]]
            ax.errorbar(xs, ys, yerr=errs, fmt=marker, capsize=3, label="with unit lead" if lead else "plain units")
            for r, x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(r.setting.label.replace(" lead=none", ""), (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_xlabel("composed prefill per request (s, offline, unit states ready)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
