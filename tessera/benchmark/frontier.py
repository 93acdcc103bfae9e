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
    """Speed–fidelity frontier: composed prefill time against mean KL and greedy agreement;
    a colour per policy, a marker per unit lead, each point of the KL panel labelled by the
    knobs that differ."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    names = _short_labels(rows)
    policies = list(dict.fromkeys(r.setting.policy for r in rows))
    for ax, key, ylabel in ((axes[0], "kl", "mean KL vs full prefill"),
                            (axes[1], "prefix", "greedy agreement (share before first difference)")):
        for policy in policies:
            for lead, marker in (("", "o"), ("lead", "s")):
                pts = [r for r in rows if r.setting.policy == policy and bool(r.setting.unit_lead) == bool(lead)]
                if not pts:
                    continue
                xs = [r.seconds for r in pts]
                ys = [getattr(r, key).mean for r in pts]
                errs = [[getattr(r, key).mean - getattr(r, key).lo for r in pts],
                        [getattr(r, key).hi - getattr(r, key).mean for r in pts]]
                ax.errorbar(xs, ys, yerr=errs, fmt=marker, capsize=3, alpha=0.8,
                            label=f"{policy}, unit lead" if lead else policy)
                for r, x, y in zip(pts, xs, ys, strict=True):
                    if key == "kl" and names[r.setting.label]:  # one panel labelled: the other is the same x
                        ax.annotate(names[r.setting.label], (x, y), fontsize=6, xytext=(3, 3),
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


def _short_labels(rows: Sequence[Row]) -> dict[str, str]:
    """Each setting's label without its policy (the colour says it) and without the knobs that
    have one value in every row naming them."""
    parts = {r.setting.label: r.setting.label.split()[1:] for r in rows}
    values: dict[str, set[str]] = {}
    for ps in parts.values():
        for p in ps:
            values.setdefault(p.split("=")[0], set()).add(p)
    return {label: " ".join(p for p in ps if len(values[p.split("=")[0]]) > 1) for label, ps in parts.items()}
