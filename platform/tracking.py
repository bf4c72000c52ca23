"""MLflow: the local store and run bookkeeping (never left RUNNING). The figures: platform/plots.py."""

from __future__ import annotations

import os
import socket
from pathlib import Path


os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

PID_TAG, HOST_TAG = "platform.pid", "platform.host"
NOTE_TAG, REAPED_NOTE = "platform.note", "process died without closing the run"


def make_logger(**kwargs):
    """Lightning's MLFlowLogger, logging each metric at the number of optimizer steps completed.

    Lightning passes the count *before* the current step finishes (a metric of step 12 arrives
    as 11); shifting by one makes train and validation curves line up with `trainer.max_steps`.
    """
    from lightning.pytorch.loggers import MLFlowLogger

    class StepAlignedMLFlowLogger(MLFlowLogger):
        step_offset = 1  # 0 for a validation after fit, which Lightning reports at the finished step
        logged_steps: dict = {}  # resumed run: metric -> last step the killed process logged

        def log_metrics(self, metrics, step=None):
            step = None if step is None else step + self.step_offset
            if step is not None and self.logged_steps:
                metrics = {k: v for k, v in metrics.items() if step > self.logged_steps.get(k, -1)}
            super().log_metrics(metrics, step)

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
            client.set_tag(run.info.run_id, NOTE_TAG, REAPED_NOTE)
            client.set_terminated(run.info.run_id, "KILLED")
            reaped.append(run.info.run_id)
    return reaped


def run_tags(parent_run_id: str | None = None) -> dict[str, str]:
    tags = {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id  # shows the run nested under its parent in the UI
    return tags
