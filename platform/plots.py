"""End-of-run figures: the loss curves and the depth-attention heatmaps (logged under `plots/`).

Both are drawn with matplotlib's Agg backend (no display needed) at a size that reads on a laptop
screen: the heatmaps share one colour scale and one colorbar, so views can be compared by eye.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curves(client, run_id: str, out: Path, title: str = "loss") -> Path | None:
    """Train and validation loss of one MLflow run against the optimizer step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for key, style in (("train/loss", "-"), ("val/loss", "o-")):
        hist = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        if hist:
            ax.plot([m.step for m in hist], [m.value for m in hist], style, label=key, alpha=0.8)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def source_mask(residual, shape: tuple[int, int]) -> np.ndarray | None:
    """True where a source does not exist for a consumer (depth-attention variants), else None."""
    n_sources = getattr(residual, "n_sources", None)
    if n_sources is None:
        return None
    rows, cols = shape
    exists = np.arange(rows)[:, None] < np.array([n_sources(c) for c in range(cols)])[None, :]
    return ~exists


def source_labels(residual, rows: int) -> list[str]:
    """Row labels: the embedding, then sublayer outputs (full depth attention) or block summaries."""
    cfg = getattr(residual, "cfg", None)
    block = getattr(cfg, "block_size", None)
    if block and block > 1:
        return ["embedding"] + [f"block {r - 1} (summary; partial while open)" for r in range(1, rows)]
    return ["embedding"] + [f"sublayer {r - 1}" for r in range(1, rows)]


def plot_depth_weights(recorded: dict, out: Path, title: str, residual=None) -> Path | None:
    """One heatmap per view: sources (rows) x consuming sublayer (columns), mean weight over tokens.

    Sources a consumer cannot see (later sublayers, blocks not started) are masked, not drawn as 0.
    All views share one colour scale and one colorbar."""
    if not recorded:
        return None
    plt = _pyplot()
    names = sorted(recorded)
    tables = {n: recorded[n].detach().float().cpu().numpy() for n in names}
    masks = {n: source_mask(residual, w.shape) if residual is not None else None for n, w in tables.items()}
    shown = {n: np.ma.masked_array(w, mask=np.isnan(w) | (masks[n] if masks[n] is not None else False))
             for n, w in tables.items()}
    vmin = min(0.0, min(float(w.min()) for w in shown.values() if w.count()))
    vmax = max(1e-6, max(float(w.max()) for w in shown.values() if w.count()))
    cols = min(len(names), 2 if len(names) == 4 else 3)
    rows = math.ceil(len(names) / cols)
    first = next(iter(tables.values()))
    labels = source_labels(residual, first.shape[0]) if residual is not None else None
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols + (2.2 if labels else 0.8) + 1.0, 2.9 * rows + 0.8),
                             squeeze=False, sharey=True, constrained_layout=True)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#d9d9d9")  # masked: no such source for this consumer
    im = None
    for i, ax in enumerate(axes.ravel()):
        if i >= len(names):
            ax.set_visible(False)
            continue
        name, w = names[i], shown[names[i]]
        im = ax.imshow(w, aspect="auto", origin="lower", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set_title(name)
        n_src, n_cons = w.shape
        ax.set_xticks(range(n_cons))
        ax.set_xticklabels([str(c) if c < n_cons - 1 else "out" for c in range(n_cons)], fontsize=7)
        ax.set_yticks(range(n_src))
        if i % cols == 0:
            ax.set_yticklabels(labels if labels and len(labels) == n_src else range(n_src), fontsize=7)
            ax.set_ylabel("source")
        if i // cols == rows - 1 or i + cols >= len(names):
            ax.set_xlabel("consuming sublayer (out: final output)")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.9, label="mean weight (grey: no such source)")
    fig.suptitle(title)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
