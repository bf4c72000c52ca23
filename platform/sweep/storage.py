"""The Optuna storage of a study and its bookkeeping: the default URL, opening it (a fresh SQLite file
is created under a file lock, so parallel workers can start together), trials left RUNNING by dead
processes (failed on resume, by pid on this host, by heartbeat on any host), and the MLflow state of
each trial's run.
"""

from __future__ import annotations

import socket
import warnings
from contextlib import contextmanager

import optuna
from omegaconf import DictConfig
from optuna.trial import TrialState

from .. import tracking
from ..env import REPO_ROOT


STATE_NAMES = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "fail",
               TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}


SQLITE_TIMEOUT_S = 60  # a worker waits this long for another worker's write to a SQLite storage


def default_storage() -> str:
    return f"sqlite:///{REPO_ROOT / 'mlruns' / 'optuna.db'}"


@contextmanager
def _quiet_experimental():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def make_storage(sw: DictConfig, client):
    """The study's RDBStorage and its URL. A SQLite file is created (tables, alembic version) under a
    file lock, and waits up to SQLITE_TIMEOUT_S for another worker's write instead of failing."""
    url = sw.storage or default_storage()
    kwargs: dict = {}
    if sw.heartbeat_s > 0:
        kwargs = {"heartbeat_interval": sw.heartbeat_s, "grace_period": 2 * sw.heartbeat_s,
                  "heartbeat_stale_trial_callback": _stale_trial_callback(client)}
    db = tracking.sqlite_path(url)
    with _quiet_experimental():
        if db is None:
            return optuna.storages.RDBStorage(url, **kwargs), url
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
        with tracking.file_lock(db.with_name(db.name + ".lock")):
            return optuna.storages.RDBStorage(url, **kwargs), url


def storage_label(url: str) -> str:
    """The storage URL without a password (it goes into MLflow params and reports)."""
    return tracking.display_uri(url)


def fail_dead_trials(study: optuna.Study, client=None) -> list[int]:
    """Mark this study's trials left RUNNING by a dead process of this host as FAIL (and their MLflow
    runs KILLED). Trials of other hosts are left to the heartbeat (`sweep.heartbeat_s`)."""
    host, failed = socket.gethostname(), []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if t.user_attrs.get("host") != host or pid is None or tracking._alive(int(pid)):
            continue
        # the public Trial API only reaches the trial of this process; the storage reaches any
        study._storage.set_trial_user_attr(t._trial_id, "fail_reason", f"process {pid} on {host} died mid-trial")
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        failed.append(t.number)
        _close_trial_run(client, t.user_attrs.get("mlflow_run_id"), "fail")
    return failed


def _close_trial_run(client, run_id: str | None, state: str) -> None:
    if client is None or not run_id:
        return
    run = client.get_run(run_id)
    if run.info.status == "RUNNING":
        client.set_tag(run_id, "platform.note", "process died without closing the run")
        client.set_terminated(run_id, "KILLED")
    if run.data.tags.get("optuna.state") != state:
        client.set_tag(run_id, "optuna.state", state)


def sync_trial_states(study: optuna.Study, client) -> None:
    """Every finished trial's MLflow run carries its final state (complete / pruned / fail)."""
    if client is None:
        return
    for t in study.get_trials(deepcopy=False):
        if t.state.is_finished() and t.user_attrs.get("mlflow_run_id"):
            _close_trial_run(client, t.user_attrs["mlflow_run_id"], STATE_NAMES[t.state])


def _stale_trial_callback(client):
    def callback(study: optuna.Study, trial) -> None:  # a trial whose heartbeat stopped (any host)
        _close_trial_run(client, trial.user_attrs.get("mlflow_run_id"), "fail")

    return callback
