"""MLflow: the local store, run bookkeeping (never left RUNNING), and end-of-run artifacts."""

from __future__ import annotations

import os
import socket
from pathlib import Path


os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

PID_TAG, HOST_TAG = "platform.pid", "platform.host"


def make_logger(**kwargs):
    """Lightning's MLFlowLogger, logging each metric at the number of optimizer steps completed.

    Lightning passes the count *before* the current step finishes (a metric of step 12 arrives
    as 11); shifting by one makes train and validation curves line up with `trainer.max_steps`.
    """
    from lightning.pytorch.loggers import MLFlowLogger

    class StepAlignedMLFlowLogger(MLFlowLogger):
        def log_metrics(self, metrics, step=None):
            super().log_metrics(metrics, None if step is None else step + 1)

    return StepAlignedMLFlowLogger(**kwargs)


def default_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Artifacts of a local SQLite store live beside it: `<db folder>/artifacts/<experiment>`.

    For the default store that is `mlruns/artifacts/<experiment>`; a server decides for itself.
    """
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):])
        return (db.parent / "artifacts" / experiment).resolve().as_uri()
    return None


def ensure_experiment(client, experiment: str, tracking_uri: str) -> str:
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        return exp.experiment_id
    return client.create_experiment(experiment, artifact_location=default_artifact_location(tracking_uri, experiment))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphans(client, experiment_id: str) -> list[str]:
    """Mark runs of this host left RUNNING by a process that no longer exists (e.g. SIGKILL) as KILLED."""
    host, reaped = socket.gethostname(), []
    runs = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000)
    for run in runs:
        tags = run.data.tags
        if tags.get(HOST_TAG) == host and PID_TAG in tags and not _alive(int(tags[PID_TAG])):
            client.set_tag(run.info.run_id, "platform.note", "process died without closing the run")
            client.set_terminated(run.info.run_id, "KILLED")
            reaped.append(run.info.run_id)
    return reaped


def run_tags(parent_run_id: str | None = None) -> dict[str, str]:
    tags = {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id  # shows the run nested under its parent in the UI
    return tags


def plot_loss_curves(client, run_id: str, out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_depth_weights(recorded: dict, out: Path, title: str) -> Path | None:
    """One heatmap per view: sources (rows) x consuming sublayer (columns), mean weight over tokens."""
    if not recorded:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(recorded)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names) + 1, 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        w = recorded[name].detach().float().cpu().numpy()
        im = ax.imshow(w, aspect="auto", origin="lower", cmap="viridis", vmin=0.0, vmax=max(1e-6, float(w.max())))
        ax.set_title(name)
        ax.set_xticks(range(w.shape[1]))
        ax.set_yticks(range(w.shape[0]))
        ax.set_xlabel("consuming sublayer (last: final output)")
        ax.set_ylabel("source (0: embedding)")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
