"""The comparison's plots: validation curves (mean over seeds, band from the min to the max seed) and
a bar chart of the mean final loss per variant with its confidence interval."""

from __future__ import annotations

import math
from pathlib import Path

from ..plots import _pyplot
from .table import Row


def plot_curves(rows: list[Row], out: Path, title: str) -> Path | None:
    """Validation loss per variant: mean over seeds, band from the min to the max seed."""
    import numpy as np

    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.8))
    drawn = False
    for r in rows:
        curves = [dict(x.val_curve) for x in r.records if x.val_curve]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        if not steps:
            continue
        vals = np.array([[c[s] for s in steps] for c in curves])  # (seeds, steps)
        line, = ax.plot(steps, vals.mean(0), "o-", ms=3, label=f"{r.variant.name} (n={len(curves)})")
        if len(curves) > 1:
            ax.fill_between(steps, vals.min(0), vals.max(0), color=line.get_color(), alpha=0.2)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("val/loss (nats/token)")
    ax.set_title(title + "\nmean over seeds; band: min..max over seeds", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    # the interesting part is the end: zoom on the last two thirds of the curves
    ends = [v for r in rows for x in r.records for s, v in x.val_curve if x.val_curve and s >= x.val_curve[-1][0] / 3]
    if ends:
        lo, hi = min(ends), max(ends)
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_bars(rows: list[Row], out: Path, title: str, level: float = 0.95, reference: str | None = None) -> Path | None:
    """Mean final val loss per variant with its Student-t interval as error bars (none for n < 2),
    the reference's mean as a dashed line; the axis starts near the lowest interval, not at 0."""
    plt = _pyplot()

    shown = [r for r in rows if math.isfinite(r.interval.estimate)]
    if not shown:
        return None
    means = [r.interval.estimate for r in shown]
    errs = [r.interval.half_width if math.isfinite(r.interval.half_width) else 0.0 for r in shown]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(shown) + 2), 4.8))
    colors = ["tab:gray" if r.variant.name == reference else "tab:blue" if r.variant.kind == "residual"
              else "tab:orange" for r in shown]
    ax.bar(range(len(shown)), means, yerr=errs, capsize=4, color=colors, alpha=0.85)
    for i, r in enumerate(shown):
        ax.annotate(f"n={len(r.records)}", (i, means[i] + errs[i]), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ref = next((r for r in shown if r.variant.name == reference), None)
    if ref is not None:
        ax.axhline(ref.interval.estimate, color="tab:gray", ls="--", lw=1, label=f"{reference} mean")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels([r.variant.name for r in shown], rotation=30, ha="right")
    lo = min(m - e for m, e in zip(means, errs))
    hi = max(m + e for m, e in zip(means, errs))
    ax.set_ylim(lo - 0.15 * (hi - lo + 1e-9), hi + 0.15 * (hi - lo + 1e-9))
    ax.set_ylabel("final val/loss (nats/token)")
    ax.set_title(f"{title}\nmean over seeds, bars: {round(level * 100)}% t interval "
                 "(blue: residuals, orange: ablations)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
