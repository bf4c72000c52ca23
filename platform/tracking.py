"""MLflow: opening the store (safe when several processes create it at once), run bookkeeping (never
left RUNNING), the rename map of residuals. The figures: platform/plots.py."""

from __future__ import annotations

import fcntl
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from .env import set_offline_defaults

set_offline_defaults()

PID_TAG, HOST_TAG = "platform.pid", "platform.host"
DEVICE_TAG = "platform.device"  # what trained the run: "1x NVIDIA H200" or "2-core CPU (x86_64), torch ..."
SHARED_TAG = "platform.shared_by"  # runs sharing that device at once (1: alone); its timings depend on it
NOTE_TAG, REAPED_NOTE = "platform.note", "process died without closing the run"

# Residuals renamed after runs were logged under the old name: {old name: new name}. MLflow keeps the
# name a run was logged with (`params.residual/name`); comparisons look runs up under every old name
# of a residual and hash them under the new one, so a rename does not orphan earlier runs. Add an
# entry whenever `@register("...")` of a residual changes; never remove one.
RENAMED: dict[str, str] = {}


def canonical_residual(name: str) -> str:
    """The current name of a residual, following RENAMED (a chain a -> b -> c ends at c)."""
    seen = {name}
    while name in RENAMED:
        name = RENAMED[name]
        if name in seen:
            raise ValueError(f"tracking.RENAMED has a cycle through {name!r}")
        seen.add(name)
    return name


def logged_names(name: str) -> list[str]:
    """Every name runs of this residual may carry in MLflow: the current one first, then old ones."""
    current = canonical_residual(name)
    return [current, *sorted(old for old in RENAMED if canonical_residual(old) == current and old != current)]


@contextmanager
def file_lock(path: Path):
    """An exclusive advisory lock (fcntl) on `path` for the block; processes on one machine queue."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///...` URL (None for any other URL)."""
    return Path(uri[len("sqlite:///"):]).expanduser() if uri.startswith("sqlite:///") else None


def prepare_store(uri: str) -> None:
    """Create and migrate a local SQLite tracking store under a file lock.

    MLflow creates the tables and runs its alembic migrations when a process first opens a store;
    two processes doing that at once on a fresh file crash ("table ... already exists", "Online
    migration expected to match one row"). Opening it here, one process at a time, leaves a migrated
    store; later opens only check it. A server or PostgreSQL store is created by its administrator.
    """
    db = sqlite_path(uri)
    if db is None:
        return
    import mlflow

    with file_lock(db.with_name(db.name + ".lock")):
        mlflow.MlflowClient(uri).search_experiments(max_results=1)  # creates and migrates the schema


def display_uri(uri: str) -> str:
    """A store URL without its password (for reports, MLflow params and logs)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(uri).render_as_string(hide_password=True)
    except Exception:  # not a SQLAlchemy URL (e.g. http://): drop any user:password@
        scheme, sep, rest = uri.partition("://")
        return scheme + sep + rest.split("@", 1)[-1] if sep else uri


def open_experiment(cfg, reap: bool = True):
    """The MLflow client of a config, its tracking URI and experiment id (created if needed); with
    `reap`, runs of dead processes of this host are closed first. Returns (client, uri, experiment_id)."""
    import mlflow

    from .config import tracking_uri

    uri = tracking_uri(cfg)
    prepare_store(uri)
    client = mlflow.MlflowClient(uri)
    experiment_id = ensure_experiment(client, cfg.mlflow.experiment, uri)
    if reap:
        reap_orphans(client, experiment_id)
    return client, uri, experiment_id


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
    db = sqlite_path(tracking_uri)
    return None if db is None else (db.parent / "artifacts" / experiment).resolve().as_uri()


def ensure_experiment(client, experiment: str, tracking_uri: str) -> str:
    """The experiment's id, created if missing (another process creating it at the same time is fine)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        return exp.experiment_id
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(experiment,
                                        artifact_location=default_artifact_location(tracking_uri, experiment))
    except MlflowException:  # created by another worker between the lookup and here
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise
        return exp.experiment_id


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
    from .env import SHARED_ENV, machine_description

    tags = {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname(), DEVICE_TAG: machine_description(),
            SHARED_TAG: os.environ.get(SHARED_ENV, "1")}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id  # shows the run nested under its parent in the UI
    return tags
