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


def partial_cells(residual, shape: tuple[int, int]) -> list[tuple[int, int]]:
    """(source row, consumer) cells that hold the partial sum of the block still being built."""
    block = getattr(getattr(residual, "cfg", None), "block_size", None)
    if not block or block < 2 or getattr(residual, "n_sources", None) is None:
        return []
    return [(1 + c // block, c) for c in range(shape[1]) if c % block and 1 + c // block < shape[0]]


def axis_labels(residual, shape: tuple[int, int]) -> dict:
    """Tick labels and axis titles for one view of this residual's recording."""
    rows, cols = shape
    if getattr(residual, "n_sources", None) is not None:  # depth attention: sources x consumers
        block = getattr(getattr(residual, "cfg", None), "block_size", None)
        if block and block > 1:
            y = ["embedding"] + [f"block {r - 1} summary" for r in range(1, rows)]
        else:
            y = ["embedding"] + [f"sublayer {r - 1}" for r in range(1, rows)]
        return {"y": y, "ylabel": "source", "x": [str(c) for c in range(cols - 1)] + ["out"],
                "xlabel": "consuming sublayer (out: final output)"}
    n = getattr(getattr(residual, "cfg", None), "n", None) or cols  # streams (mHC)
    pairs = n * n == cols and n > 1  # an n x n mixing matrix, row-major
    x = [f"{i}{j}" for i in range(n) for j in range(n)] if pairs else [str(c) for c in range(cols)]
    xlabel = "entry ij: stream j into new stream i" if pairs else "stream"
    return {"y": [f"sublayer {r}" for r in range(rows)], "ylabel": "sublayer", "x": x, "xlabel": xlabel}


def _owner(residual, name: str):
    """The (sub)residual that recorded view `name` (`part.view` for a residual made of parts)."""
    part = name.split(".")[0] if "." in name else None
    return getattr(residual, part, residual) if part else residual


def plot_depth_weights(recorded: dict, out: Path, title: str, residual=None) -> Path | None:
    """One heatmap per recorded view, token-mean weights, one shared colour scale and colorbar.

    Depth attention: sources (rows) x consuming sublayer (columns); sources a consumer cannot see
    (later sublayers, blocks not started) are masked grey, not drawn as 0, and for block variants
    the cells holding the partial sum of the open block are marked "p". mHC: sublayer x stream."""
    if not recorded:
        return None
    plt = _pyplot()
    names = sorted(recorded)
    tables = {n: recorded[n].detach().float().cpu().numpy() for n in names}
    owners = {n: _owner(residual, n) for n in names}
    shown = {}
    for n, w in tables.items():
        mask = np.isnan(w)
        extra = source_mask(owners[n], w.shape) if residual is not None else None
        shown[n] = np.ma.masked_array(w, mask=mask | extra if extra is not None else mask)
    vmin = min(0.0, min(float(w.min()) for w in shown.values() if w.count()))
    vmax = max(1e-6, max(float(w.max()) for w in shown.values() if w.count()))
    same = len({(w.shape, type(owners[n])) for n, w in shown.items()}) == 1
    cols = min(len(names), 2 if len(names) == 4 else 3)
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 3.0, 2.9 * rows + 0.8), squeeze=False,
                             sharey=same, constrained_layout=True)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#d9d9d9")  # masked: no such source for this consumer
    im, any_partial = None, False
    for i, ax in enumerate(axes.ravel()):
        if i >= len(names):
            ax.set_visible(False)
            continue
        name, w = names[i], shown[names[i]]
        im = ax.imshow(w, aspect="auto", origin="lower", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set_title(name)
        labels = axis_labels(owners[name], w.shape) if residual is not None else None
        ax.set_xticks(range(w.shape[1]))
        ax.set_yticks(range(w.shape[0]))
        if labels:
            ax.set_xticklabels(labels["x"], fontsize=7)
        if i % cols == 0 or not same:
            ax.set_yticklabels(labels["y"] if labels else range(w.shape[0]), fontsize=7)
            ax.set_ylabel(labels["ylabel"] if labels else "row")
        if i + cols >= len(names) or not same:
            ax.set_xlabel(labels["xlabel"] if labels else "column", fontsize=8)
        for r, c in (partial_cells(owners[name], w.shape) if residual is not None else []):
            ax.text(c, r, "p", ha="center", va="center", color="white", fontsize=8, fontweight="bold")
            any_partial = True
    label = "mean weight over tokens" + (" (grey: no such source)" if residual is not None and any(
        getattr(o, "n_sources", None) for o in owners.values()) else "")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.9, label=label)
    fig.suptitle(title + ("\np: partial sum of the block being built" if any_partial else ""))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
